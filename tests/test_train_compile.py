"""The GRPO step compiles once per stage: its second call (and every later one) reuses the first call's program.

The step's outputs (params, optimizer state) are committed arrays; its first call used to get a fresh
`optimizer.init` state whose int32 step counts were uncommitted, a different jit cache key, so step 2 of
every stage compiled the whole step again. Counted here from JAX's own compile log (`jax.log_compiles`) on
the tiny config, in the real loop (`train_grpo`) from an SFT checkpoint (committed params, as in the CPU
experiment) and after a resume from a GRPO checkpoint.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import pytest

from jaxrl_llm.compat import run_checkpointer
from jaxrl_llm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
SMALL = ["model.num_hidden_layers=2", 'model.layer_types=["conv", "full_attention"]', "grpo.0.steps=4",
         "checkpoint.every_steps=1", "run.sample_every=0"]


class CompileLog(logging.Handler):
    """Collects the names of the programs JAX compiles while `jax.log_compiles()` is on."""

    PATTERN = re.compile(r"Compiling (\S+) with global shapes")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        m = self.PATTERN.search(record.getMessage())
        if m:
            self.names.append(m.group(1))

    def __enter__(self):
        self._logger = logging.getLogger("jax")
        self._logger.addHandler(self)
        self._ctx = jax.log_compiles(True)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._logger.removeHandler(self)


def _config(out: Path):
    return load_config(PRESET, [f'run.output_dir="{out}"', *SMALL])


def _write_sft_checkpoint(config, comp):
    """What `run_sft` leaves behind (its params, committed on the device), without the SFT compile."""
    from jaxrl_llm.train.components import fresh_params, init_key, sft_dir

    params = jax.device_put(fresh_params(comp, init_key(config)), jax.devices()[0])
    with run_checkpointer(sft_dir(config), keep=1, async_save=False) as ckpt:
        ckpt.save(1, {"params": params}, config=config)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    from jaxrl_llm import train

    out = tmp_path_factory.mktemp("compile_once")
    config = _config(out)
    comp = train.build(config)
    _write_sft_checkpoint(config, comp)
    return config, comp


def test_compile_log_sees_a_recompile():
    """The counter is not vacuous: a jitted fn called with an uncommitted, then a committed argument of the
    same shape compiles twice (the mechanism of the old recompile), and once when both are committed."""
    import jax.numpy as jnp

    f = jax.jit(lambda x, y: x + y)
    committed = jax.device_put(jnp.ones(3), jax.devices()[0])
    with CompileLog() as log:
        f(jnp.ones(3), jnp.zeros((), jnp.int32))
        f(jnp.ones(3), jax.device_put(jnp.zeros((), jnp.int32), jax.devices()[0]))
    assert log.names.count("jit(<lambda>)") == 2
    g = jax.jit(lambda x, y: x * y)
    with CompileLog() as log:
        g(committed, jax.device_put(jnp.zeros((), jnp.int32), jax.devices()[0]))
        g(committed, jax.device_put(jnp.ones((), jnp.int32), jax.devices()[0]))
    assert log.names.count("jit(<lambda>)") == 1


def test_grpo_step_compiles_once_per_stage_from_sft(sft_run):
    from jaxrl_llm import train

    config, comp = sft_run
    with CompileLog() as log:
        result = train.train_grpo(config, comp, stop_after=2, log=lambda *a: None)
    assert result["step"] == 2
    assert log.names.count("jit(step)") == 1, log.names


def test_grpo_step_compiles_once_after_resume(sft_run):
    """Resumed at step 2 of the 4-step stage 0 (restored params and optimizer state; steps 3 and 4), then
    stage 1 (step 5): one compile per stage, none for the second call of stage 0's program."""
    from jaxrl_llm import train

    config, comp = sft_run
    with CompileLog() as log:
        result = train.train_grpo(config, comp, log=lambda *a: None)
    assert result["step"] == sum(s.steps for s in config.grpo) == 5
    assert log.names.count("jit(step)") == 2, log.names


def test_placed_like_outputs_commits_only_uncommitted_leaves():
    import jax.numpy as jnp

    from jaxrl_llm.train.grpo_loop import placed_like_outputs

    committed = jax.device_put(jnp.ones(2), jax.devices()[0])
    tree = {"a": committed, "count": jnp.zeros((), jnp.int32), "none": None}
    out = placed_like_outputs(tree)
    assert out["a"] is committed and out["none"] is None
    assert out["count"].committed and out["count"].dtype == jnp.int32 and int(out["count"]) == 0
