"""LFM2 checkpoint import/export and numerical parity against transformers (torch, CPU).

Error criterion everywhere: rel_err(a, ref) = max |a - ref| / max |ref| (relative to the largest |logit|);
float32 must be within 1e-5, bfloat16 within 3e-2 (observed ~0.6-0.8%, as torch's own bf16).
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from models import PRESETS, Lfm2Config, Model, init_cache, load_hf, save_hf  # noqa: E402

# A: the tiny preset (tied head, no conv bias, GQA 4/2, layers conv/attn/conv/attn)
# B: untied head, conv biases, 5 layers, GQA 4/1, attention first
CONFIGS = {
    "A": PRESETS["tiny"],
    "B": dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=False, conv_bias=True, num_hidden_layers=5,
                             num_key_value_heads=1,
                             layer_types=("full_attention", "conv", "conv", "full_attention", "conv")),
}
BATCH, SEQ = 3, 20


def rel_err(a, ref):
    """max |a - ref| / max |ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _torch_model(cfg: Lfm2Config, seed: int):
    torch.manual_seed(seed)
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**cfg.to_hf_dict())).eval()
    with torch.no_grad():  # random norms and biases, so that a wrong norm or bias would show
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


def _ckpt(key, tmp_path_factory):
    """(config, folder written by transformers, torch model, tokens int32[3, 20], reference logits, load_hf)."""
    if key not in _CKPTS:
        cfg = CONFIGS[key]
        folder = tmp_path_factory.mktemp(f"hf_{key}")
        model = _torch_model(cfg, seed=ord(key))
        model.save_pretrained(folder, safe_serialization=True)
        tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
        _CKPTS[key] = (cfg, str(folder), model, tokens, _torch_logits(model, tokens), load_hf(folder))
    return _CKPTS[key]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    """Both configs (A and B)."""
    return _ckpt(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    """Config A only (for the slower paths already covered layer-wise by the ragged test on both configs)."""
    return _ckpt("A", tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A transformers checkpoint of config A, for tests that break it (copy it first)."""
    folder = tmp_path_factory.mktemp("tiny_src")
    _torch_model(CONFIGS["A"], seed=1).save_pretrained(folder, safe_serialization=True)
    return str(folder)


# ---------------------------------------------------------------------------------------------- parity


def test_full_forward_parity(ckpt):
    cfg, _, _, tokens, ref, loaded = ckpt
    assert loaded.config == cfg
    assert rel_err(loaded(tokens), ref) < 1e-5


def test_prefill_then_decode_matches_full_forward(ckpt_a):
    cfg, _, _, tokens, ref, loaded = ckpt_a
    prefill = 8  # same chunk width as the ragged test: shares its compiled step
    cache = init_cache(cfg, BATCH, 32)
    logits, cache = _step(loaded.module, loaded.params, tokens[:, :prefill], cache,
                          jnp.full((BATCH,), prefill, jnp.int32))
    outs = [logits]
    for t in range(prefill, SEQ):
        logits, cache = _step(loaded.module, loaded.params, tokens[:, t:t + 1], cache, jnp.ones((BATCH,), jnp.int32))
        outs.append(logits)
    got = np.concatenate([np.asarray(o) for o in outs], axis=1)
    for t in range(SEQ):  # every step
        assert rel_err(got[:, t], ref[:, t]) < 1e-5, t
    assert np.asarray(cache.lengths).tolist() == [SEQ] * BATCH


def test_ragged_chunked_prefill_then_decode(ckpt):
    """Rows advance by different amounts per chunk (padding after the valid tokens), then decode."""
    cfg, _, _, tokens, ref, loaded = ckpt
    rng = np.random.RandomState(1)
    plan = [(8, [8, 3, 5]), (8, [2, 8, 0]), (4, [4, 4, 4])] + [(1, None)] * SEQ
    pos = np.zeros(BATCH, int)
    got = [[] for _ in range(BATCH)]
    cache = init_cache(cfg, BATCH, 32)
    for width, nv in plan:
        nv = np.minimum(np.ones(BATCH, int) if nv is None else np.array(nv), SEQ - pos)
        if not nv.any():
            break
        chunk = rng.randint(0, cfg.vocab_size, (BATCH, width)).astype(np.int32)  # junk padding
        for b in range(BATCH):
            chunk[b, :nv[b]] = tokens[b, pos[b]:pos[b] + nv[b]]
        logits, cache = _step(loaded.module, loaded.params, chunk, cache, jnp.asarray(nv, jnp.int32))
        logits = np.asarray(logits)
        for b in range(BATCH):
            got[b].append(logits[b, :nv[b]])
        pos += nv
        assert np.asarray(cache.lengths).tolist() == pos.tolist()
    for b in range(BATCH):
        assert rel_err(np.concatenate(got[b]), ref[b]) < 1e-5, b


def test_bfloat16_within_tolerance(ckpt_a):
    cfg, folder, _, tokens, ref, _ = ckpt_a
    model = load_hf(folder, dtype="bfloat16")
    assert model.config.dtype == model.config.param_dtype == "bfloat16"
    assert {a.dtype for a in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    logits = model(tokens)
    assert logits.dtype == jnp.float32
    assert rel_err(logits, ref) < 3e-2


def test_save_hf_then_transformers_loads_same_logits(ckpt, tmp_path):
    cfg, _, _, tokens, _, loaded = ckpt
    ours = np.asarray(loaded(tokens))
    out = save_hf(loaded, tmp_path / "export")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    reloaded = transformers.Lfm2ForCausalLM.from_pretrained(out).eval()
    assert rel_err(_torch_logits(reloaded, tokens), ours) < 1e-5
    # config + params form, replacing the folder atomically; load_hf reads it back exactly
    save_hf(loaded.config, loaded.params, out)
    again = load_hf(out)
    for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(a, b)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp folders left


def test_sharded_index_checkpoint_loads(tiny_folder, tmp_path):
    tensors = safetensors_numpy.load_file(os.path.join(tiny_folder, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        safetensors_numpy.save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_folder, "config.json")).read())
    sharded, single = load_hf(tmp_path), load_hf(tiny_folder)
    assert isinstance(sharded, Model)
    for a, b in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(single.params)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------- errors


def _copy(src, dst, tensors=None, config=None):
    os.makedirs(dst, exist_ok=True)
    t = safetensors_numpy.load_file(os.path.join(src, "model.safetensors"))
    safetensors_numpy.save_file(tensors(t) if tensors else t, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump(config(cfg) if config else cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_missing_folder_and_files(tiny_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_folder, "config.json")).read())
    with pytest.raises(FileNotFoundError, match="no weights .* expected model.safetensors"):
        load_hf(tmp_path)


def test_pickled_weights_refused(tiny_folder, tmp_path):
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_folder, "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"(?s)pickled weights \(pytorch_model.bin\).*safe_serialization=True"):
        load_hf(tmp_path)


def test_other_model_type(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "x", config=lambda c: {**c, "model_type": "llama"})
    with pytest.raises(ValueError, match="model_type 'llama', not 'lfm2'"):
        load_hf(folder)


def test_missing_tensor(tiny_folder, tmp_path):
    name = "model.layers.0.conv.in_proj.weight"
    folder = _copy(tiny_folder, tmp_path / "x", tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=f"lacks tensor.*{name}"):
        load_hf(folder)


def test_untied_head_missing(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "x", config=lambda c: {**c, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="lm_head.weight.*tie_word_embeddings"):
        load_hf(folder)


def test_extra_tensor(tiny_folder, tmp_path):
    extra = lambda t: {**t, "model.layers.9.mystery.weight": np.zeros((2,), np.float32)}  # noqa: E731
    folder = _copy(tiny_folder, tmp_path / "x", tensors=extra)
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.9.mystery.weight"):
        load_hf(folder)


def test_shape_mismatch(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "x", config=lambda c: {**c, "intermediate_size": 384})
    with pytest.raises(ValueError, match=r"model.layers.0.feed_forward.w1.weight' has shape \(128, 32\).*\(256, 32\)"):
        load_hf(folder)


def test_save_hf_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"a Model .* or a model config \(Lfm2Config, Qwen3Config\)"):
        save_hf({"params": 1}, tmp_path)
    with pytest.raises(TypeError, match="folder is missing"):
        save_hf(PRESETS["tiny"], {})
