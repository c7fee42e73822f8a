"""A user's own data, envs and checkpoints through the CLI (issue 43): every bad input is one named line with exit
code 2 (Ctrl-C: 130), no exception escapes, and the files that were there before are unchanged.

One table (`CASES`) drives `jaxrl_llm.cli.main.main` in-process; each case builds its inputs in its own folder,
and the test asserts the exit code, the words that name the problem on the last line of stderr (one line, no
traceback) and that every file present before the command is byte for byte the same after. Only Ctrl-C runs in
a subprocess (a real SIGINT). The property tests at the end corrupt a valid JSON Lines file at random: it loads
whole or is refused with the right 1-based line.

Cheap by design: the tiny preset with two layers; the model is built and initialised once for the module (an
exported Hugging Face folder and a run with checkpoints made without training), and no case compiles a step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_base.errors import DataError, JaxrlError
from jaxrl_llm.cli.main import main
from jaxrl_llm.data.sft_data import load_sft_dataset

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
SMALL = ['model.num_hidden_layers=2', 'model.layer_types=["conv", "full_attention"]']
ROW = {"prompt": [{"role": "system", "content": "Play."}, {"role": "user", "content": "Your move?"}],
       "completion": [{"role": "assistant", "content": "<move>5</move>"}, {"role": "user", "content": "Done."}],
       "info": {"seed": 1}}


# ---- shared inputs: built once ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the cases copy from: an exported HF folder, a GRPO run with checkpoints at steps 1 and 2 (fresh
    params, no training), the same run with NaN weights, and an SFT in progress (step 1)."""

    hf: Path
    run: Path
    nan_run: Path
    sft_run: Path


def _settings(out: Path, *extra: str) -> list[str]:
    args = []
    for item in (*SMALL, f'run.output_dir="{out}"', *extra):
        args += ["--set", item]
    return args


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    import jaxrl_llm.checkpoint as storage
    from jaxrl_llm.algos.optim import make_optimizer
    from jaxrl_llm.cli.main import export_policy
    from jaxrl_llm.compat import run_checkpointer
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train import build
    from jaxrl_llm.train.components import fresh_trainable
    from jaxrl_llm.train.loop import TrainState
    from jaxrl_llm.train.sft_resume import sft_progress_dir

    root = tmp_path_factory.mktemp("inputs")
    config = load_config(PRESET, [*SMALL, f'run.output_dir="{root / "run"}"'])
    comp = build(config)
    params = fresh_trainable(comp)
    export_policy(comp, params, config, root / "hf")

    def save_run(folder: Path, weights, stage_optim, steps, metadata, ckpt_dir=None) -> None:
        run_config = load_config(PRESET, [*SMALL, f'run.output_dir="{folder}"'])
        state_opt = make_optimizer(stage_optim).init(weights)
        directory = ckpt_dir(run_config) if ckpt_dir else run_config.checkpoint_dir()
        with run_checkpointer(directory, keep=3, async_save=False) as ckpt:
            for step in steps:
                tree = TrainState(weights, state_opt, step, jax.random.PRNGKey(0)).checkpoint_tree()
                ckpt.save(step, tree, config=run_config, metadata=metadata)
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps))

    save_run(root / "run", params, config.grpo[0].optim_config(), (1, 2), {"stage": 0})
    (root / "run" / "eval_metrics.jsonl").write_text(json.dumps({"step": 2, "random_win": 0.5}) + "\n")
    nan = jax.tree.map(lambda x: x * np.float32(np.nan), params)
    real_check = storage.non_finite
    storage.non_finite = lambda named: {}  # a run that saved NaN weights before they were refused on save
    try:
        save_run(root / "nan_run", nan, config.grpo[0].optim_config(), (1, 2), {"stage": 0})
    finally:
        storage.non_finite = real_check
    (root / "nan_run" / "eval_metrics.jsonl").write_text(json.dumps({"step": 2, "random_win": 0.5}) + "\n")
    save_run(root / "sft_run", params, config.sft.optim.for_steps(config.sft.steps), (1,),
             {"sft_step": 1, "stopped": False}, ckpt_dir=sft_progress_dir)
    return Inputs(root / "hf", root / "run", root / "nan_run", root / "sft_run")


# ---- the cases -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: `make(folder, inputs)` writes what it needs under `folder` and returns the command line;
    the last stderr line must hold every word of `words`; `code` is the exit status."""

    name: str
    make: Callable[[Path, Inputs], list[str]]
    words: tuple[str, ...]
    code: int = 2


def _rows(n: int = 3) -> str:
    return "".join(json.dumps(ROW) + "\n" for _ in range(n))


def _sft_with(text: str | bytes, name: str = "games.jsonl") -> Callable[[Path, Inputs], list[str]]:
    def make(folder: Path, _: Inputs) -> list[str]:
        data = folder / name
        data.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["sft", str(PRESET), *_settings(folder / "run", f'sft.dataset="{data}"')]

    return make


def _parquet_without_completion(folder: Path, _: Inputs) -> list[str]:
    import datasets

    datasets.Dataset.from_list([{"prompt": ROW["prompt"]}] * 2).to_parquet(str(folder / "games.parquet"))
    return ["sft", str(PRESET), *_settings(folder / "run", f'sft.dataset="{folder / "games.parquet"}"')]


def _copy(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def _hf_damaged(damage: Callable[[Path], None]) -> Callable[[Path, Inputs], list[str]]:
    def make(folder: Path, inputs: Inputs) -> list[str]:
        hf = _copy(inputs.hf, folder / "hf")
        damage(hf)
        return ["eval", str(PRESET), *_settings(folder / "run"), "--checkpoint", str(hf)]

    return make


def _cut(name: str) -> Callable[[Path], None]:
    def damage(hf: Path) -> None:
        text = (hf / name).read_text()
        (hf / name).write_text(text[: len(text) // 2])

    return damage


def _other_model_type(hf: Path) -> None:
    data = json.loads((hf / "config.json").read_text())
    data["model_type"] = "llama"
    (hf / "config.json").write_text(json.dumps(data))


def _weights_with(value: float) -> Callable[[Path], None]:
    def damage(hf: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(hf / "model.safetensors"))
        name = "model.layers.0.conv.in_proj.weight"
        tensors[name] = tensors[name].copy()
        tensors[name][0, :3] = value
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})

    return damage


def _resume(*changes: str, sft: bool = False) -> Callable[[Path, Inputs], list[str]]:
    def make(folder: Path, inputs: Inputs) -> list[str]:
        run = _copy(inputs.sft_run if sft else inputs.run, folder / "run")
        return ["sft" if sft else "train", str(PRESET), *_settings(run, *changes)]

    return make


def _eval_nan_checkpoint(folder: Path, inputs: Inputs) -> list[str]:
    run = _copy(inputs.nan_run, folder / "run")
    return ["eval", str(PRESET), *_settings(run), "--checkpoint", str(run / "checkpoints")]


def _eval_games_exists(folder: Path, inputs: Inputs) -> list[str]:
    (folder / "games.jsonl").write_text("my earlier games\n")
    return ["eval", str(PRESET), *_settings(folder / "run"), "--games", str(folder / "games.jsonl")]


def _eval_games_folder(folder: Path, inputs: Inputs) -> list[str]:
    (folder / "games").mkdir()
    return ["eval", str(PRESET), *_settings(folder / "run"), "--games", str(folder / "games")]


def _plot(content: str | None, out_exists: bool = False) -> Callable[[Path, Inputs], list[str]]:
    def make(folder: Path, _: Inputs) -> list[str]:
        metrics = folder / "metrics.jsonl"
        if content is not None:
            metrics.write_text(content)
        if out_exists:
            (folder / "curves.png").write_bytes(b"an earlier plot")
        return ["plot", str(metrics), "--out", str(folder / "curves.png")]

    return make


def _output_dir_file(inside: bool) -> Callable[[Path, Inputs], list[str]]:
    def make(folder: Path, _: Inputs) -> list[str]:
        (folder / "notes.txt").write_text("a file where the run folder should be\n")
        out = folder / "notes.txt" / "run" if inside else folder / "notes.txt"
        return ["sft", str(PRESET), "--set", f'run.output_dir="{out}"']

    return make


def _check_env(cls: str) -> Callable[[Path, Inputs], list[str]]:
    return lambda folder, _: ["check-env", f"user_error_envs:{cls}", "--max-turns", "3"]


def _plain(*argv: str) -> Callable[[Path, Inputs], list[str]]:
    return lambda folder, _: [*argv]


def _dataset_folder_without_data(folder: Path, _: Inputs) -> list[str]:
    (folder / "data").mkdir()
    (folder / "data" / "README.md").write_text("no data here\n")
    return ["sft", str(PRESET), *_settings(folder / "run", f'sft.dataset="{folder / "data"}"')]


def _eval_no_checkpoint(folder: Path, _: Inputs) -> list[str]:
    (folder / "empty").mkdir()
    return ["eval", str(PRESET), *_settings(folder / "run"), "--checkpoint", str(folder / "empty")]


_BAD_CONTENT = json.dumps({**ROW, "completion": [{"role": "assistant", "content": 7}]}) + "\n"

CASES = [
    # -- the issue's list --
    Case("jsonl-broken-4th-line", _sft_with(_rows(3) + json.dumps(ROW)[:66] + "\n" + _rows(1)),
         ("games.jsonl line 4", "not valid JSON")),
    Case("jsonl-empty", _sft_with(""), ("games.jsonl is empty",)),
    Case("jsonl-row-without-completion", _sft_with(_rows(2) + json.dumps({"prompt": ROW["prompt"]}) + "\n"),
         ("games.jsonl line 3", "has no 'completion'")),
    Case("resume-changed-learning-rate", _resume("grpo.0.optim.learning_rate=2e-4"),
         ("grpo.0.optim.learning_rate: 0.0001 -> 0.0002", "--accept-config-change", "step 2")),
    Case("resume-changed-schedule", _resume("grpo.0.curriculum.p_max=0.9", "grpo.1.optim.learning_rate=1e-4"),
         ("grpo.0.curriculum.p_max: 0.7 -> 0.9", "grpo.1.optim.learning_rate: 5e-05 -> 0.0001")),
    Case("hf-weights-nan", _hf_damaged(_weights_with(np.nan)),
         ("model.layers.0.conv.in_proj.weight", "3 NaN", "NaN or infinite")),
    Case("orbax-weights-nan", _eval_nan_checkpoint, ("every checkpoint", "NaN or infinite", "params/")),
    Case("check-env-nan-reward", _check_env("NaNReward"), ("rubric part 'solved'", "NaN in 8 of 8 games")),
    Case("eval-games-file-exists", _eval_games_exists, ("--games", "exists", "--force")),
    Case("hf-env-record-cut", _hf_damaged(_cut("jaxrl_llm_env.json")), ("jaxrl_llm_env.json", "not valid JSON")),
    Case("hf-config-cut", _hf_damaged(_cut("config.json")), ("config.json is not valid JSON", "cut short")),
    Case("hf-unsupported-model-type", _hf_damaged(_other_model_type), ("model_type 'llama'", "not 'lfm2'")),
    Case("check-env-reset-field-shape", _check_env("BadCodes"),
         ("message_codes after reset raised", "Cannot stack arrays", "(8,), (8, 2)", "given State(secret=int32[8]")),
    Case("plot-empty-metrics", _plot(""), ("metrics.jsonl is empty", "nothing to plot")),
    Case("bad-set-blamed-on-the-override", _plain("sft", str(PRESET), "--set", "sft.stepz=3"),
         ("unknown key 'stepz'", "did you mean 'steps'", "from --set 'sft.stepz=3'", "alone is valid")),
    Case("preset-is-a-folder", _plain("sft", str(PRESET.parent)), ("is a folder, not a TOML file", "presets there: ")),
    Case("output-dir-is-a-file", _output_dir_file(inside=False), ("run.output_dir", "notes.txt' is a file")),
    # -- beyond the issue's list: what a user of these parts would also get wrong --
    Case("jsonl-content-not-a-string", _sft_with(_rows(1) + _BAD_CONTENT), ("line 2", "completion[0].content is int")),
    Case("jsonl-line-is-an-array", _sft_with(_rows(2) + "[1, 2]\n"), ("line 3 is a JSON list", "not an object")),
    Case("json-list-bad-item", _sft_with(json.dumps([ROW, {**ROW, "prompt": "hi"}]), "games.json"),
         ("games.json item 2", "'prompt' is str")),
    Case("jsonl-not-utf8", _sft_with(_rows(1).encode() + b'{"prompt": "\xff"}\n'), ("line 2", "not UTF-8")),
    Case("parquet-without-completion", _parquet_without_completion, ("games.parquet has no 'completion' column",)),
    Case("parquet-garbage", _sft_with(b"PAR1 not really parquet", "games.parquet"), ("not readable as Parquet",)),
    Case("dataset-folder-without-data", _dataset_folder_without_data, ("no save_to_disk dataset",)),
    Case("dataset-missing", _plain("sft", str(PRESET), "--set", 'sft.dataset="/nonexistent/games.jsonl"'),
         ("sft.dataset", "/nonexistent/games.jsonl' does not exist", "from --set")),
    Case("hf-weights-infinite", _hf_damaged(_weights_with(np.inf)), ("3 infinite", "in_proj.weight")),
    Case("resume-changed-seed", _resume("run.seed=1"), ("run.seed: 0 -> 1",)),
    Case("resume-shortened-finished-stage", _resume("grpo.0.steps=1"), ("grpo.0.steps: 2 -> 1",)),
    Case("sft-resume-changed-batch", _resume("sft.batch_size=8", sft=True), ("sft.batch_size: 4 -> 8", "SFT")),
    Case("check-env-infinite-metric", _check_env("InfiniteMetric"), ("'guesses'", "never infinite")),
    Case("check-env-reward-raises", _check_env("RaisingReward"), ("reward_parts raised KeyError", "no such key")),
    Case("check-env-nan-turn-reward", _check_env("NaNTurnReward"), ("turn_reward at turn 1", "must be finite")),
    Case("check-env-unknown-name", _plain("check-env", "tictactoee"), ("did you mean 'tictactoe'",)),
    Case("eval-games-is-a-folder", _eval_games_folder, ("--games", "is a folder")),
    Case("eval-checkpoint-without-steps", _eval_no_checkpoint, ("holds no checkpoint",)),
    Case("plot-out-exists", _plot(json.dumps({"step": 1, "loss": 1.0}) + "\n", out_exists=True),
         ("--out", "exists", "--force")),
    Case("plot-only-cut-lines", _plot('{"step": 1, "lo'), ("holds no complete metrics row",)),
    Case("plot-missing-file", _plot(None), ("no metrics file or folder",)),
    Case("preset-misspelled", _plain("sft", str(PRESET.with_name("tiny_tset.toml"))),
         ("does not exist", "did you mean", "tiny_test.toml")),
    Case("set-without-value", _plain("sft", str(PRESET), "--set", "sft.steps"), ("--set 'sft.steps'", "key=value")),
    Case("output-dir-inside-a-file", _output_dir_file(inside=True), ("inside", "notes.txt", "which is a file")),
]


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_input_is_one_named_line_and_changes_nothing(case, inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JAXRL_LLM_DEBUG", raising=False)
    argv = case.make(tmp_path, inputs)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = main(argv)  # an exception escaping fails the test
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == case.code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert lines and lines[-1].startswith(f"jaxrl-llm {argv[0]}: "), err[-3000:]
    for word in case.words:
        assert word in lines[-1], f"{word!r} not in {lines[-1]!r}"
    after = _snapshot(tmp_path)
    changed = [name for name, digest in before.items() if after.get(name) != digest]
    assert not changed, f"files changed or removed: {changed}"


def test_the_cases_cover_the_issue_and_ten_more():
    assert len(CASES) >= 17 + 10 and len({c.name for c in CASES}) == len(CASES)


# ---- the error path itself -------------------------------------------------------------------------------------

def test_debug_variable_shows_the_traceback_and_a_bug_stays_one(monkeypatch, capsys, tmp_path):
    import importlib

    cli = importlib.import_module("jaxrl_llm.cli.main")  # the module (the package exports its `main` function)

    monkeypatch.setenv("JAXRL_LLM_DEBUG", "1")
    assert main(["plot", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("jaxrl-llm plot: no metrics file")
    monkeypatch.delenv("JAXRL_LLM_DEBUG")

    def bug(args):
        return 1 // 0

    monkeypatch.setattr(cli, "cmd_plot", bug)
    with pytest.raises(ZeroDivisionError):  # not a user's error: it stays a traceback
        main(["plot", "x.jsonl"])
    assert issubclass(DataError, JaxrlError) and issubclass(DataError, ValueError)


def test_every_named_error_has_a_base_and_keeps_its_builtin_one():
    from envs.check import EnvCheckError
    from envs.registry import EnvNotFoundError
    from jaxrl_base.errors import CheckpointError, EnvError, ModelError
    from jaxrl_llm.checkpoint import (CheckpointDamagedError, CheckpointMismatchError, CheckpointNotFoundError,
                                      CheckpointWriteError)
    from jaxrl_llm.run_lock import RunExistsError, RunLockedError
    from jaxrl_llm.train.loop import NonFiniteLossError
    from models.hf import HfCheckpointError

    pairs = [(CheckpointNotFoundError, CheckpointError, FileNotFoundError), (CheckpointMismatchError, CheckpointError,
             ValueError), (CheckpointDamagedError, CheckpointError, ValueError), (CheckpointWriteError,
             CheckpointError, OSError), (HfCheckpointError, ModelError, ValueError), (EnvCheckError, EnvError,
             AssertionError), (EnvNotFoundError, EnvError, KeyError), (RunLockedError, JaxrlError, RuntimeError),
             (RunExistsError, CheckpointError, FileExistsError), (NonFiniteLossError, JaxrlError, FloatingPointError)]
    for cls, base, builtin in pairs:
        assert issubclass(cls, base) and issubclass(cls, builtin), cls
    error = CheckpointWriteError(28, "could not write", "/x")
    assert error.errno == 28 and "could not write" in str(error)


def test_ctrl_c_is_one_line_naming_the_checkpoint_kept(inputs, tmp_path):
    """A real SIGINT while `train` runs (its work replaced by a wait, so nothing compiles): exit 130, one line
    naming the last checkpoint kept and how to resume; the run's files unchanged."""
    run = _copy(inputs.run, tmp_path / "run")
    before = _snapshot(run)
    # pytest-xdist's workers ignore SIGINT, and a child inherits an ignored signal: restore Python's handler
    # first, as in a terminal.
    script = ("import importlib, signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "cli = importlib.import_module('jaxrl_llm.cli.main')\n"
              "def waiting(args):\n    cli._load(args)\n    print('ready', flush=True)\n    time.sleep(300)\n"
              "    return 0\n"
              "cli.cmd_train = waiting\nsys.exit(cli.main(sys.argv[1:]))\n")
    argv = [sys.executable, "-c", script, "train", str(PRESET), *_settings(run)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("JAXRL_LLM_DEBUG", None)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("jaxrl-llm train: interrupted (Ctrl-C)") and "GRPO step 2" in line, line
    assert "run the same command again to resume" in line
    assert _snapshot(run) == before


def test_an_accepted_config_change_is_recorded_in_the_next_metrics_row(tmp_path):
    from jaxrl_llm.config import config_to_dict, load_config
    from jaxrl_llm.run_config import check_resumed_config
    from jaxrl_llm.train.loop import RunLog

    old = load_config(PRESET, [f'run.output_dir="{tmp_path}"'])
    new = load_config(PRESET, [f'run.output_dir="{tmp_path}"', "grpo.0.optim.learning_rate=2e-4",
                               "checkpoint.accept_config_change=true"])
    note = check_resumed_config(config_to_dict(old), new, 1, "grpo", "the run", log=lambda _: None)
    run = RunLog(new, "metrics.jsonl", "grpo", 3, (), log=lambda *_: None)
    run.notes.update(note)
    run.write(2, {"loss": 1.0})
    run.write(3, {"loss": 1.0})
    run.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["config_change"] == "grpo.0.optim.learning_rate: 0.0001 -> 0.0002"
    assert "config_change" not in rows[1]
    # Extending the schedule needs no flag, and is recorded all the same.
    more = load_config(PRESET, [f'run.output_dir="{tmp_path}"', "grpo.1.steps=4"])
    assert check_resumed_config(config_to_dict(old), more, 3, "grpo", "the run", log=lambda _: None) == {
        "config_change": "grpo.1.steps: 1 -> 4"}


def test_non_finite_weights_are_never_saved_or_exported(inputs, tmp_path):
    import jax.numpy as jnp

    from jaxrl_base.errors import ModelError
    from jaxrl_llm.checkpoint import Checkpointer, CheckpointNonFiniteError
    from models.hf import load_hf, save_hf

    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        with pytest.raises(CheckpointNonFiniteError, match=r"'w' \(1 NaN of 4\)"):
            ckpt.save(1, {"w": jnp.array([0.0, jnp.nan, 1.0, 2.0])})
        assert ckpt.all_steps() == []
    model = load_hf(inputs.hf)
    broken = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), model.params)
    with pytest.raises(ModelError, match="refusing to write weights with NaN or infinite values"):
        save_hf(model.config, broken, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- the JSON Lines loader under random corruption ---------------------------------------------------------------

CORRUPTIONS = ("cut", "content_type", "role_type", "messages_type", "drop_key", "drop_message_key", "not_object",
               "blank_lines")


@st.composite
def corrupted_files(draw):
    """(lines of a JSONL file, the 1-based line of its first bad record or None when it must load whole, the
    number of records it holds)."""
    count = draw(st.integers(1, 6))
    rows = [json.loads(json.dumps(ROW)) for _ in range(count)]
    for i, row in enumerate(rows):
        row["info"] = {"seed": i}
    lines = [json.dumps(row) for row in rows]
    kind = draw(st.sampled_from(CORRUPTIONS))
    at = draw(st.integers(0, count - 1))
    row = rows[at]
    field = draw(st.sampled_from(["prompt", "completion"]))
    if kind == "cut":
        lines[at] = lines[at][: draw(st.integers(1, len(lines[at]) - 1))]
    elif kind == "content_type":
        row[field][0]["content"] = draw(st.one_of(st.integers(), st.none(), st.booleans(),
                                                  st.lists(st.text(), max_size=2)))
    elif kind == "role_type":
        row[field][-1]["role"] = draw(st.one_of(st.integers(), st.none(), st.floats(allow_nan=False)))
    elif kind == "messages_type":
        row[field] = draw(st.one_of(st.text(max_size=5), st.integers(), st.none(),
                                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
    elif kind == "drop_key":
        del row[field]
    elif kind == "drop_message_key":
        del row[field][0][draw(st.sampled_from(["role", "content"]))]
    elif kind == "not_object":
        lines[at] = json.dumps(draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=3), st.text(max_size=5))))
    if kind not in ("cut", "not_object", "blank_lines"):
        lines[at] = json.dumps(row)
    bad = at
    if kind == "blank_lines":  # blank lines hold no record: the file loads whole
        for _ in range(draw(st.integers(1, 3))):
            lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["", " ", "\t"])))
        return lines, None, count
    before = draw(st.integers(0, 2))  # blank lines above the bad one still count in its line number
    for _ in range(before):
        lines.insert(0, "")
    return lines, bad + 1 + before, count


@settings(max_examples=60, deadline=None)
@given(case=corrupted_files())
def test_a_corrupted_jsonl_file_loads_whole_or_names_its_line(case, tmp_path_factory):
    lines, bad_line, count = case
    path = tmp_path_factory.mktemp("jsonl") / "games.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if bad_line is None:
        rows = load_sft_dataset(path).to_list()
        assert [r["info"]["seed"] for r in rows] == list(range(count))
        return
    with pytest.raises(DataError) as info:
        load_sft_dataset(path)
    message = str(info.value)
    assert re.search(rf"games\.jsonl line {bad_line}\b", message), (message, bad_line)
    assert "\n" not in message


def test_a_training_step_names_the_env_reward_part_before_the_learning_rate():
    import envs
    from jaxrl_base.errors import EnvError
    from jaxrl_llm.train.env_values import check_env_values

    env = envs.make("tictactoe")
    fine = {"loss": float("nan"), "win_reward": 0.5, "format_reward": 1.0, "invalid_reward": 0.0, "win_rate": 0.5,
            "draw_rate": float("nan")}  # a NaN metric is "not this game's metric": allowed
    check_env_values(fine, env, "GRPO", 1)
    with pytest.raises(EnvError, match=r"GRPO step 1: the env 'tictactoe' gave a non-finite reward: rubric part "
                                       r"'win' = nan"):
        check_env_values({**fine, "win_reward": float("nan")}, env, "GRPO", 1)
    with pytest.raises(EnvError, match=r"infinite metric \(win_rate = inf\)"):
        check_env_values({**fine, "win_rate": float("inf")}, env, "GRPO", 3)
