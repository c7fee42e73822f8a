"""Fault injection on real runs (issue 17): SIGKILL at six moments of a tiny experiment (two in SFT), a full disk, an
unwritable output folder, and checkpoints or exports that do not fit the config, through the CLI.

The kill chain runs the `experiment` command's loops in subprocesses (`tests/kill_at.py`: a loop-event hook
that SIGKILLs the process; the last, uninterrupted restart is the CLI itself) that share one persistent
compilation cache (set by conftest.py), so each restart costs seconds, not a compile."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.checkpoint import Checkpointer, CheckpointWriteError
from jaxrl_llm.cli.main import main
from jaxrl_llm.metrics import MetricsWriter, read_metrics

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
SMALL = ['model.num_hidden_layers=2', 'model.layer_types=["conv", "full_attention"]', "eval.num_games=4"]

# SFT 3 steps, GRPO 4 + 2 steps (a checkpoint after every step, saved asynchronously), an evaluation
# every 3 GRPO steps, then the experiment's final evaluation of the base, SFT and RL models.
CHAIN = SMALL + ["sft.steps=3", "grpo.0.steps=4", "grpo.1.steps=2", "grpo.0.rollout.max_turns=2",
                 "grpo.0.sampling.max_new_tokens=8", "checkpoint.every_steps=1", "checkpoint.async_save=true",
                 "eval.every_steps=3"]
# Where each restart of one run is killed (`tests/kill_at.py`: "<point>@<step>"), in order.
# SFT (3 steps, a progress checkpoint after steps 1 and 2): killed while saving step 2, then after its last step
# before the finished SFT is saved; each restart resumes SFT from its newest progress checkpoint.
KILL_POINTS = ["sft_async_save@2", "sft_step@3", "grpo_step@2", "async_save@3", "after_commit@4", "eval@6"]
VOLATILE = {"time", "step_time", "games_per_s", "tokens_per_s", "sampled_tokens_per_s"}
OUTPUTS = ("sft_metrics.jsonl", "metrics.jsonl", "eval_metrics.jsonl")


def _experiment(out: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    command = [str(ROOT / "tests" / "kill_at.py"), kill_at] if kill_at else ["-m", "jaxrl_llm.cli"]
    cmd = [sys.executable, *command, "experiment", str(PRESET), "--set", f'run.output_dir="{out}"']
    for item in CHAIN:
        cmd += ["--set", item]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _stable(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in read_metrics(path)]


def test_sigkill_at_six_points_then_resume_gives_the_uninterrupted_run(tmp_path):
    reference = _experiment(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "Given directory is read only" not in reference.stderr  # Orbax's noise (issue 17, case 5)
    want = {name: _stable(tmp_path / "reference" / name) for name in OUTPUTS}
    assert [r["step"] for r in want["metrics.jsonl"]] == list(range(1, 7))
    assert [r["step"] for r in want["eval_metrics.jsonl"]] == [3, 6]

    run = tmp_path / "killed"
    for point in KILL_POINTS:
        killed = _experiment(run, kill_at=point)
        assert killed.returncode == -9, f"the run was not killed at {point}: rc {killed.returncode}\n" \
                                        f"{killed.stdout[-2000:]}{killed.stderr[-2000:]}"
    done = _experiment(run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout, done.stdout[-2000:]
    for name in OUTPUTS:  # bitwise, step for step: none missing, none written twice
        assert _stable(run / name) == want[name], name
    assert (run / "results.md").read_text() == (tmp_path / "reference" / "results.md").read_text()


# ---- a full disk, an unwritable folder: the error names the path; the last good checkpoint survives ----

DISK_FULL = textwrap.dedent(
    """
    import resource, signal, sys
    import jax.numpy as jnp, numpy as np
    from jaxrl_llm.checkpoint import Checkpointer, CheckpointWriteError
    folder, async_save = sys.argv[1], sys.argv[2] == "async"
    noise = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    big = {"w": jnp.asarray(noise)}  # 4 MiB that do not compress: more than the file-size limit below
    with Checkpointer(folder, async_save=async_save) as ckpt:
        ckpt.save(1, {"w": jnp.ones((1 << 20,), jnp.float32)})
        ckpt.wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
        try:
            ckpt.save(2, big)
            ckpt.wait()
            print("SAVED")
        except CheckpointWriteError as e:
            print("ERROR", e)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_names_the_folder_and_keeps_the_last_committed_step(tmp_path, mode):
    folder = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", DISK_FULL, str(folder), mode], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR"), done.stdout[-2000:]
    assert str(folder) in line and "step 2" in line and "step 1, is kept" in line, line
    with Checkpointer(folder, read_only=True) as ckpt:
        assert ckpt.all_steps() == [1]
        state = ckpt.restore(1, target={"w": jax.ShapeDtypeStruct((1 << 20,), jnp.float32)})
    assert np.all(np.asarray(state["w"]) == 1)


def test_an_unwritable_output_folder_is_named(tmp_path, capsys):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the output folder's parent should be\n")  # fails for root too (ENOTDIR)
    with pytest.raises(CheckpointWriteError, match=f"cannot create the checkpoint directory.*{blocker}"):
        Checkpointer(blocker / "checkpoints")
    with pytest.raises(OSError, match=str(blocker)):
        MetricsWriter(blocker / "metrics.jsonl")
    rc = main(["train", str(PRESET), "--set", f'run.output_dir="{blocker / "run"}"'])
    err = capsys.readouterr().err
    assert rc == 2 and "jaxrl-llm train:" in err and str(blocker) in err and "Traceback" not in err
    if os.geteuid() != 0:  # a read-only folder (root writes through permissions, so only as a user)
        locked = tmp_path / "locked"
        with Checkpointer(locked, async_save=False) as ckpt:
            ckpt.save(1, {"w": jnp.ones((4,))})
        locked.chmod(0o500)
        try:
            with pytest.raises(CheckpointWriteError, match=f"{locked}.*step 1, is kept"):
                with Checkpointer(locked, async_save=False) as ckpt:
                    ckpt.save(2, {"w": jnp.ones((4,))})
        finally:
            locked.chmod(0o700)


# ---- a checkpoint or an export that does not fit the config: both values named, before any compile ----

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An HF folder exported from the tiny preset's fresh model (config.json, safetensors, tokenizer, env)."""
    from jaxrl_llm.cli.main import export_policy
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train import build, fresh_params, init_key

    config = load_config(PRESET, SMALL)
    comp = build(config)
    folder = tmp_path_factory.mktemp("export") / "model"
    export_policy(comp, fresh_params(comp, init_key(config)), config, folder)
    return folder


def _copy(folder: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(folder, dest)
    return dest


def _other_env(folder: Path) -> tuple[str, str]:
    record = json.loads((folder / "jaxrl_llm_env.json").read_text())
    record["name"] = "nim"
    (folder / "jaxrl_llm_env.json").write_text(json.dumps(record))
    return "'nim'", "'tictactoe'"


def _other_vocabulary(folder: Path) -> tuple[str, str]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same size, another token -> id map
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return str(folder), "the project's tokenizer"


def _other_width(folder: Path) -> tuple[str, str]:
    config = json.loads((folder / "config.json").read_text())
    want = config["hidden_size"]
    config["hidden_size"] = want * 2
    (folder / "config.json").write_text(json.dumps(config))
    return str(want * 2), str(want)


@pytest.mark.parametrize("damage", [_other_env, _other_vocabulary, _other_width], ids=["env", "vocabulary", "shape"])
@pytest.mark.parametrize("command", ["eval", "play", "export", "train"])
def test_a_checkpoint_that_does_not_fit_the_config_names_both_values(exported, tmp_path, capsys, command, damage):
    folder = _copy(exported, tmp_path / "model")
    theirs, ours = damage(folder)
    args = [command, str(PRESET), "--set", f'run.output_dir="{tmp_path / "run"}"']
    for item in SMALL:
        args += ["--set", item]
    if command == "train":
        args += ["--set", f'model.init_from="{folder}"']
    else:
        args += ["--checkpoint", str(folder)]
    if command == "export":
        args += ["--out", str(tmp_path / "out")]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"jaxrl-llm {command}:" in err and "Traceback" not in err
    assert theirs in err and ours in err, err
    assert not (tmp_path / "out").exists()  # export wrote nothing


def test_orbax_does_not_warn_on_a_read_only_restore(tmp_path, caplog):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones((4,))})
    with caplog.at_level(logging.DEBUG):
        with Checkpointer(tmp_path, read_only=True) as ckpt:
            ckpt.restore(1, target={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert not [r for r in caplog.records if "read only" in r.getMessage()]


# ---- the second probe's cases, through the CLI ----

def test_play_ends_cleanly_when_input_ends_and_refuses_non_ascii_digits(tmp_path):
    from jaxrl_llm.cli.play import play_terminal
    from jaxrl_llm.config import load_config

    config = load_config(PRESET, [f'run.output_dir="{tmp_path}"', *SMALL, "sampling.max_new_tokens=8"])
    answers = iter(["y", "²", "٣", "３"])  # a superscript, an Arabic-Indic and a full-width digit, then EOF

    def person(prompt):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    lines = []
    assert play_terminal(config, input_fn=person, print_fn=lines.append) == 0
    text = "\n".join(lines)
    for bad in ("²", "٣", "３"):
        assert f"{bad!r} is not one of" in text  # never taken as a cell
    assert lines[-1] == "\n(input ended: game over)"


def test_resume_false_on_an_existing_run_is_refused_and_truncates_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3))
    (run / "metrics.jsonl").write_text(rows)
    rc = main(["train", str(PRESET), "--set", f'run.output_dir="{run}"', "--set", "checkpoint.resume=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoint.resume = false" in err and "3 steps" in err and "nothing was changed" in err
    assert (run / "metrics.jsonl").read_text() == rows


@pytest.mark.parametrize("override, named", [
    ("model.vocab_size=100", "model.vocab_size: the tokenizer (the project tokenizer) has 548 tokens"),
    ("grpo.0.rollout.context_length=50", "grpo.0.rollout.context_length: 50 cannot hold the system prompt"),
])
def test_sizes_that_cannot_work_are_named_before_compiling(tmp_path, capsys, override, named):
    rc = main(["train", str(PRESET), "--set", f'run.output_dir="{tmp_path}"', "--set", override])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_no_grpo_stage_is_an_error_not_a_silent_success(tmp_path, capsys):
    preset = tmp_path / "no_grpo.toml"
    preset.write_text('grpo = []\n[model]\npreset = "tiny"\nvocab_size = 576\n[env]\nname = "tictactoe"\n')
    rc = main(["train", str(preset), "--set", f'run.output_dir="{tmp_path / "run"}"'])
    err = capsys.readouterr().err
    assert rc == 2 and "there is no GRPO step to run" in err
