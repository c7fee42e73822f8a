"""Orbax checkpoints: bitwise round trip with an optax state and keys, keep-N, clear errors, crash safety; a run's
config stored and checked through `compat.run_checkpointer`."""

import functools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import checkpoint as ck
from jaxrl_llm.checkpoint import CheckpointMismatchError, CheckpointNotFoundError, Checkpointer
from jaxrl_llm.compat import load_checkpoint_config, run_checkpointer
from jaxrl_llm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "presets" / "tiny_test.toml"


def make_state(key, scale=1.0, width=4):
    """A small training state: params, adamw state after one update, step, keys, data position."""
    return _make_state(key, jnp.float32(scale), width=width)


@functools.partial(jax.jit, static_argnames="width")  # one compile instead of many eager ops
def _make_state(key, scale, width):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "embed": jax.random.normal(k1, (8, width), jnp.float32) * scale,
        "layer": {"w": jax.random.normal(k2, (width, width)).astype(jnp.bfloat16), "b": jnp.zeros((width,))},
    }
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.int32(17),
        "rng": key,  # a typed key
        "raw_rng": jax.random.PRNGKey(5),  # a raw uint32 key
        "data": {"examples_consumed": jnp.int32(544), "stage": jnp.int32(1)},
    }


def abstract_state(width=4):
    return jax.eval_shape(lambda k: make_state(k, width=width), jax.random.key(0))


def leaves_equal(a, b):
    def as_bits(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.atleast_1d(np.asarray(x)).view(np.uint8)

    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(as_bits(x), as_bits(y))


def test_round_trip_is_bitwise_in_a_fresh_checkpointer(tmp_path):
    config = load_config(TINY)
    state = make_state(jax.random.key(42))
    with run_checkpointer(tmp_path / "ckpt", keep=3, async_save=True) as saver:
        assert saver.latest_step() is None
        assert saver.save(17, state, config=config, metadata={"examples_consumed": 544, "stage": 1})
    restorer = run_checkpointer(tmp_path / "ckpt")
    assert restorer.latest_step() == 17
    restored = restorer.restore(target=abstract_state(), expect_config=config)
    leaves_equal(restored, state)
    assert isinstance(restored["opt_state"][1][0], optax.ScaleByAdamState)
    # the key continues the same stream
    np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (3,)), jax.random.uniform(state["rng"], (3,)))
    meta = restorer.metadata()
    assert meta["metadata"] == {"examples_consumed": 544, "stage": 1} and meta["step"] == 17
    assert restorer.config() == config
    assert "[[grpo]]" in meta["config_toml"]
    # concrete arrays work as a target too; no target gives Orbax's plain containers, keys as uint32 data
    leaves_equal(restorer.restore(17, target=state), state)
    raw = restorer.restore()
    np.testing.assert_array_equal(raw["rng"], jax.random.key_data(state["rng"]))
    np.testing.assert_array_equal(raw["params"]["embed"], state["params"]["embed"])
    restorer.close()
    restorer.close()  # idempotent


def test_keep_last_two(tmp_path):
    with Checkpointer(tmp_path, keep=2) as saver:
        for step in (1, 2, 3):
            saver.save(step, make_state(jax.random.key(step), scale=float(step)))
        saver.wait()
        assert saver.all_steps() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "3"]
    with Checkpointer(tmp_path, keep=2) as again:
        leaves_equal(again.restore(2, target=abstract_state()), make_state(jax.random.key(2), scale=2.0))


def test_restore_params_only(tmp_path):
    state = make_state(jax.random.key(1))
    with run_checkpointer(tmp_path, async_save=False) as saver:
        saver.save(3, state, config=load_config(TINY))
    params = ck.restore_params_only(tmp_path)
    assert set(params) == {"embed", "layer"}
    leaves_equal(params, state["params"])
    leaves_equal(ck.restore_params_only(tmp_path, 3, target=abstract_state()["params"]), state["params"])
    assert load_checkpoint_config(tmp_path) == load_config(TINY)
    with pytest.raises(CheckpointMismatchError, match="'embed' has shape"):
        ck.restore_params_only(tmp_path, target=abstract_state(width=6)["params"])


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ck.restore_params_only(tmp_path / "nowhere")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        Checkpointer(tmp_path / "nowhere", read_only=True)
    with Checkpointer(tmp_path / "empty") as empty:
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint found"):
            empty.restore(target=abstract_state())
    config = load_config(TINY)
    with run_checkpointer(tmp_path / "c", async_save=False) as saver:
        saver.save(4, make_state(jax.random.key(0)), config=config)
        with pytest.raises(CheckpointNotFoundError, match=r"step 9 .* steps there: \[4\]"):
            saver.restore(9, target=abstract_state())
        # a different model shape in the config: the field is named
        other = load_config(TINY, ["model.hidden_size=64"])
        with pytest.raises(CheckpointMismatchError, match="model.hidden_size: checkpoint 32, this config 64"):
            saver.restore(target=abstract_state(), expect_config=other)
        saver.check_config(load_config(TINY, ["model.dtype=bfloat16", "sampling.temperature=2.0"]))  # no shape change
        # a target of another shape or structure: the leaf is named
        with pytest.raises(CheckpointMismatchError, match="'params/embed' has shape"):
            saver.restore(target=abstract_state(width=6))
        wrong = dict(abstract_state())
        wrong["opt_state"] = jax.eval_shape(optax.sgd(0.1).init, wrong["params"])
        with pytest.raises(CheckpointMismatchError, match="opt_state"):
            saver.restore(target=wrong)
        with pytest.raises(CheckpointMismatchError, match="has no 'optimizer'"):
            saver.restore_subtree("optimizer")


def test_partial_tmp_directory_is_ignored(tmp_path):
    state = make_state(jax.random.key(0))
    with Checkpointer(tmp_path, async_save=False) as saver:
        saver.save(1, state)
    partial = tmp_path / "2.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 10)
    reader = Checkpointer(tmp_path, read_only=True)
    assert reader.all_steps() == [1]
    leaves_equal(reader.restore(target=abstract_state()), state)
    reader.close()
    assert partial.exists()  # a reader leaves another process's temporary folder alone
    with Checkpointer(tmp_path) as writer:  # a writer cleans it up
        assert writer.latest_step() == 1
    assert not partial.exists()


_CRASH_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys, time
    import jax
    spec = importlib.util.spec_from_file_location("checkpoint_tests", sys.argv[2])
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    make_state = tests.make_state
    from jaxrl_llm.checkpoint import Checkpointer
    from orbax.checkpoint._src.path import atomicity

    saver = Checkpointer(sys.argv[1], keep=3, async_save=True)
    saver.save(1, make_state(jax.random.key(1)))
    saver.wait()

    async def hang(self):  # the arrays are written; block where the save would be committed (renamed)
        print("COMMITTING", flush=True)
        time.sleep(600)

    atomicity.AtomicRenameTemporaryPath.finalize = hang
    atomicity.CommitFileTemporaryPath.finalize = hang
    saver.save(2, make_state(jax.random.key(2), scale=2.0))
    print("SAVE STARTED", flush=True)
    time.sleep(600)
    """
)


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(script), str(directory), __file__], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line.strip())
            if line.strip() == "COMMITTING":
                break
        assert "COMMITTING" in seen, f"the child never reached the commit: {seen}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    names = [p.name for p in directory.iterdir()]
    assert [p.name.split(".")[0] for p in ck.partial_saves(directory)] == ["2"], names  # the partial save
    assert "2" not in names
    with Checkpointer(directory) as again:
        assert again.all_steps() == [1]
        leaves_equal(again.restore(target=abstract_state()), make_state(jax.random.key(1)))
        # and training can go on: the next save of step 2 succeeds
        again.save(2, make_state(jax.random.key(2), scale=2.0))
        again.wait()
        assert again.all_steps() == [1, 2]
