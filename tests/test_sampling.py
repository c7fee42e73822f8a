"""The jitted sampler against the model's full forward, run token by token."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.generate import SamplingConfig, make_sampler, process_logits, sample
from models.family import cached_call
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache

VOCAB = 32


@pytest.fixture(scope="module")
def tiny():
    """A tiny random LFM2 (mixed conv / attention layers) with a 32-token vocabulary."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB)
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    # Sharpen the output so greedy choices are well separated from ties.
    params = jax.tree_util.tree_map(lambda x: x * 2.0, params)
    full = jax.jit(lambda p, t: module.apply({"params": p}, t)[0])
    return config, module, params, full


def _prompts(batch: int, width: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, size=batch)
    tokens = rng.integers(1, VOCAB, size=(batch, width))
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0  # right padding
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _reference_rows(full, params, prompt, lengths, out):
    """Per row: the full forward over prompt + generated tokens (the sequence the sampler saw).

    All rows go through one right-padded batch (causal attention: padding never reaches earlier
    positions), so the reference compiles once.
    """
    seqs = [
        np.concatenate([np.asarray(prompt[b, : lengths[b]]), np.asarray(out.tokens[b, : out.lengths[b]])])
        for b in range(prompt.shape[0])
    ]
    width = prompt.shape[1] + out.tokens.shape[1]
    batch = np.zeros((len(seqs), width), np.int32)
    for b, seq in enumerate(seqs):
        batch[b, : len(seq)] = seq
    logits = np.asarray(full(params, jnp.asarray(batch)), np.float64)
    return [(seq, logits[b], int(lengths[b]), int(out.lengths[b])) for b, seq in enumerate(seqs)]


def _greedy_continuation(full, params, history: np.ndarray, steps: int, width: int = 32) -> list[int]:
    """Greedy tokens after `history`, one full forward per token over a fixed-width padded buffer."""
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(history)] = history
    n = len(history)
    for _ in range(steps):
        buf[0, n] = int(np.asarray(full(params, jnp.asarray(buf))[0, n - 1]).argmax())
        n += 1
    return list(buf[0, len(history) : n])


def test_greedy_equals_argmax_of_full_forward(tiny):
    config, module, params, full = tiny
    prompt, lengths = _prompts(4, 6)
    cfg = SamplingConfig(greedy=True, max_new_tokens=10)
    sampler = make_sampler(cached_call(module), cfg)
    out = sampler(params, prompt, lengths, init_cache(config, 4, 16), jax.random.PRNGKey(0))
    assert np.all(np.asarray(out.lengths) == 10)
    for seq, logits, p, n in _reference_rows(full, params, prompt, lengths, out):
        # Token i of the reply is the argmax of the logits at the position just before it.
        np.testing.assert_array_equal(seq[p:], logits[p - 1 : p - 1 + n].argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_full_forward(tiny, temperature):
    config, module, params, full = tiny
    prompt, lengths = _prompts(3, 5, seed=2)
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=8)
    out = make_sampler(cached_call(module), cfg)(
        params, prompt, lengths, init_cache(config, 3, 16), jax.random.PRNGKey(3)
    )
    for b, (seq, logits, p, n) in enumerate(_reference_rows(full, params, prompt, lengths, out)):
        step_logits = logits[p - 1 : p - 1 + n]
        ids = seq[p:]
        tempered = jax.nn.log_softmax(step_logits / temperature, axis=-1)
        plain = jax.nn.log_softmax(step_logits, axis=-1)
        np.testing.assert_allclose(out.logprobs[b, :n], np.take_along_axis(np.asarray(tempered), ids[:, None], 1)[:, 0], atol=2e-5)
        np.testing.assert_allclose(
            out.model_logprobs[b, :n], np.take_along_axis(np.asarray(plain), ids[:, None], 1)[:, 0], atol=2e-5
        )


def _allowed(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The set top-k then top-p keeps, computed independently with numpy: bool[V]."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(logits.shape, bool)
    if top_k:
        kth = np.sort(logits)[::-1][top_k - 1]
        keep_k = logits >= kth
    else:
        keep_k = np.ones(logits.shape, bool)
    masked = np.where(keep_k, logits, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    mass = 0.0
    threshold = None
    for i in order:
        if not keep_k[i]:
            continue
        if mass < top_p:
            threshold = masked[i]
        mass += probs[i]
    keep = keep_k & (masked >= threshold)
    return keep


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
)
def test_top_k_top_p_never_sample_outside_allowed_set(seed, top_k, top_p):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(8,)).astype(np.float32) * 2.0
    cfg = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    allowed = _allowed(logits.astype(np.float64), top_k, top_p)
    processed = np.asarray(process_logits(jnp.asarray(logits[None]), cfg))[0]
    np.testing.assert_array_equal(np.isfinite(processed), allowed)
    draws = jax.random.categorical(jax.random.PRNGKey(seed), jnp.asarray(processed), shape=(512,))
    assert allowed[np.asarray(draws)].all()


def test_first_token_distribution_matches_softmax(tiny):
    """Chi-square style check: 8192 draws of the first token against the model's softmax."""
    config, module, params, full = tiny
    batch = 8192
    prompt = jnp.tile(jnp.asarray([[5, 9, 3]], jnp.int32), (batch, 1))
    lengths = jnp.full((batch,), 3, jnp.int32)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=1)
    out = make_sampler(cached_call(module), cfg)(params, prompt, lengths, init_cache(config, batch, 4), jax.random.PRNGKey(7))
    probs = np.asarray(jax.nn.softmax(full(params, prompt[:1])[0, -1]), np.float64)
    probs /= probs.sum()
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=VOCAB)
    expected = probs * batch
    big = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[big]).sum() + (counts[~big].sum() - expected[~big].sum()) ** 2 / max(expected[~big].sum(), 1)
    dof = int(big.sum())
    # Loose bound: mean dof, sd sqrt(2 dof); 6 sd is far beyond chance but catches a wrong distribution.
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_stop_tokens_end_rows_and_nothing_after_changes(tiny):
    config, module, params, full = tiny
    prompt, lengths = _prompts(16, 4, seed=4)
    stop = 7
    cfg = SamplingConfig(temperature=1.5, max_new_tokens=12, stop_token_ids=(stop, 11), pad_id=0)
    sampler = make_sampler(cached_call(module), cfg)
    out = sampler(params, prompt, lengths, init_cache(config, 16, 16), jax.random.PRNGKey(5))
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(16):
        row = tokens[b, : n[b]]
        stops = np.isin(row, [stop, 11])
        if out.done[b]:
            assert stops[-1] and not stops[:-1].any()
        else:
            assert not stops.any() and n[b] == 12 and out.truncated[b]
        assert (tokens[b, n[b] :] == 0).all()
        assert (np.asarray(out.logprobs)[b, n[b] :] == 0).all()
    assert np.asarray(out.done).any() and (np.asarray(out.done) != np.asarray(out.truncated)).all()
    # The cache holds prompt + reply, stop token included.
    np.testing.assert_array_equal(out.cache.lengths, np.asarray(lengths) + n)
    # Same key, same output; and the compiled program is reused.
    again = sampler(params, prompt, lengths, init_cache(config, 16, 16), jax.random.PRNGKey(5))
    np.testing.assert_array_equal(again.tokens, out.tokens)
    other = sampler(params, prompt, lengths, init_cache(config, 16, 16), jax.random.PRNGKey(6))
    assert not np.array_equal(other.tokens, out.tokens)
    assert sampler.jitted._cache_size() == 1


def test_inactive_rows_generate_nothing_and_keep_their_cache(tiny):
    config, module, params, full = tiny
    prompt, lengths = _prompts(4, 4, seed=8)
    active = jnp.asarray([True, False, True, False])
    cfg = SamplingConfig(greedy=True, max_new_tokens=5)
    out = make_sampler(cached_call(module), cfg)(params, prompt, lengths, init_cache(config, 4, 16), jax.random.PRNGKey(0), active)
    np.testing.assert_array_equal(out.lengths, [5, 0, 5, 0])
    np.testing.assert_array_equal(out.cache.lengths, [int(lengths[0]) + 5, 0, int(lengths[2]) + 5, 0])


def test_continuing_a_cache_equals_decoding_the_whole_conversation(tiny):
    """Turn 1 then turn 2 through the same cache == greedy decode of [turn 1, reply 1, turn 2] from scratch."""
    config, module, params, full = tiny
    cfg = SamplingConfig(greedy=True, max_new_tokens=4, stop_token_ids=(3,))
    sampler = make_sampler(cached_call(module), cfg)
    p1, l1 = _prompts(3, 5, seed=9)
    p2, l2 = _prompts(3, 3, seed=10)
    first = sampler(params, p1, l1, init_cache(config, 3, 32), jax.random.PRNGKey(0))
    second = sampler(params, p2, l2, first.cache, jax.random.PRNGKey(1))
    for b in range(3):
        history = np.concatenate(
            [np.asarray(p1[b, : l1[b]]), np.asarray(first.tokens[b, : first.lengths[b]]), np.asarray(p2[b, : l2[b]])]
        )
        expected = _greedy_continuation(full, params, history, int(second.lengths[b]))
        np.testing.assert_array_equal(second.tokens[b, : second.lengths[b]], expected)


def test_sample_traces_inside_an_outer_jit(tiny):
    config, module, params, full = tiny
    prompt, lengths = _prompts(2, 4, seed=11)
    cfg = SamplingConfig(greedy=True, max_new_tokens=3)
    model_fn = cached_call(module)

    @jax.jit
    def go(params, prompt, lengths):
        return sample(model_fn, params, prompt, lengths, init_cache(config, 2, 8), jax.random.PRNGKey(0), cfg).tokens

    direct = make_sampler(model_fn, cfg)(params, prompt, lengths, init_cache(config, 2, 8), jax.random.PRNGKey(0))
    np.testing.assert_array_equal(go(params, prompt, lengths), direct.tokens)


def test_bad_sampling_config_is_refused():
    with pytest.raises(ValueError, match="temperature: must be > 0"):
        SamplingConfig(temperature=0.0)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature: must be a finite number"):
            SamplingConfig(temperature=bad)
    with pytest.raises(ValueError, match=r"top_p: must be in \(0, 1\]"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p: must be in \(0, 1\]"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    SamplingConfig(temperature=0.0, greedy=True)  # greedy needs no temperature


def test_max_new_tokens_past_the_cache_is_refused_before_compiling(tiny):
    config, module, params, full = tiny
    sampler = make_sampler(cached_call(module), SamplingConfig(max_new_tokens=10))
    prompt, lengths = _prompts(2, 8)
    with pytest.raises(ValueError, match="exceed the cache's 12 positions"):
        sampler(params, prompt, lengths, init_cache(config, 2, 12), jax.random.PRNGKey(0))
    assert sampler.jitted._cache_size() == 0


SHARDED = textwrap.dedent(
    """
    import dataclasses, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxrl_llm.generate import SamplingConfig, make_sampler
    from models.family import cached_call
    from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache
    assert jax.device_count() == 8, jax.devices()
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=32)
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, 32, size=(16, 5)), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, 6, size=16), jnp.int32)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(3,))
    sampler = make_sampler(cached_call(module), cfg)
    plain = sampler(params, prompt, lengths, init_cache(config, 16, 16), jax.random.PRNGKey(1))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
    cache = jax.tree_util.tree_map(put, init_cache(config, 16, 16))
    params_r = jax.device_put(params, NamedSharding(mesh, P()))
    sharded = sampler(params_r, put(prompt), put(lengths), cache, jax.random.PRNGKey(1))
    assert len(sharded.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    print("SHARDED-OK")
    """
)


def test_batch_sharded_over_8_cpu_devices_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert "SHARDED-OK" in result.stdout, result.stderr[-4000:]
