"""A user's env in a folder of its own (examples/guess_env) through the plain `jaxrl-llm` command, by class path
and by entry point (issue 31 section 1), and the rough edges of section 5: env records of committed models,
play hooks, LoRA settings, mesh, eval logs, resume past the end, curriculum key paths, the random player's
range, transcripts of games the rollout stopped, non-rate metrics (section 3), the fresh-start warning (4)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import core, registry
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.cli.main import main
from jaxrl_llm.config import load_config, loads_config
from jaxrl_llm.metrics import format_results_table, read_metrics

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "guess_env"
PRESET = EXAMPLE / "guess.toml"
CLASS_PATH = "guess_env.env:GuessNumber"
SMALL = ["model.num_hidden_layers=2", 'model.layer_types=["conv", "full_attention"]']
JAXRL_LLM = str(Path(sys.executable).with_name("jaxrl-llm"))


@pytest.fixture()
def guess_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    core._REGISTRY.pop("guess", None)


def _cli(args, cwd, pythonpath=None) -> subprocess.CompletedProcess:
    """The real `jaxrl-llm` script in a subprocess (sharing the tests' compilation cache)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([JAXRL_LLM, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)


# ---- section 1: the CLI finds a user's env ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of the example env by class path from its own folder (the current folder, nothing installed):
    train 2 steps, resume to 3, lower the steps to 1, evaluate."""
    out = tmp_path_factory.mktemp("guess") / "run"
    common = [str(PRESET.name), "--set", f'run.output_dir="{out}"', *[a for s in SMALL for a in ("--set", s)]]
    runs = {"train": _cli(["train", *common], EXAMPLE),
            "resume": _cli(["train", *common, "--set", "grpo.0.steps=3"], EXAMPLE),
            # Shortening a finished stage is a config change: accepted by the flag, it trains nothing.
            "past_end": _cli(["train", *common, "--set", "grpo.0.steps=1", "--accept-config-change"], EXAMPLE),
            "eval": _cli(["eval", *common, "--set", "grpo.0.steps=3"], EXAMPLE)}
    return out, common, runs


def test_class_path_env_trains_resumes_and_evaluates_from_the_plain_cli(trained):
    out, _, runs = trained
    for name, r in runs.items():
        assert r.returncode == 0, (name, r.stderr[-3000:])
    assert "warning: GRPO starts from a freshly initialised model" in runs["train"].stderr  # section 4
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert "resumed from" in runs["resume"].stdout and "at step 2/3" in runs["resume"].stdout
    # Lowering the steps below the run's: a plain sentence, not "step 3/1 (300%)".
    assert "already past its end" in runs["past_end"].stdout and "300%" not in runs["past_end"].stdout
    # The mean metric is a number in the table and the logs, not 400 % or guesses_rate.
    table = runs["eval"].stdout
    assert "| model | solved | guesses | invalid | format |" in table
    row = next(line for line in table.splitlines() if line.startswith("| vs all"))
    guesses = float(row.split("|")[3])
    assert 1 <= guesses <= 4
    assert "guesses_mean" in read_metrics(out / "metrics.jsonl")[0] and "guesses_rate" not in read_metrics(
        out / "metrics.jsonl")[0]
    # eval writes its row to the run's eval_metrics.jsonl (section 5), with the checkpoint it read.
    evals = read_metrics(out / "eval_metrics.jsonl")
    assert evals[-1]["command"] == "eval" and evals[-1]["step"] == 3 and "all_solved" in evals[-1]


def test_checkpoints_record_the_class_path(trained):
    out, _, _ = trained
    from jaxrl_llm.checkpoint import Checkpointer

    with Checkpointer(out / "checkpoints", read_only=True) as ckpt:
        record = ckpt.metadata(ckpt.latest_step())["env"]
    assert record["name"] == CLASS_PATH and record["class"] == CLASS_PATH
    assert record["params"] == {"max_number": 16, "max_guesses": 4}


def test_entry_point_env_is_listed_and_evaluates_the_class_path_run(trained, tmp_path):
    """The example package installed (pip --target, offline, no venv) registers `guess` through the entry-point
    group; the run trained by class path is evaluated by that name from another folder (same class)."""
    out, common, _ = trained
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--quiet", "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    listing = _cli(["envs"], tmp_path, pythonpath=str(site))
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert "guess" in listing.stdout and f"(installed: {CLASS_PATH})" in listing.stdout
    preset = tmp_path / "guess.toml"
    preset.write_text(PRESET.read_text().replace(f'name = "{CLASS_PATH}"', 'name = "guess"'))
    run = _cli(["eval", str(preset), *common[1:], "--set", "grpo.0.steps=3"], tmp_path, pythonpath=str(site))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "params from" in run.stdout and "| vs all |" in run.stdout
    check = _cli(["check-env", "guess"], tmp_path, pythonpath=str(site))
    assert check.returncode == 0 and "passes every check" in check.stdout, check.stderr[-2000:]


def test_class_path_in_python_and_in_the_config(guess_on_path):
    env = envs.make(CLASS_PATH, max_number=9)
    assert type(env).__name__ == "GuessNumber" and env.params.max_number == 9
    config = load_config(PRESET)
    assert config.env.name == CLASS_PATH and config.make_env().params.max_guesses == 4


@pytest.mark.parametrize("name, words", [
    ("guess_env.env:NoSuchClass", ["module 'guess_env.env' has no attribute 'NoSuchClass'"]),
    ("no_such_pkg.env:Env", ["cannot import module 'no_such_pkg.env'", "No module named 'no_such_pkg'"]),
    ("guess_env.env:State", ["not a subclass of envs.Env"]),
    ("guesss", ["unknown env 'guesss'", "package.module:ClassName", "entry-point group 'jaxrl_llm.envs'"]),
])
def test_env_names_that_fail_say_why(guess_on_path, name, words):
    with pytest.raises(KeyError) as info:
        envs.env_class(name)
    for w in words:
        assert w in str(info.value)
    with pytest.raises(ConfigError) as info:
        loads_config(f'[env]\nname = "{name}"\n')
    assert info.value.key == "env.name" and words[0] in str(info.value)


def test_entry_points_register_lazily(tmp_path, monkeypatch):
    info = tmp_path / "my_envs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[jaxrl_llm.envs]\nguess_ep = {CLASS_PATH}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)  # the registry's flag (envs/registry.py)
    try:
        assert envs.entry_point_envs() == {"guess_ep": CLASS_PATH}
        assert "guess_ep" in envs.registered()
        assert envs.make("guess_ep").name == "guess"
    finally:
        core._REGISTRY.pop("guess_ep", None)


# ---- section 5: committed models record their env ----


def test_every_committed_model_records_the_env_of_its_preset():
    presets = {"cpu": "cpu", "cpu_exploit": "cpu_exploit", "cpu_from_reward": "cpu_from_reward",
               "connect_four_cpu": "connect_four_cpu", "warmup_legal": "warmup_legal", "warmup_games": "warmup_games",
               "cpu_from_reward_games": "cpu_from_reward_games",
               "seed_recipe": "seed_recipe", "seed_recipe_sft": "seed_recipe",
               "arithmetic_rl": "arithmetic_rl", "arithmetic_rl_sft": "arithmetic_rl",
               "cpu_from_reward_sft": "cpu_from_reward", "main": "main", "main_sft": "main",
               "qwen3_cpu": "qwen3_cpu", "qwen3_cpu_sft": "qwen3_cpu",
               "seed_recipe_run4": "results/seed_recipe_run4/preset"}  # a recorded run's own preset
    folders = sorted(p for p in (ROOT / "experiments" / "checkpoints").iterdir() if (p / "config.json").is_file())
    assert {p.name for p in folders} == set(presets)
    for folder in folders:
        record = json.loads((folder / "jaxrl_llm_env.json").read_text())
        name = presets[folder.name]
        config = load_config(ROOT / "experiments" / ("" if "/" in name else "presets") / f"{name}.toml")
        from jaxrl_llm.train import env_record

        mine = env_record(config)
        assert record["name"] == mine["name"] and record["params"] == mine["params"], folder.name


def test_eval_of_the_headline_model_with_another_envs_preset_is_a_named_error(capsys):
    rc = main(["eval", str(ROOT / "experiments" / "presets" / "arithmetic_cpu.toml"), "--checkpoint",
               str(ROOT / "experiments" / "checkpoints" / "cpu")])
    err = capsys.readouterr().err
    assert rc == 2 and "was trained on env 'tictactoe' but the config uses env 'arithmetic'" in err


def test_a_folder_without_env_record_warns_with_the_assumed_env(tmp_path, capsys):
    from jaxrl_llm.compat import check_hf_folder

    folder = tmp_path / "model"
    shutil.copytree(ROOT / "experiments" / "checkpoints" / "cpu", folder)
    (folder / "jaxrl_llm_env.json").unlink()
    check_hf_folder(load_config(ROOT / "experiments" / "presets" / "cpu.toml"), folder)
    out = capsys.readouterr().out
    assert "records no env" in out and "assuming it was trained on the config's env 'tictactoe'" in out


# ---- section 5: play ----


def test_play_without_hooks_is_a_named_error(guess_on_path, capsys, monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    rc = main(["play", str(PRESET), *[a for s in SMALL for a in ("--set", s)]])
    assert rc == 2 and "has no human player" in capsys.readouterr().err


def test_connect_four_has_play_hooks():
    from envs.connect_four import game
    from jaxrl_llm.cli.human import human_play

    env = envs.make("connect_four")
    human = human_play(env)
    state = human.new_game()
    assert human.choices(state) == [str(c) for c in range(7)]
    state = human.apply_model(state, envs.ParsedReply.of(3))
    assert human.human_to_move(state)
    state = human.apply_human(state, "3")
    assert "O played 3." in env.render_message(state, env.params)
    cells = np.asarray(game.cells(state.x, state.o))
    assert cells[0, 3] == game.X and cells[1, 3] == game.O
    for _ in range(2):  # fill column 3: the model then may not play there, the person neither
        state = human.apply_human(human.apply_model(state, envs.ParsedReply.of(3)), "3")
    assert "3" not in human.choices(state)
    assert int(human.apply_model(state, envs.ParsedReply.of(3)).status) == game.STATUS_INVALID
    opened = human.opening(human.new_game(), "0")
    assert env.render_message(opened, env.params).startswith("O played 0.")


# ---- section 5: LoRA, mesh, curriculum ----


def test_lora_settings_with_rank_zero_are_an_error():
    tiny = ROOT / "experiments" / "presets" / "tiny_test.toml"
    with pytest.raises(ConfigError) as info:
        load_config(tiny, ['lora.targets=["q_proj"]'])
    assert info.value.key == "lora.rank" and "rank is 0" in str(info.value)


def test_lora_rank_above_the_width_is_an_error_before_compiling():
    from jaxrl_llm.train import build

    config = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml", ["lora.rank=100000"])
    with pytest.raises(ConfigError) as info:
        build(config)
    assert info.value.key == "lora.rank" and "is above the width of" in str(info.value)


def test_mesh_larger_than_the_devices_warns_with_the_mesh_used(capsys):
    from jaxrl_llm.train import make_mesh

    config = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml", ["mesh.fsdp=4"])
    assert make_mesh(config) is None and len(jax.devices()) == 1
    out = capsys.readouterr().out
    assert "mesh.fsdp = 4" in out and "single device without a mesh" in out


def test_a_curriculum_clash_names_its_key_path():
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "experiments" / "presets" / "connect_four_cpu.toml", ["grpo.0.curriculum.depth=5"])
    assert info.value.key == "grpo.0.curriculum.depth" and "Stage.depth" not in str(info.value)


# ---- random player, transcripts, metric kinds, fresh start ----


def test_random_player_draws_within_the_grammars_range(guess_on_path):
    from envs.random_play import play_random

    env = envs.make(CLASS_PATH)
    replies = jax.vmap(lambda k: env.random_reply(k, None, env.params))(jax.random.split(jax.random.PRNGKey(0), 512))
    values = np.asarray(replies.value)
    assert values.min() == 1 and values.max() == 16
    rates = play_random(env, jax.random.PRNGKey(1), 256, env.eval_settings()[0].stage, 8)
    assert rates["invalid"] == 0.0 and rates["solved"] > 0.2
    with pytest.raises(ValueError, match="value_range"):
        envs.ReplyGrammar("guess", "integer", max_digits=2, value_range=(1, 100))


def test_demo_shows_a_mean_as_a_number(guess_on_path, capsys):
    assert main(["demo", CLASS_PATH, "--games", "64", "--max-turns", "6"]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if li.strip().startswith("all |"))
    guesses = line.split("guesses ")[1].split()[0]
    assert "%" not in guesses and 1 <= float(guesses) <= 6


def test_results_table_formats_means_as_numbers():
    rows = [{"model": "a", "solved": 0.5, "guesses": 3.25}]
    table = format_results_table(rows, (("solved", "solved"), ("guesses", "guesses")), kinds={"guesses": "mean"})
    assert table.splitlines()[-1] == "| a | 50 | 3.25 |"


def test_transcripts_keep_the_envs_last_message_when_the_rollout_stops_the_game(guess_on_path):
    from jaxrl_llm import text
    from jaxrl_llm import rollout as ro
    from jaxrl_llm.generate import SamplingConfig

    env = envs.make(CLASS_PATH)
    tok = text.load_tokenizer()
    tables = text.tables_for_env(tok, env)
    replies = [["<guess>1</guess>", "<guess>16</guess>"], ["<guess>5</guess>"]]
    reply_tokens, lengths = ro.script_replies(tok, replies, 2, 24)
    policy = ro.scripted_policy(reply_tokens, lengths, tables.eos_id)
    config = ro.RolloutConfig(context_length=256, max_turns=2)
    traj = jax.device_get(ro.rollout(env, policy, None, None, None, tables, jnp.asarray([7, 5], jnp.int32),
                                     jax.random.PRNGKey(0), config, SamplingConfig(max_new_tokens=24)))
    stopped, solved = ro.game_record(env, tok, traj, 0), ro.game_record(env, tok, traj, 1)
    assert stopped["truncated"] and stopped["unsent_message"] == "Lower."
    assert "Lower." not in stopped["conversation"]  # the model never saw it
    assert solved["unsent_message"] is None and "Correct! You win." in solved["conversation"]
    assert "not sent to the model:]\nLower." in ro.games_text(env, tok, traj, 2)


def test_fresh_start_warning(tmp_path):
    from jaxrl_llm.train import fresh_start_warning

    base = ['sft.steps=0', f'run.output_dir="{tmp_path}"']
    config = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml", base)
    assert "freshly initialised" in fresh_start_warning(config)
    (tmp_path / "sft" / "3").mkdir(parents=True)
    assert fresh_start_warning(config) is None  # an SFT checkpoint of this run: GRPO starts from it
    init = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml",
                       [*base[:1], f'run.output_dir="{tmp_path / "b"}"', f'model.init_from="{ROOT}/experiments/checkpoints/cpu"'])
    assert fresh_start_warning(init) is None  # a pretrained model


def test_plan_compiles_the_lora_update():
    from jaxrl_llm.memory_plan import compiled_peak

    full = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml")
    lora = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml", ["lora.rank=2"])
    a, b = compiled_peak(full, rows=2, length=16), compiled_peak(lora, rows=2, length=16)
    assert "LoRA rank 2" in b["shape"] and "LoRA" not in a["shape"]
    assert b["output_bytes"] < a["output_bytes"]  # only the adapters and their optimizer state come back


def test_the_readmes_sft_script_writes_rows_the_env_agrees_with(guess_on_path, tmp_path):
    """examples/guess_env/make_sft_data.py (shown in the README) writes sft.dataset rows: they load, tokenize, and
    replaying their replies through the env gives exactly their messages."""
    from jaxrl_llm import text
    from jaxrl_llm.algos import sft
    from jaxrl_llm.data.sft_data import load_sft_dataset

    out = tmp_path / "guess_sft.jsonl"
    run = subprocess.run([sys.executable, str(EXAMPLE / "make_sft_data.py"), str(out)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=f"{EXAMPLE}:{ROOT}"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = list(load_sft_dataset(str(out)))
    env = envs.make(CLASS_PATH)
    assert len(rows) == 16
    step = jax.jit(lambda s, v: env.step(s, envs.ParsedReply.of(v), env.params))
    for row in rows:
        state = env.reset(jnp.int32(row["info"]["secret"]), env.params)
        assert row["prompt"][1]["content"] == env.render_message(state, env.params)
        for reply, message in zip(row["completion"][::2], row["completion"][1::2]):
            state = step(state, int(reply["content"][len("<guess>"):-len("</guess>")]))
            assert message["content"] == env.render_message(state, env.params)
        assert bool(state.done)
    data = sft.tokenize_sft(text.load_tokenizer(), rows, 512)
    assert data["lengths"].shape == (16,) and int(data["lengths"].max()) < 512
