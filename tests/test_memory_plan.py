"""The memory plan (`jaxrl-llm train --plan`, issue 16) counts the real trees: params, AdamW's moments, the
LoRA adapters, the rollout cache, and reads XLA's peak of a compiled update."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxrl_llm.cli.main import main
from jaxrl_llm.config import load_config
from jaxrl_llm.memory_plan import compiled_peak, model_config, plan

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"


def _nbytes(tree, only_arrays_of_rank_at_least=0):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
               if x.ndim >= only_arrays_of_rank_at_least)


def test_params_optimizer_and_cache_bytes_are_those_of_the_real_trees():
    from jaxrl_llm.algos.optim import make_optimizer
    from jaxrl_llm.train import build, fresh_params, init_key
    from models.lfm2 import init_cache

    config = load_config(PRESET, ["grpo.0.loss.beta=0.1"])
    comp = build(config)
    params = fresh_params(comp, init_key(config))
    opt_state = make_optimizer(config.grpo[0].optim_config()).init(params)
    result = plan(config)
    stage = result["stages"][0]
    assert result["params_count"] == sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert stage["params"] == stage["grads"] == stage["reference"] == _nbytes(params)  # float32, beta > 0
    assert stage["optimizer"] == _nbytes(opt_state, 1)  # AdamW's mu and nu (its scalar counts left out)
    s = config.grpo[0]
    cache = init_cache(comp.model_config, s.batch_size, s.rollout.context_length)
    assert stage["kv_cache"] == _nbytes([cache.keys, cache.values, cache.conv])
    assert result["total"] == max(st["total"] for st in result["stages"])


def test_lora_trains_and_stores_only_the_adapters():
    from models import lora
    from models.lfm2 import init_params

    config = load_config(PRESET, ["lora.rank=4"])
    stage = plan(config)["stages"][0]
    base = jax.eval_shape(lambda: init_params(model_config(config), jax.random.PRNGKey(0)))
    shapes = jax.eval_shape(lambda: lora.init_adapters(config.lora, base, jax.random.PRNGKey(0)))
    adapters = sum(math.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(shapes))
    assert stage["grads"] == adapters and stage["optimizer"] == 2 * adapters and stage["reference"] == 0
    assert adapters < stage["params"] / 4


def test_compiled_peak_and_the_cli_flag(capsys):
    config = load_config(PRESET)
    peak = compiled_peak(config, layers=2, rows=2, length=16)
    assert peak["peak_bytes"] > peak["argument_bytes"] > 0
    assert main(["train", str(PRESET), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "| stage |" in out and "to spare" in out and "compiled GRPO update" in out
