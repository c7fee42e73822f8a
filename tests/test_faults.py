"""Fault cases a new user hit (issue 17): each test reproduces the case and asserts the named error or the
file that survives. Cheap by design: no training run, tiny arrays, no compile of the model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.checkpoint import CheckpointDamagedError, Checkpointer
from jaxrl_llm.run_lock import LOCK_FILE, RunLock, RunLockedError
from jaxrl_llm.cli.main import check_export_folder
from jaxrl_llm.config import load_config
from models import Lfm2Config, save_hf
from models.hf import HfCheckpointError, load_hf
from models.lfm2 import ATTENTION, CONV

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "presets" / "tiny_test.toml"


def _with_output_dir(config, folder):
    import dataclasses

    return dataclasses.replace(config, run=dataclasses.replace(config.run, output_dir=str(folder)))


# ---- export never deletes what it did not write ----

def test_export_refuses_a_non_empty_folder_and_keeps_its_files(tmp_path):
    config = _with_output_dir(load_config(TINY), tmp_path / "run")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty.*notes.txt.*--force"):
        check_export_folder(config, str(out), None, force=False)
    assert check_export_folder(config, str(out), None, force=True) == out.absolute()
    assert (out / "notes.txt").read_text() == "keep me"


def test_export_refuses_the_run_folder_and_its_checkpoints(tmp_path):
    config = _with_output_dir(load_config(TINY), tmp_path / "run")
    for folder in (tmp_path / "run", Path(config.checkpoint_dir())):
        with pytest.raises(FileExistsError, match="never writes there"):
            check_export_folder(config, str(folder), None, force=True)


def tiny_lfm2():
    return Lfm2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, layer_types=(CONV, ATTENTION),
                      max_position_embeddings=64)


def test_save_hf_keeps_other_files_and_replaces_only_its_own(tmp_path):
    from models.lfm2 import Lfm2ForCausalLM

    cfg = tiny_lfm2()
    params = Lfm2ForCausalLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    out = tmp_path / "export"
    save_hf(cfg, params, out)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt.*overwrite=True"):
        save_hf(cfg, params, out)
    save_hf(cfg, params, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert load_hf(out).config.hidden_size == 16


# ---- damaged weights and pickles: named errors, never a raw traceback ----

def test_truncated_safetensors_gets_a_named_error(tmp_path):
    from models.lfm2 import Lfm2ForCausalLM

    cfg = tiny_lfm2()
    params = Lfm2ForCausalLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    out = Path(save_hf(cfg, params, tmp_path / "export"))
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(HfCheckpointError, match="model.safetensors.*not a complete safetensors file.*again"):
        load_hf(out)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickled_weights_are_refused(tmp_path, name):
    cfg = tiny_lfm2()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(HfCheckpointError, match="pickle is refused"):
        load_hf(tmp_path)


# ---- one trainer per output folder ----

def test_a_second_trainer_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from jaxrl_llm.run_lock import RunLock\n"
        f"lock = RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"PID {holder.pid}.*one trainer per output folder"):
            RunLock(tmp_path, log=lambda *_: None).acquire()
        # The shared loop holds the lock itself: a loop called directly on a held folder never steps.
        from types import SimpleNamespace
        from jaxrl_llm.train.loop import Loop, TrainState, run_loop

        steps = []
        loop = Loop("test_step", lambda st: (steps.append(st.step) or st, {}, None))
        with pytest.raises(RunLockedError):
            run_loop(TrainState(None, None, 0, None), 3, loop, SimpleNamespace(out=tmp_path, write=None))
        assert steps == []
    finally:
        holder.kill()
        holder.wait()
    messages = []
    with RunLock(tmp_path, log=messages.append):  # the holder died without releasing: stale
        owner = json.loads((tmp_path / LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid()
    assert any("stale lock" in m and str(holder.pid) in m for m in messages)
    assert not (tmp_path / LOCK_FILE).exists()


# ---- a damaged newest checkpoint: fall back to the newest good step, with a warning naming both ----

def _state(value):
    return {"w": jnp.full((4,), value, jnp.float32), "step": jnp.int32(value)}


@pytest.mark.parametrize("damage", ["truncate_array", "delete_index"])
def test_damaged_newest_step_falls_back_to_the_previous_good_one(tmp_path, damage):
    with Checkpointer(tmp_path, async_save=False) as saver:
        saver.save(1, _state(1))
        saver.save(2, _state(2))
    step_dir = tmp_path / "2" / "state"
    if damage == "delete_index":
        (step_dir / "_METADATA").unlink()
    else:
        files = sorted((p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 0
                        and p.name not in ("_METADATA", "_sharding", "_CHECKPOINT_METADATA")),
                       key=lambda p: -p.stat().st_size)
        for f in files:
            f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 4)])
    target = jax.eval_shape(lambda: _state(0))
    with Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.raises(CheckpointDamagedError, match="step 2"):
            reader.restore(2, target=target)
    messages = []
    with Checkpointer(tmp_path) as writer:
        step, state = writer.restore_newest_good(target, log=messages.append)
    assert step == 1 and np.all(np.asarray(state["w"]) == 1)
    assert any("step 2" in m and "step 1" in m for m in messages)
    assert (tmp_path / "1").is_dir()  # the good step is untouched
    assert (tmp_path / "2.damaged").is_dir()  # the damaged one is moved aside, not deleted


def test_every_step_damaged_is_a_named_error_not_a_fresh_start(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as saver:
        saver.save(1, _state(1))
    (tmp_path / "1" / "state" / "_METADATA").unlink()
    with Checkpointer(tmp_path) as writer, pytest.raises(CheckpointDamagedError, match="every checkpoint"):
        writer.restore_newest_good(jax.eval_shape(lambda: _state(0)), log=lambda *_: None)
    assert (tmp_path / "1").is_dir()  # nothing was changed


# ---- config values that were accepted silently ----

@pytest.mark.parametrize("key,value", [("sft.optim.weight_decay", "nan"), ("sft.optim.max_grad_norm", "nan"),
                                       ("sft.optim.learning_rate", "inf"), ("grpo.0.loss.beta", "nan"),
                                       ("grpo.0.sampling.temperature", "inf"),
                                       ("run.seed", str(2**64 + 1))])
def test_non_finite_config_values_are_refused(key, value):
    from jaxrl_llm.config import ConfigError

    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        load_config(TINY, [f"{key}={value}"])


# ---- --checkpoint names a folder: one without a checkpoint is an error, not a fresh model ----

def test_checkpoint_flag_on_a_folder_without_a_checkpoint_is_an_error(tmp_path):
    from jaxrl_llm.checkpoint import CheckpointNotFoundError
    from jaxrl_llm.compat import check_checkpoint

    config = _with_output_dir(load_config(TINY), tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        check_checkpoint(config, tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError, match="no such folder"):
        check_checkpoint(config, tmp_path / "nowhere")


def test_a_non_finite_step_is_a_named_error_before_its_weights_are_kept():
    """`check_finite_step` (called by the SFT and GRPO loops on each step's host metrics, before the step's
    params replace the state): a NaN or infinite loss or gradient norm names the step, the values and the fix;
    finite ones and rows without those keys pass."""
    from jaxrl_llm.train.loop import NonFiniteLossError, check_finite_step

    check_finite_step({"loss": 0.3, "grad_norm": 1.2, "decision_policy_change": float("nan")}, "GRPO", 4, "fix")
    check_finite_step({"reward_mean": 0.5}, "GRPO", 4, "fix")
    with pytest.raises(NonFiniteLossError, match=r"GRPO step 7: loss = nan, grad_norm = inf\. .*Lower the rate"):
        check_finite_step({"loss": float("nan"), "grad_norm": float("inf")}, "GRPO", 7, "Lower the rate.")
    with pytest.raises(FloatingPointError, match="SFT step 2: grad_norm = nan"):
        check_finite_step({"loss": 1.0, "grad_norm": float("nan")}, "SFT", 2, "")


def test_the_cli_reports_a_non_finite_step_in_one_line(monkeypatch, capsys):
    """`jaxrl-llm train` whose step goes NaN: the named error on one line, exit status 2 (a fixable error)."""
    import importlib

    from jaxrl_llm.train.loop import NonFiniteLossError, check_finite_step

    cli = importlib.import_module("jaxrl_llm.cli.main")  # the module (the package exports its `main` function)

    def nan_train(args):
        check_finite_step({"loss": float("nan")}, "GRPO", 3, "Lower [grpo.optim] learning_rate.")
        return 0

    monkeypatch.setattr(cli, "cmd_train", nan_train)
    assert cli.main(["train", str(ROOT / "experiments" / "presets" / "tiny_test.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl-llm train: GRPO step 3: loss = nan.") and err.count("\n") == 1
    assert issubclass(NonFiniteLossError, FloatingPointError)
