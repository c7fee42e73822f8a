"""Mixed precision: float32 params, bfloat16 compute, float32 logits and loss; configurable cache dtype.

Tolerances (the criterion of test_hf.py: rel_err = max |a - ref| / max |ref|, over the logits):
* bfloat16 compute with float32 params, full forward: < 6e-2 of float32 (observed ~4 % with the test's
  large, peaked weights: initializer_range 0.2);
* bfloat16 compute, chunked prefill then cached decode steps: < 6e-2 of the float32 full forward;
* float32 compute with a bfloat16 KV / conv cache: < 6e-2 (only the cached keys / values are rounded).
Greedy play of the committed CPU checkpoint (a trained model, confident replies) gives the same tokens in
bfloat16 as in float32 on the parity prompts (whole Tic-Tac-Toe games from fixed seeds).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algos.grpo import policy_logprobs
from models.lfm2 import PRESETS, Lfm2Config, Lfm2ForCausalLM, init_cache, init_params

ROOT = Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny"]
TOLERANCE = 6e-2


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def tiny():
    """float32 params of the tiny preset with larger weights (peaked logits, so errors show) and tokens."""
    params = init_params(dataclasses.replace(TINY, initializer_range=0.2), jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 20), 0, TINY.vocab_size)
    ref, _ = jax.jit(Lfm2ForCausalLM(TINY).apply)({"params": params}, tokens)
    return params, tokens, np.asarray(ref)


def _cached_logits(cfg: Lfm2Config, params, tokens, prefill: int = 8):
    """Logits of a prefill of `prefill` tokens then one decode step per remaining token: [B, T, V]."""
    module = Lfm2ForCausalLM(cfg)
    step = jax.jit(lambda p, t, c: module.apply({"params": p}, t, c))
    B, T = tokens.shape
    cache = init_cache(cfg, B, 32)
    logits, cache = step(params, tokens[:, :prefill], cache)
    outs = [logits]
    for t in range(prefill, T):
        logits, cache = step(params, tokens[:, t:t + 1], cache)
        outs.append(logits)
    return np.concatenate([np.asarray(o) for o in outs], axis=1), cache


def test_bfloat16_compute_float32_params_full_forward(tiny):
    params, tokens, ref = tiny
    cfg = TINY.replace(dtype="bfloat16")
    assert {a.dtype for a in jax.tree_util.tree_leaves(jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))} \
        == {jnp.dtype(jnp.float32)}  # params stay float32
    logits, _ = jax.jit(Lfm2ForCausalLM(cfg).apply)({"params": params}, tokens)
    assert logits.dtype == jnp.float32
    err = rel_err(logits, ref)
    assert 0 < err < TOLERANCE  # really computed in bfloat16 (not equal), within the tolerance
    # the loss side: log-probs are float32 and close to float32's
    lp32, _ = policy_logprobs(Lfm2ForCausalLM(TINY), params, tokens)
    lp16, _ = policy_logprobs(Lfm2ForCausalLM(cfg), params, tokens)
    assert lp16.dtype == jnp.float32
    assert float(jnp.abs(lp16 - lp32).max()) < 0.1


def test_bfloat16_prefill_and_decode_within_tolerance(tiny):
    params, tokens, ref = tiny
    got, cache = _cached_logits(TINY.replace(dtype="bfloat16"), params, tokens)
    assert cache.keys[0].dtype == cache.conv[0].dtype == jnp.bfloat16  # the cache follows the compute dtype
    for t in range(tokens.shape[1]):  # every step, not only on average
        assert rel_err(got[:, t], ref[:, t]) < TOLERANCE, t


@pytest.mark.parametrize("dtype, cache_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_cache_dtype_is_configurable(tiny, dtype, cache_dtype):
    params, tokens, ref = tiny
    cfg = TINY.replace(dtype=dtype, cache_dtype=cache_dtype)
    empty = init_cache(cfg, 2, 8)
    assert {a.dtype for a in empty.keys + empty.values + empty.conv} == {jnp.dtype(cache_dtype)}
    got, cache = _cached_logits(cfg, params, tokens)
    assert {a.dtype for a in cache.keys + cache.values + cache.conv} == {jnp.dtype(cache_dtype)}  # stays so
    assert rel_err(got, ref) < TOLERANCE
    if dtype == "float32":  # rounding only the cache costs less than rounding everything
        full16, _ = _cached_logits(TINY.replace(dtype="bfloat16"), params, tokens)
        assert rel_err(got, ref) < rel_err(full16, ref)


def test_dtype_fields_are_validated():
    with pytest.raises(ValueError, match="cache_dtype.*'int8'"):
        TINY.replace(cache_dtype="int8")
    assert TINY.replace(cache_dtype="bf16").cache_dtype == "bfloat16"
    from jaxrl_llm.config import ConfigError, loads_config

    text = (ROOT / "experiments" / "presets" / "tiny_test.toml").read_text()
    with pytest.raises(ConfigError, match=r"model\.cache_dtype"):
        loads_config(text, ["model.cache_dtype=int8"])
    assert loads_config(text, ["model.cache_dtype=bfloat16"]).model.model_config().cache_dtype == "bfloat16"


@pytest.mark.parametrize("path", ["lfm2_350m_gpu.toml", "lfm2_1.2b_gpu.toml"])
def test_gpu_presets_compute_in_bfloat16(path):
    import tomllib

    model = tomllib.loads((ROOT / "experiments" / "presets" / path).read_text())["model"]
    assert model["dtype"] == "bfloat16" and model["param_dtype"] == "float32"
    assert model.get("cache_dtype", "bfloat16") == "bfloat16"


def test_greedy_games_agree_in_bfloat16():
    """The parity prompts: 8 whole greedy games of the committed CPU checkpoint (float32 params) from fixed
    seeds; computed in bfloat16 they are token for token the float32 games."""
    from envs import tictactoe as ttt
    from jaxrl_llm import rollout as ro
    from jaxrl_llm import text
    from jaxrl_llm.generate import SamplingConfig
    from models.family import cached_call
    from models.hf import load_hf

    loaded = load_hf(ROOT / "experiments" / "checkpoints" / "cpu")
    tok = text.load_tokenizer(str(ROOT / "experiments" / "checkpoints" / "cpu"))
    env = ttt.TicTacToe(ttt.Params(prompt="tiny"))
    tables = text.tables_for_env(tok, env)
    examples = env.sample_examples(jax.random.PRNGKey(7), 8, 1, ttt.Stage(p_min=0.0, p_max=1.0))
    games = {}
    for dtype in ("float32", "bfloat16"):
        cfg = loaded.config.replace(dtype=dtype)
        run = ro.make_rollout(env, cached_call(Lfm2ForCausalLM(cfg)), lambda b, m, c=cfg: init_cache(c, b, m),
                              tables, ro.RolloutConfig(context_length=448, max_turns=8),
                              SamplingConfig(greedy=True, max_new_tokens=16))
        games[dtype] = jax.device_get(run(loaded.params, examples, jax.random.PRNGKey(0)))
    a, b = games["float32"], games["bfloat16"]
    assert int(a.loss_mask.sum()) > 8 * 11  # real replies were generated
    np.testing.assert_array_equal(b.length, a.length)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.reward, a.reward)
