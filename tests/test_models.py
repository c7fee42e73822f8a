"""Both model families through the one seam (`models.family`): the same tests for LFM2 and Qwen3.

Parity against transformers on random tiny configs made here (float32, rel_err <= 1e-5 of the largest |logit|):
tied and untied heads, head_dim other than hidden / heads (Qwen3), GQA, norms set to random values so that a
missed q/k norm shows; the cached decode (prefill, ragged chunks, single steps) equals the full forward; the
export round trip through `transformers.AutoModelForCausalLM`, with and without merged LoRA adapters; the
config round trip; LoRA targets and FLOPs per token through the seam.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import family as fam  # noqa: E402
from models import lora  # noqa: E402
from models.hf import load_hf, save_hf  # noqa: E402
from models.lfm2 import PRESETS as LFM2_PRESETS  # noqa: E402
from models.qwen3 import PRESETS as QWEN3_PRESETS  # noqa: E402

# Per family: a tied GQA config and an untied one (LFM2: conv biases, GQA 4/1; Qwen3: attention biases,
# MHA, head_dim 24 with hidden 32 and 4 heads, three layers).
CONFIGS = {
    "lfm2_tied": LFM2_PRESETS["tiny"],
    "lfm2_untied": dataclasses.replace(LFM2_PRESETS["tiny"], tie_word_embeddings=False, conv_bias=True,
                                       num_hidden_layers=5, num_key_value_heads=1,
                                       layer_types=("full_attention", "conv", "conv", "full_attention", "conv")),
    "qwen3_tied": QWEN3_PRESETS["qwen3-tiny"],
    "qwen3_untied": dataclasses.replace(QWEN3_PRESETS["qwen3-tiny"], tie_word_embeddings=False, attention_bias=True,
                                        num_hidden_layers=3, num_key_value_heads=4, head_dim=24, rope_theta=500.0),
}
BATCH, SEQ = 3, 20


def rel_err(a, ref):
    """max |a - ref| / max |ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _torch_model(cfg, seed: int):
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # random norms and biases, so that a missed or misplaced norm or bias would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("cache",))
def _step(module, params, tokens, cache, num_valid):
    return module.apply({"params": params}, tokens, cache, num_valid)


_CKPTS: dict = {}


def _ckpt(name, tmp_path_factory):
    """(name, config, folder written by transformers, tokens int32[3, 20], reference logits, load_hf's model)."""
    if name not in _CKPTS:
        _CKPTS[name] = _make_ckpt(name, tmp_path_factory)
    return _CKPTS[name]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    """Every config (the parity and config tests)."""
    return _ckpt(request.param, tmp_path_factory)


# LFM2's tied config is tests/test_hf.py's config A, whose cache and export it tests already: the slower tests
# here take the other three.
@pytest.fixture(scope="module", params=["lfm2_untied", "qwen3_tied", "qwen3_untied"])
def ckpt3(request, tmp_path_factory):
    return _ckpt(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["lfm2_untied", "qwen3_untied"])
def ckpt2(request, tmp_path_factory):
    """One config of each family."""
    return _ckpt(request.param, tmp_path_factory)


def _make_ckpt(name, tmp_path_factory):
    cfg = CONFIGS[name]
    folder = tmp_path_factory.mktemp(name)
    model = _torch_model(cfg, seed=len(name))
    model.save_pretrained(folder, safe_serialization=True)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    return name, cfg, str(folder), tokens, _torch_logits(model, tokens), load_hf(folder)


# ---------------------------------------------------------------------------------------------- parity


def test_load_hf_reads_the_family_and_matches_transformers(ckpt):
    name, cfg, _, tokens, ref, loaded = ckpt
    assert loaded.config == cfg and loaded.family == name.split("_")[0]
    assert fam.family_of(cfg).architecture == cfg.to_hf_dict()["architectures"][0]
    assert rel_err(loaded(tokens), ref) < 1e-5


def test_cached_decode_equals_the_full_forward(ckpt3):
    """Ragged chunked prefill (rows advance by different amounts, padding after the real tokens), then decode
    steps with the sampler's cached call, through the seam's cache: every position's logits are the full
    forward's."""
    _, cfg, _, tokens, ref, loaded = ckpt3
    decode = jax.jit(fam.cached_call(loaded.module), donate_argnums=2)
    rng = np.random.RandomState(1)
    plan = [(8, [8, 3, 5]), (8, [2, 8, 0]), (4, [4, 4, 4])] + [(1, None)] * SEQ
    pos = np.zeros(BATCH, int)
    got = [[] for _ in range(BATCH)]
    cache = fam.init_cache(cfg, BATCH, 32)
    for width, nv in plan:
        nv = np.minimum(np.ones(BATCH, int) if nv is None else np.array(nv), SEQ - pos)
        if not nv.any():
            break
        chunk = rng.randint(0, cfg.vocab_size, (BATCH, width)).astype(np.int32)  # junk padding
        for b in range(BATCH):
            chunk[b, :nv[b]] = tokens[b, pos[b]:pos[b] + nv[b]]
        step = functools.partial(_step, loaded.module) if width > 1 else decode
        logits, cache = step(loaded.params, chunk, cache, jnp.asarray(nv, jnp.int32))
        logits = np.asarray(logits)
        for b in range(BATCH):
            got[b].append(logits[b, :nv[b]])
        pos += nv
        assert np.asarray(cache.lengths).tolist() == pos.tolist() and cache.max_len == 32
    for b in range(BATCH):
        assert rel_err(np.concatenate(got[b]), ref[b]) < 1e-5, b


def test_the_samplers_cached_call_gives_the_last_real_logits(ckpt2):
    _, cfg, _, tokens, ref, loaded = ckpt2
    num_valid = jnp.array([SEQ, 7, 1], jnp.int32)
    logits, cache = fam.cached_call(loaded.module)(loaded.params, jnp.asarray(tokens), fam.init_cache(cfg, BATCH, 24),
                                                   num_valid)
    assert logits.shape == (BATCH, 1, cfg.vocab_size)
    assert rel_err(logits[:, 0], ref[np.arange(BATCH), np.asarray(num_valid) - 1]) < 1e-5
    assert np.asarray(cache.lengths).tolist() == [SEQ, 7, 1]


def test_config_round_trips_through_config_json(ckpt):
    _, cfg, folder, _, _, _ = ckpt
    assert fam.config_from_hf(cfg.to_hf_dict()) == cfg
    assert fam.config_from_pretrained(folder) == cfg  # transformers' own config.json
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert fam.config_from_hf(hf.to_dict()) == cfg


# ---------------------------------------------------------------------------------------------- export


def test_export_round_trip_with_and_without_merged_lora(ckpt3, tmp_path):
    """save_hf -> transformers.AutoModelForCausalLM -> the same logits; with LoRA adapters (B random, so they
    change the model), `lora.merge` then save_hf gives transformers the adapted model's logits."""
    _, cfg, _, tokens, _, loaded = ckpt3
    ours = np.asarray(loaded(tokens))
    out = save_hf(loaded, tmp_path / "plain")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == cfg.architecture
    assert rel_err(_torch_logits(reloaded, tokens), ours) < 1e-5
    again = load_hf(out)
    for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(a, b)

    config = lora.LoraConfig(rank=4, alpha=8.0, targets=("all",))
    adapters = lora.init_adapters(config, loaded.params, jax.random.PRNGKey(0))
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(p))), x.shape) if p[-1].key == lora.B else x,
        adapters)
    wrapped = lora.LoraModel(loaded.module, config)
    adapted = np.asarray(wrapped.apply({"params": lora.join(loaded.params, adapters)}, jnp.asarray(tokens))[0])
    assert rel_err(adapted, ours) > 1e-3  # the adapters do change the logits
    merged = save_hf(cfg, lora.merge(config, lora.join(loaded.params, adapters)), tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert rel_err(_torch_logits(reloaded, tokens), adapted) < 1e-5


# ---------------------------------------------------------------------------------------------- the seam


def test_lora_targets_are_each_familys_projections():
    for name, cfg in CONFIGS.items():
        shapes = fam.param_shapes(cfg)
        targets = fam.lora_targets(cfg)
        paths = lora.adapter_paths(lora.LoraConfig(rank=2, targets=("all",)), shapes)
        assert {p[1:] for p in paths} == set(targets.values()), name
    qwen3 = fam.param_shapes(CONFIGS["qwen3_tied"])
    mlp = lora.adapter_paths(lora.LoraConfig(rank=2, targets=("mlp",)), qwen3)
    assert [p[1:] for p in mlp[:3]] == [("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]
    assert ("self_attn", "o_proj") in {p[1:] for p in lora.adapter_paths(lora.LoraConfig(rank=2, targets=("o_proj",)),
                                                                         qwen3)}
    with pytest.raises(ValueError, match=r"lora.targets \['w1'\] match no layer"):
        lora.adapter_paths(lora.LoraConfig(rank=2, targets=("w1",)), qwen3)


def test_flops_per_token_counts_the_weights_attention_and_head():
    cfg = CONFIGS["qwen3_untied"]
    D, H, KV, hd, F, L, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size)
    per_layer = D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * F  # q, k, v, o, gate, up, down
    biases_and_norms = L * (H * hd + 2 * KV * hd + D + 2 * hd + 2 * D) + D
    assert fam.matmul_weights(cfg) == L * per_layer + biases_and_norms
    assert fam.attention_width(cfg) == L * H * hd
    assert fam.flops_per_token(cfg, 10) == 2 * fam.matmul_weights(cfg) + 4 * L * H * hd * 10 + 2 * V * D
    assert fam.forward_flops(cfg, [3], 1) == sum(fam.flops_per_token(cfg, t + 1, head=False) for t in range(3)) + 2 * V * D
    lfm2 = CONFIGS["lfm2_tied"]
    assert fam.attention_width(lfm2) == 2 * lfm2.num_attention_heads * lfm2.head_dim  # its 2 attention layers


def test_presets_match_transformers_parameter_counts():
    for name in ("qwen3-0.6b", "qwen3-cpu", "lfm2-350m"):
        cfg = fam.PRESETS[name]
        with torch.device("meta"):
            ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf_dict()))
        assert sum(p.numel() for p in ref.parameters()) == sum(
            x.size for x in jax.tree_util.tree_leaves(fam.param_shapes(cfg))), name
    assert sum(x.size for x in jax.tree_util.tree_leaves(fam.param_shapes(fam.PRESETS["qwen3-0.6b"]))) == 596_049_920


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(fam.UnsupportedModelError, match=r"model_type 'llama', not 'lfm2' or 'qwen3'.*"
                                                         r"Lfm2ForCausalLM.*Qwen3ForCausalLM"):
        load_hf(tmp_path)
    with pytest.raises(fam.UnsupportedModelError, match="no supported model family"):
        fam.family_of(object())
