"""The attention paths agree (issue 16): `model.attention = "xla"` (jax.nn.dot_product_attention, XLA's
implementation; "cudnn" is the same call with the fused GPU kernel) against ours, on the CPU: the full
causal forward, a chunked prefill into the cache and its gradients; and the choice rules of "auto"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algos.grpo import policy_logprobs
from models.attention import attention_implementation
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache, init_params

TINY = dataclasses.replace(PRESETS["tiny"], initializer_range=0.2)


@pytest.fixture(scope="module")
def setup():
    params = init_params(TINY, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 17), 0, TINY.vocab_size)
    return params, tokens


def _forward(cfg, params, tokens):
    return jax.jit(Lfm2ForCausalLM(cfg).apply)({"params": params}, tokens)[0]


def test_full_forward_agrees(setup):
    params, tokens = setup
    ours = _forward(TINY.replace(attention="ours"), params, tokens)
    xla = _forward(TINY.replace(attention="xla"), params, tokens)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ours), rtol=2e-5, atol=2e-5)


def test_chunked_prefill_then_decode_agrees(setup):
    params, tokens = setup
    outs = {}
    for name in ("ours", "xla"):
        cfg = TINY.replace(attention=name)
        step = jax.jit(lambda p, t, c, cfg=cfg: Lfm2ForCausalLM(cfg).apply({"params": p}, t, c))
        cache = init_cache(cfg, tokens.shape[0], 32)
        first, cache = step(params, tokens[:, :6], cache)     # one prefill chunk into an empty cache
        second, cache = step(params, tokens[:, 6:12], cache)  # a second chunk attends to the first
        last, cache = step(params, tokens[:, 12:13], cache)   # a decode step reads the cache the chunks wrote
        outs[name] = [np.asarray(x) for x in (first, second, last)]
    for a, b in zip(outs["xla"], outs["ours"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_training_gradients_agree(setup):
    params, tokens = setup

    def loss(p, cfg):
        logp, _ = policy_logprobs(Lfm2ForCausalLM(cfg), p, tokens)
        return -jnp.mean(logp)

    g_ours = jax.jit(jax.grad(lambda p: loss(p, TINY.replace(attention="ours"))))(params)
    g_xla = jax.jit(jax.grad(lambda p: loss(p, TINY.replace(attention="xla"))))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g_xla), jax.tree_util.tree_leaves(g_ours)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_choice_of_implementation():
    assert jax.default_backend() == "cpu"
    assert attention_implementation("auto", "float32", 64) == "ours"  # ours is faster on the CPU
    assert attention_implementation("auto", "bfloat16", 64) == "ours"
    assert attention_implementation("xla", "float32", 64) == "xla"
    assert attention_implementation("ours", "bfloat16", 64, cached=True) == "ours"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        attention_implementation("cudnn", "bfloat16", 64)
    with pytest.raises(ValueError, match="attention is 'flash': use one of"):
        TINY.replace(attention="flash")


def test_the_config_key_is_checked_before_anything_compiles():
    from pathlib import Path

    from jaxrl_llm.config import ConfigError, loads_config

    text = (Path(__file__).resolve().parents[1] / "experiments" / "presets" / "tiny_test.toml").read_text()
    with pytest.raises(ConfigError, match=r"model\.attention"):
        loads_config(text, ['model.attention="flash"'])
    assert loads_config(text, ['model.attention="xla"']).model.model_config().attention == "xla"
