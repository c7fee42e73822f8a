"""LFM2 (Liquid AI) in Flax: its config, its short-conv layer, presets and the family record behind the seam.

Matches `transformers.Lfm2ForCausalLM` exactly (same weights, same logits). The shared decoder
(`models.decoder`, `models.attention`, `models.layers`) does everything but the short conv:

* decoder layers of two kinds, chosen by `config.layer_types`: a gated short convolution ("conv") or
  grouped-query attention ("full_attention"); each is pre-norm and residual:
  `h = x + op(operator_norm(x))`, `out = h + feed_forward(ffn_norm(h))`;
* short conv: `B, C, x = split(in_proj(x), 3)`; `y = C * causal_depthwise_conv(B * x)`; `out_proj(y)`;
* attention: q/k/v projections, per-head RMSNorm on q and k, rotate-half RoPE, causal softmax, out_proj;
* SwiGLU MLP `w2(silu(w1 x) * w3 x)` of width `config.ff_dim`;
* RMSNorm in float32 (weight without +1 offset); `embedding_norm` after the last layer; `lm_head` tied to
  the embedding unless `tie_word_embeddings` is false.

Two entry points share the weights (see `models.decoder.CausalLM.__call__`): a full causal forward
(training, log-probs; optional rematerialization) and a cached path for chunked prefill and decode.

Parameter tree (Flax layouts; Dense kernels are `[in, out]`, i.e. torch's weight transposed)::

    embed_tokens/embedding [V, D]         embedding_norm/scale [D]        lm_head/kernel [D, V] (untied)
    layers_{i}/operator_norm/scale [D]    layers_{i}/ffn_norm/scale [D]
    layers_{i}/feed_forward/{w1,w3}/kernel [D, F], w2/kernel [F, D]
    conv layer:      layers_{i}/conv/in_proj/kernel [D, 3D], conv/conv/kernel [K, D], conv/out_proj/kernel [D, D]
                     (+ `bias` entries when conv_bias)
    attention layer: layers_{i}/self_attn/{q_proj [D, H*hd], k_proj, v_proj [D, KV*hd], out_proj [H*hd, D]}/kernel,
                     self_attn/{q_layernorm,k_layernorm}/scale [hd]
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.base import (ATTENTION, DEFAULT_THETA, DecoderConfig, LayerNames, ModelFamily, TensorLayout,
                         read_config_json, rope_theta_of)
from models.decoder import CausalLM, DecodeCache, count_params, kv_cache  # noqa: F401  (count_params: re-export)
from models.layers import dense, param_init

from jaxrl_base.errors import ModelError

CONV = "conv"
LAYER_TYPES = (CONV, ATTENTION)
Lfm2Cache = DecodeCache  # LFM2's cache: keys and values of its attention layers, the state of its convs


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Lfm2Config(DecoderConfig):
    """LFM2 hyper-parameters, fields named as in Hugging Face's `config.json` (plus the fields of
    `models.base.OURS`, which are not written to it).

    `intermediate_size` is the raw `block_ff_dim`; the MLP width actually used is `ff_dim` (auto-adjust rule).
    `layer_types[i]` is "conv" or "full_attention"; `head_dim` is hidden_size // num_attention_heads.
    """

    vocab_size: int = 65536
    hidden_size: int = 1024
    intermediate_size: int = 6656
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    layer_types: tuple[str, ...] = tuple(ATTENTION if i in (2, 5, 8, 10, 12, 14) else CONV for i in range(16))
    max_position_embeddings: int = 128_000
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    rope_theta: float = DEFAULT_THETA
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    # --- ours (not in config.json) ---
    dtype: str = "float32"  # activations / matmul inputs
    param_dtype: str = "float32"  # stored parameters
    remat: bool = False  # rematerialize each decoder layer in the full forward (saves activation memory)
    # Batch rows whose multi-token attention (prefill chunks, the full forward) is computed together, in a
    # loop over row groups, so that their float32 score block stays in the CPU's caches. None: automatic
    # (on the CPU backend, as many rows as fit `ATTENTION_BLOCK_BYTES`; on GPU/TPU the whole batch in one
    # batched op); 0: the whole batch; n: n rows (the largest divisor of the batch not above n).
    attention_row_block: int | None = None
    # Multi-token attention (training's full forward, prefill chunks): "ours" (`_attend`: GQA as batched
    # matmuls, row groups on the CPU), "xla" / "cudnn" (`jax.nn.dot_product_attention` with that
    # implementation; "cudnn" is the fused flash kernel, CUDA GPUs with bfloat16/float16 only), "auto"
    # ("ours" on the CPU, where it is faster; "cudnn" on a GPU when dtype allows, else "xla"). Decode steps
    # (one new token) always use "ours": they read the cache in place in its own layout.
    attention: str = "auto"
    # KV and conv cache dtype; None: the activation `dtype`.
    cache_dtype: str | None = None

    model_type = "lfm2"
    architecture = "Lfm2ForCausalLM"
    LAYER_TYPES = LAYER_TYPES
    NAMES = LayerNames(attention_norm="operator_norm", mlp_norm="ffn_norm", mlp="feed_forward", gate="w1", up="w3",
                       down="w2", q_norm="q_layernorm", k_norm="k_layernorm", out="out_proj",
                       final_norm="embedding_norm")
    ARCH_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "layer_types", "tie_word_embeddings", "conv_bias")

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        self._check_ours()
        self._check_positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "conv_L_cache", "block_multiple_of")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Lfm2Config.hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); choose heads that divide hidden_size")
        self._check_layers()

    # ---- derived sizes ----
    @property
    def head_dim(self) -> int:
        """Per-head width, hidden_size // num_attention_heads (as transformers' Lfm2Attention)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def ff_dim(self) -> int:
        """MLP width after transformers' auto-adjust rule (LFM2-350M: block_ff_dim 6656 -> 4608)."""
        ff = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            ff = int(2 * ff / 3)
            if self.block_ffn_dim_multiplier is not None:
                ff = int(self.block_ffn_dim_multiplier * ff)
                m = self.block_multiple_of
                ff = m * ((ff + m - 1) // m)
        return ff

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """Indices of the short-conv layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CONV)

    def replace(self, **changes) -> Lfm2Config:
        """A copy with some fields changed (validated again)."""
        if "layer_types" in changes and "num_hidden_layers" not in changes:
            changes["num_hidden_layers"] = len(changes["layer_types"])
        return dataclasses.replace(self, **changes)

    def first_layers(self, n: int) -> Lfm2Config:
        """The same model cut to its first `n` layers (and their types)."""
        return self.replace(layer_types=self.layer_types[:n])

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides) -> Lfm2Config:
        """Reads a Hugging Face LFM2 `config.json` dict (also the legacy keys `full_attn_idxs`, `block_ff_dim`,
        `tie_embedding`, `theta`/`rope_theta`); `overrides` set fields directly (e.g. dtype="bfloat16")."""
        if not isinstance(d, Mapping):
            raise ValueError(f"an LFM2 config must be a dict (config.json), got {type(d).__name__}")
        model_type = d.get("model_type", "lfm2")
        if model_type != "lfm2":
            raise ModelError(
                f"config.json has model_type {model_type!r}, not 'lfm2': this loader only reads LFM2 "
                "text models (Lfm2ForCausalLM)")
        defaults = cls()
        kw: dict[str, Any] = {}
        plain = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "norm_eps", "conv_bias", "conv_L_cache",
                 "block_multiple_of", "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim",
                 "tie_word_embeddings", "initializer_range", "pad_token_id", "bos_token_id",
                 "eos_token_id")
        for key in plain:
            if key in d:
                kw[key] = d[key]
        # transformers: block_ff_dim / tie_embedding override intermediate_size / tie_word_embeddings
        if d.get("block_ff_dim") is not None:
            kw["intermediate_size"] = d["block_ff_dim"]
        if d.get("tie_embedding") is not None:
            kw["tie_word_embeddings"] = d["tie_embedding"]
        if "num_attention_heads" not in kw and d.get("num_heads") is not None:
            kw["num_attention_heads"] = d["num_heads"]
        kw["rope_theta"] = rope_theta_of(d)
        n_layers = kw.get("num_hidden_layers", defaults.num_hidden_layers)
        if d.get("layer_types") is not None:
            kw["layer_types"] = tuple(d["layer_types"])
        else:
            idxs = d.get("full_attn_idxs")
            idxs = list(range(n_layers)) if idxs is None else list(idxs)
            kw["layer_types"] = tuple(ATTENTION if i in idxs else CONV for i in range(n_layers))
        kw.update(overrides)
        config = cls(**kw)
        if d.get("head_dim") not in (None, config.head_dim):
            raise ValueError(
                f"config.json head_dim {d['head_dim']} differs from hidden_size // num_attention_heads "
                f"({config.head_dim}); LFM2 (as transformers implements it) does not support a separate head_dim")
        return config

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **overrides) -> Lfm2Config:
        """Reads `folder/config.json` (see `from_hf_dict`)."""
        return cls.from_hf_dict(read_config_json(folder), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict that `transformers.Lfm2Config(**d)` reads back identically."""
        d: dict[str, Any] = {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "layer_types": list(self.layer_types),
            "full_attn_idxs": list(self.attention_layers),
            "max_position_embeddings": self.max_position_embeddings,
            "norm_eps": self.norm_eps,
            "conv_bias": self.conv_bias,
            "conv_L_cache": self.conv_L_cache,
            "block_multiple_of": self.block_multiple_of,
            "block_ffn_dim_multiplier": self.block_ffn_dim_multiplier,
            "block_auto_adjust_ff_dim": self.block_auto_adjust_ff_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "use_cache": True,
            "dtype": self.param_dtype,
        }
        return d


def _lfm2_preset(hidden: int, ff: int, heads: int) -> Lfm2Config:
    return Lfm2Config(hidden_size=hidden, intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=8,
                      eos_token_id=7)


PRESETS: dict[str, Lfm2Config] = {
    # The released LFM2 text models (16 layers, attention at 2, 5, 8, 10, 12, 14, vocab 65536).
    "lfm2-350m": _lfm2_preset(1024, 6656, 16),  # 354,483,968 parameters
    "lfm2-700m": _lfm2_preset(1536, 10240, 24),
    "lfm2-1.2b": _lfm2_preset(2048, 12288, 32),
    # Tests: ~80k parameters, both layer kinds, GQA.
    "tiny": Lfm2Config(vocab_size=512, hidden_size=32, intermediate_size=192, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2,
                       layer_types=(CONV, ATTENTION, CONV, ATTENTION), block_multiple_of=16,
                       max_position_embeddings=4096, rope_theta=10_000.0),
    # CPU experiments and the forward benchmark: ~5.3M parameters, ~1k-vocab project tokenizer.
    "cpu-5m": Lfm2Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2,
                         layer_types=(CONV, CONV, ATTENTION, CONV, CONV, ATTENTION, CONV, ATTENTION),
                         max_position_embeddings=4096),
}


class DepthwiseCausalConv(nn.Module):
    """Depthwise conv without padding: seq [B, K-1+T, D] -> [B, T, D], out[t] = sum_k kernel[k] * seq[t + k]
    (+ bias). Param `kernel` [K, D] is torch's Conv1d weight [D, 1, K] transposed."""

    config: Lfm2Config

    @nn.compact
    def __call__(self, seq: jax.Array) -> jax.Array:
        cfg = self.config
        D, K = cfg.hidden_size, cfg.conv_L_cache
        T = seq.shape[1] - (K - 1)
        kernel = self.param("kernel", param_init(cfg, ("conv_window", "conv_hidden")), (K, D), cfg.jnp_param_dtype)
        kernel = jnp.asarray(kernel, cfg.jnp_dtype)
        out = seq[:, 0:T] * kernel[0]
        for k in range(1, K):
            out = out + seq[:, k:k + T] * kernel[k]
        if cfg.conv_bias:
            bias = self.param("bias", param_init(cfg, ("conv_hidden",), nn.initializers.zeros), (D,), cfg.jnp_param_dtype)
            out = out + jnp.asarray(bias, cfg.jnp_dtype)
        return out


class ShortConv(nn.Module):
    """Gated short convolution. x [B, T, D] -> ([B, T, D], new conv state [B, K-1, D]).

    `state` [B, K-1, D] holds the K-1 conv inputs before x (None: zeros, the zero left padding of the full
    forward);
    `num_valid` [B] (cached path only): only x[b, :num_valid[b]] are real; the new state is the last K-1 real
    inputs of the concatenation [state, B*x].
    """

    config: Lfm2Config

    @nn.compact
    def __call__(self, x: jax.Array, state: jax.Array | None, num_valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        D, K = cfg.hidden_size, cfg.conv_L_cache
        T = x.shape[1]
        if state is None:
            state = jnp.zeros((x.shape[0], K - 1, D), cfg.jnp_dtype)
        bcx = dense(cfg, 3 * D, ("embed", "conv_in"), "in_proj", cfg.conv_bias)(x)
        b, c, xx = jnp.split(bcx, 3, axis=-1)
        bx = b * xx  # [B, T, D], the conv input
        seq = jnp.concatenate([state.astype(bx.dtype), bx], axis=1)  # [B, K-1+T, D]
        conv = DepthwiseCausalConv(cfg, name="conv")(seq)
        y = dense(cfg, D, ("conv_hidden", "embed"), "out_proj", cfg.conv_bias)(c * conv)
        if K == 1:
            new_state = state
        elif num_valid is None:
            new_state = seq[:, T:]  # last K-1 inputs
        else:  # last K-1 REAL inputs of row b: seq[b, num_valid[b] : num_valid[b] + K-1]
            idx = num_valid[:, None] + jnp.arange(K - 1)[None, :]
            new_state = jnp.take_along_axis(seq, idx[:, :, None], axis=1)
        return y, new_state.astype(state.dtype)


class Lfm2ForCausalLM(CausalLM):
    """LFM2 causal LM, weights compatible with `transformers.Lfm2ForCausalLM` (see `models.hf`): the shared
    `CausalLM` with `ShortConv` for its "conv" layers."""

    OPERATORS = {CONV: ("conv", ShortConv)}


def init_cache(config: Lfm2Config, batch: int, max_len: int, dtype=None) -> DecodeCache:
    """An empty cache: lengths 0, zero keys [batch, kv_heads, head_dim, max_len] and values
    [batch, kv_heads, max_len, head_dim], zero conv states [batch, conv_L_cache-1, hidden]; dtype defaults
    to `config.cache_dtype` (itself defaulting to the activation dtype `config.dtype`)."""
    dtype = config.jnp_cache_dtype if dtype is None else dtype
    states = tuple(jnp.zeros((batch, config.conv_L_cache - 1, config.hidden_size), dtype) for _ in config.conv_layers)
    return kv_cache(config, batch, max_len, dtype, states)


def init_params(config: Lfm2Config, key: jax.Array) -> dict:
    """Random parameters (plain arrays in `config.param_dtype`), normal(initializer_range) weights, unit norms."""
    module = Lfm2ForCausalLM(config)
    return jax.jit(lambda k: module.init(k, jnp.zeros((1, 1), jnp.int32))["params"])(key)


def _is_conv_kernel(path: tuple[str, ...]) -> bool:
    return len(path) >= 3 and path[-3:] == ("conv", "conv", "kernel")


FAMILY = ModelFamily(
    model_type="lfm2", config=Lfm2Config, module=Lfm2ForCausalLM, init_cache=init_cache, presets=PRESETS,
    # target name -> (operator module, Dense module) inside a layer; HF `self_attn.out_proj` is "o_proj"
    lora_targets={"q_proj": ("self_attn", "q_proj"), "k_proj": ("self_attn", "k_proj"),
                  "v_proj": ("self_attn", "v_proj"), "o_proj": ("self_attn", "out_proj"),
                  "w1": ("feed_forward", "w1"), "w2": ("feed_forward", "w2"), "w3": ("feed_forward", "w3"),
                  "conv_in": ("conv", "in_proj"), "conv_out": ("conv", "out_proj")},
    lora_groups={"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("w1", "w2", "w3"),
                 "conv": ("conv_in", "conv_out")},
    # the depthwise conv's torch weight is [D, 1, K]; ours [K, D]
    layouts=(TensorLayout(_is_conv_kernel, to_hf=lambda a: a.T[:, None, :],
                          to_flax=lambda t: t.reshape(t.shape[0], t.shape[-1]).T,
                          hf_shape=lambda shape: (shape[1], 1, shape[0])),),
)
