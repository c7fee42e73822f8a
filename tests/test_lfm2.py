"""LFM2 architecture: config rules and errors, preset sizes, init, sharding specs, remat, cached decode.

Numerical parity against transformers lives in test_hf.py; here the cached path is checked against our own
full forward (which test_hf.py checks against transformers).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import (
    Lfm2Cache,
    Lfm2Config,
    Lfm2ForCausalLM,
    count_params,
    init_cache,
    init_params,
    logical_axis_rules,
    logical_param_specs,
    param_shardings,
)
from models.lfm2 import PRESETS

TINY = PRESETS["tiny"]


def rel_err(a, b):
    """max |a - b| / max |b| (the relative-to-max-abs criterion used throughout)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny():
    params = init_params(TINY, jax.random.PRNGKey(0))
    assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))  # init returns plain arrays
    # non-trivial norm weights so that a wrong norm would show
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a * (1 + 0.2 * jax.random.normal(jax.random.PRNGKey(len(str(p))), a.shape))
        if p[-1].key == "scale" else a, params)
    module = Lfm2ForCausalLM(TINY)
    full = jax.jit(lambda params, tokens: module.apply({"params": params}, tokens)[0])
    return module, params, full


# ---------------------------------------------------------------------------------------------- config


def test_ff_dim_auto_adjust():
    assert PRESETS["lfm2-350m"].ff_dim == 4608
    assert PRESETS["lfm2-700m"].ff_dim == 6912
    assert PRESETS["lfm2-1.2b"].ff_dim == 8192
    assert dataclasses.replace(TINY, block_auto_adjust_ff_dim=False).ff_dim == TINY.intermediate_size
    # without a multiplier transformers only applies the 2/3 factor (no rounding)
    assert Lfm2Config(intermediate_size=1000, block_ffn_dim_multiplier=None).ff_dim == 666


def test_presets_layer_pattern():
    for name in ("lfm2-350m", "lfm2-700m", "lfm2-1.2b"):
        cfg = PRESETS[name]
        assert cfg.num_hidden_layers == 16 and cfg.vocab_size == 65536
        assert cfg.attention_layers == (2, 5, 8, 10, 12, 14)
    assert [PRESETS[n].hidden_size for n in ("lfm2-350m", "lfm2-700m", "lfm2-1.2b")] == [1024, 1536, 2048]
    assert 50_000 < count_params(jax.eval_shape(lambda: init_params(TINY, jax.random.PRNGKey(0)))) < 150_000
    cpu = PRESETS["cpu-5m"]
    assert cpu.vocab_size == 1024
    assert 4e6 < count_params(jax.eval_shape(lambda: init_params(cpu, jax.random.PRNGKey(0)))) < 6e6


def test_preset_param_counts_match_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    counts = {}
    for name in ("lfm2-350m", "lfm2-700m", "lfm2-1.2b", "cpu-5m"):
        cfg = PRESETS[name]
        with torch.device("meta"):
            ref = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**cfg.to_hf_dict()))
        counts[name] = sum(p.numel() for p in ref.parameters())
        ours = count_params(jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
        assert ours == counts[name], name
    assert counts["lfm2-350m"] == 354_483_968


def test_from_hf_dict_current_and_legacy_keys():
    legacy = {
        "model_type": "lfm2", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "full_attn_idxs": [1], "block_ff_dim": 96,
        "intermediate_size": 7, "tie_embedding": False, "theta": 5000.0, "block_multiple_of": 16,
        "unknown_extra_key": 1,
    }
    cfg = Lfm2Config.from_hf_dict(legacy)
    assert cfg.layer_types == ("conv", "full_attention", "conv")
    assert cfg.intermediate_size == 96 and cfg.ff_dim == 64
    assert cfg.tie_word_embeddings is False and cfg.rope_theta == 5000.0
    assert cfg.head_dim == 8
    current = {**{k: v for k, v in legacy.items() if k not in ("full_attn_idxs", "block_ff_dim", "theta",
                                                                   "tie_embedding")},
               "layer_types": ["full_attention", "conv", "conv"],
               "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}
    cfg2 = Lfm2Config.from_hf_dict(current, dtype="bfloat16")
    assert cfg2.layer_types == ("full_attention", "conv", "conv") and cfg2.rope_theta == 123.0
    assert cfg2.intermediate_size == 7 and cfg2.dtype == "bfloat16"
    # no layer_types and no full_attn_idxs: transformers makes every layer attention
    bare = {k: v for k, v in legacy.items() if k != "full_attn_idxs"}
    assert Lfm2Config.from_hf_dict(bare).layer_types == ("full_attention",) * 3


def test_to_hf_dict_round_trips():
    for cfg in PRESETS.values():
        assert Lfm2Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    transformers = pytest.importorskip("transformers")
    hf = transformers.Lfm2Config(**TINY.to_hf_dict())
    assert Lfm2Config.from_hf_dict(hf.to_dict()) == TINY


@pytest.mark.parametrize("change, match", [
    (dict(hidden_size=30), "not divisible by num_attention_heads"),
    (dict(num_key_value_heads=3), "not divisible by num_key_value_heads"),
    (dict(layer_types=("conv", "mamba", "conv", "conv")), r"layer_types\[1\] is 'mamba': unknown layer type"),
    (dict(num_hidden_layers=5), "layer_types has 4 entries but num_hidden_layers is 5"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(dtype="int8"), "unsupported dtype"),
    (dict(attention_row_block=-1), "attention_row_block must be None"),
    (dict(attention_row_block=True), "attention_row_block must be None"),
])
def test_config_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **change)


def test_from_hf_dict_errors():
    with pytest.raises(ValueError, match="model_type 'llama', not 'lfm2'"):
        Lfm2Config.from_hf_dict({**TINY.to_hf_dict(), "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type is 'yarn'"):
        Lfm2Config.from_hf_dict({**TINY.to_hf_dict(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


# ---------------------------------------------------------------------------------------------- params


def test_init_returns_plain_arrays_and_logical_specs(tiny):
    module, params, full = tiny
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 3), jnp.int32))["params"])
    leaves = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
    assert params["embed_tokens"]["embedding"].shape == (TINY.vocab_size, TINY.hidden_size)
    assert params["layers_0"]["conv"]["conv"]["kernel"].shape == (TINY.conv_L_cache, TINY.hidden_size)
    assert "lm_head" not in params  # tied
    specs = logical_param_specs(TINY)
    P = jax.sharding.PartitionSpec
    assert specs["embed_tokens"]["embedding"] == P("vocab", "embed")
    assert specs["layers_1"]["self_attn"]["q_proj"]["kernel"] == P("embed", "heads")
    assert specs["layers_1"]["feed_forward"]["w2"]["kernel"] == P("mlp", "embed")
    assert jax.tree_util.tree_structure(specs) == jax.tree_util.tree_structure(params)
    rules = dict(logical_axis_rules(fsdp=True, tensor=True))
    assert rules["embed"] == "fsdp" and rules["mlp"] == "tensor" and rules["batch"] == ("data", "fsdp")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = param_shardings(TINY, mesh, logical_axis_rules(fsdp=True, tensor=True))
    assert shardings["layers_1"]["self_attn"]["q_proj"]["kernel"].spec == P("fsdp", "tensor")
    placed = jax.device_put(params, shardings)
    out = full(placed, jnp.zeros((2, 3), jnp.int32))
    assert out.shape == (2, 3, TINY.vocab_size)


def test_untied_head_and_conv_bias_params():
    cfg = dataclasses.replace(TINY, tie_word_embeddings=False, conv_bias=True)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    assert params["lm_head"]["kernel"].shape == (cfg.hidden_size, cfg.vocab_size)
    conv = params["layers_0"]["conv"]
    assert conv["in_proj"]["bias"].shape == (3 * cfg.hidden_size,) and conv["conv"]["bias"].shape == (32,)


def test_bfloat16_params_and_float32_logits(tiny):
    cfg = dataclasses.replace(TINY, dtype="bfloat16", param_dtype="bfloat16")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    assert {a.dtype for a in jax.tree_util.tree_leaves(shapes)} == {jnp.dtype(jnp.bfloat16)}
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tiny[1])
    logits, _ = jax.jit(Lfm2ForCausalLM(cfg).apply)({"params": params}, jnp.ones((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    ref = tiny[2](tiny[1], jnp.ones((1, 4), jnp.int32))
    assert rel_err(logits, ref) < 5e-2
    assert init_cache(cfg, 1, 8).keys[0].dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------- forward


def test_remat_equals_plain(tiny):
    module, params, full = tiny
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, TINY.vocab_size)

    def loss(params, remat):
        logits, _ = Lfm2ForCausalLM(TINY, remat=remat).apply({"params": params}, tokens)
        return jax.nn.log_softmax(logits)[..., 0].mean(), logits

    (l0, lg0), g0 = jax.jit(jax.value_and_grad(lambda p: loss(p, False), has_aux=True))(params)
    (l1, lg1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(p, True), has_aux=True))(params)
    np.testing.assert_allclose(lg1, lg0, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # the config switch works as well: the layers are wrapped in a remat (checkpoint) region
    def jaxpr(cfg):
        return str(jax.make_jaxpr(lambda p: Lfm2ForCausalLM(cfg).apply({"params": p}, tokens)[0])(params))
    assert "remat" in jaxpr(dataclasses.replace(TINY, remat=True)) or "checkpoint" in jaxpr(
        dataclasses.replace(TINY, remat=True))
    assert "remat" not in jaxpr(TINY) and "checkpoint" not in jaxpr(TINY)


def test_jitted_decode_with_donated_cache_matches_full_forward(tiny):
    module, params, full = tiny
    B, T, P = 2, 10, 4
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, TINY.vocab_size)
    ref = full(params, tokens)

    @jax.jit
    def _step(params, tokens, cache, num_valid):
        return module.apply({"params": params}, tokens, cache, num_valid)

    step = jax.jit(_step, donate_argnames=("cache",))
    cache = init_cache(TINY, B, 16)
    logits, cache = step(params, tokens[:, :P], cache, jnp.full((B,), P, jnp.int32))
    outs = [logits]
    for t in range(P, T):
        old = cache
        logits, cache = step(params, tokens[:, t:t + 1], cache, jnp.ones((B,), jnp.int32))
        outs.append(logits)
    assert old.lengths.is_deleted()  # the cache really was donated (buffers reused)
    assert isinstance(cache, Lfm2Cache) and np.asarray(cache.lengths).tolist() == [T, T]
    assert rel_err(jnp.concatenate(outs, 1), ref) < 1e-5
    # the conv state is the last K-1 conv inputs: a cache built in one prefill agrees
    _, one_shot = _step(params, tokens, init_cache(TINY, B, 16), jnp.full((B,), T, jnp.int32))
    for a, b in zip(jax.tree_util.tree_leaves(one_shot), jax.tree_util.tree_leaves(cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_padding_does_not_advance_cache(tiny):
    module, params, full = tiny
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 6), 0, TINY.vocab_size)
    cache = init_cache(TINY, 2, 8)
    _, c1 = jax.jit(module.apply)({"params": params}, tokens, cache, jnp.array([6, 0], jnp.int32))
    assert np.asarray(c1.lengths).tolist() == [6, 0]
    for a, b in zip(c1.conv + c1.keys + c1.values, cache.conv + cache.keys + cache.values):
        np.testing.assert_array_equal(a[1], b[1])  # row 1 had no valid token: untouched


def test_attention_rows_picks_a_divisor_of_the_batch():
    from models.attention import ATTENTION_BLOCK_BYTES, attention_rows

    assert attention_rows(0, 12, 10**9) == 12  # 0: the whole batch
    assert attention_rows(5, 12, 1) == 4  # at most 5 rows: the largest divisor of 12 not above 5
    assert attention_rows(7, 7, 1) == 7 and attention_rows(100, 6, 1) == 6
    if jax.default_backend() == "cpu":  # automatic: the most rows whose float32 scores fit the budget
        per_row = ATTENTION_BLOCK_BYTES // 16  # float32 scores of a quarter of the budget: 4 rows fit
        assert attention_rows(None, 256, per_row) == 4
        assert attention_rows(None, 12, per_row * 5) == 1
        assert attention_rows(None, 256, 1) == 256  # decode-sized scores: one op


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_attention_row_groups_change_no_logits(tiny, rows):
    """Full forward, chunked prefill into a cache and decode steps, computed in row groups (3 rows of a
    batch of 8 becomes 2), give the logits of the one-op attention."""
    _, params, _ = tiny
    B, T, P = 8, 12, 7
    tokens = jax.random.randint(jax.random.PRNGKey(5), (B, T), 0, TINY.vocab_size)
    num_valid = jnp.arange(B, dtype=jnp.int32) % P + 1

    def run(cfg):
        module = Lfm2ForCausalLM(cfg)
        full, _ = module.apply({"params": params}, tokens)
        cache = init_cache(cfg, B, 24)
        pre, cache = module.apply({"params": params}, tokens[:, :P], cache, num_valid)
        step, cache = module.apply({"params": params}, tokens[:, P:P + 1], cache)
        return full, pre, step

    whole = jax.jit(lambda: run(dataclasses.replace(TINY, attention_row_block=0)))()
    grouped = jax.jit(lambda: run(dataclasses.replace(TINY, attention_row_block=rows)))()
    for a, b in zip(grouped, whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_last_only_logits_are_the_last_real_positions(tiny):
    module, params, full = tiny
    B, T = 3, 9
    tokens = jax.random.randint(jax.random.PRNGKey(6), (B, T), 0, TINY.vocab_size)
    num_valid = jnp.array([9, 4, 1], jnp.int32)
    apply = jax.jit(module.apply, static_argnames="last_only")  # one program each, not op by op
    every, c_every = apply({"params": params}, tokens, init_cache(TINY, B, 16), num_valid)
    last, c_last = apply({"params": params}, tokens, init_cache(TINY, B, 16), num_valid, last_only=True)
    assert last.shape == (B, 1, TINY.vocab_size)
    np.testing.assert_allclose(last[:, 0], every[jnp.arange(B), num_valid - 1], rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(c_last), jax.tree_util.tree_leaves(c_every)):
        np.testing.assert_array_equal(a, b)
    no_cache, _ = apply({"params": params}, tokens, last_only=True)  # without a cache: position T - 1
    np.testing.assert_allclose(no_cache[:, 0], full(params, tokens)[:, -1], rtol=1e-6, atol=1e-6)
