"""LFM2 (Liquid AI) in Flax: config, architecture and decode cache.

Matches `transformers.Lfm2ForCausalLM` exactly (same weights, same logits):

* decoder layers of two kinds, chosen by `config.layer_types`: a gated short convolution ("conv") or
  grouped-query attention ("full_attention"); each is pre-norm and residual:
  `h = x + op(operator_norm(x))`, `out = h + feed_forward(ffn_norm(h))`;
* short conv: `B, C, x = split(in_proj(x), 3)`; `y = C * causal_depthwise_conv(B * x)`; `out_proj(y)`;
* attention: q/k/v projections, per-head RMSNorm on q and k, rotate-half RoPE, causal softmax, out_proj;
* SwiGLU MLP `w2(silu(w1 x) * w3 x)` of width `config.ff_dim`;
* RMSNorm in float32 (weight without +1 offset); `embedding_norm` after the last layer; `lm_head` tied to
  the embedding unless `tie_word_embeddings` is false.

Two entry points share the weights (see `Lfm2ForCausalLM.__call__`): a full causal forward (training,
log-probs; optional rematerialization) and a cached path for chunked prefill and decode.

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
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_base.errors import ModelError

CONV = "conv"
ATTENTION = "full_attention"
LAYER_TYPES = (CONV, ATTENTION)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_DEFAULT_THETA = 1_000_000.0
_MASKED = float(np.finfo(np.float32).min)  # score of a masked key (finite: no NaN in empty rows)


def cpu_cache_bytes(level: int, cpu: int = 0) -> int | None:
    """Size in bytes of the data (or unified) cache of `level` (1, 2, 3) seen by CPU `cpu`, from
    /sys/devices/system/cpu/cpu<cpu>/cache (Linux), else `os.sysconf` (glibc); None where neither says."""
    root = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    try:
        for index in sorted(os.listdir(root)):
            read = lambda name: open(os.path.join(root, index, name)).read().strip()  # noqa: E731
            if index.startswith("index") and int(read("level")) == level and read("type") in ("Data", "Unified"):
                size = read("size").upper()
                scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
                return int(size.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    try:
        size = os.sysconf({1: "SC_LEVEL1_DCACHE_SIZE", 2: "SC_LEVEL2_CACHE_SIZE", 3: "SC_LEVEL3_CACHE_SIZE"}[level])
        return int(size) if size and size > 0 else None
    except (KeyError, ValueError, OSError):
        return None


def attention_block_bytes(last_level_cache: int | None) -> int:
    """The float32 score bytes of one automatic attention row group (CPU), from the last-level cache size.

    Rule: 3/16 of the last-level cache, between 1 MiB and 6 MiB (4 MiB when the size is unknown). A score
    block is written once and read about four times (max, exp, sum, the value product) next to its
    queries, keys, values and output, and the L3 is shared with the other cores' work, so a fraction of it
    keeps the block resident. Measured on a 2-core EPYC (512 KiB L2 per core, 32 MiB L3, giving 6 MiB): a
    [256, 2, 168, 1024] prefill block is 4.5x faster in groups of 4 rows (5 MB) than in one op (336 MB), a
    [16, 2, 768, 384] full forward 4.8x in groups of 2. The 6 MiB cap: a VM's share of a large server L3
    is unknown, and a smaller block only costs loop steps, while one past the cache costs the 4.5x.
    """
    if not last_level_cache:
        return 4 * 2**20
    return int(min(max(last_level_cache * 3 // 16, 2**20), 6 * 2**20))


# Automatic attention row blocks (CPU): the float32 scores of one group of rows stay under this size
# (`attention_block_bytes` of this machine's last-level cache, read once at import).
ATTENTION_BLOCK_BYTES = attention_block_bytes(cpu_cache_bytes(3) or cpu_cache_bytes(2))
ATTENTION_IMPLEMENTATIONS = ("auto", "ours", "xla", "cudnn")  # `Lfm2Config.attention`


def _dtype_name(dtype: Any) -> str:
    """Canonical name ("float32", "bfloat16", "float16") of a dtype given as a string or numpy/jax dtype."""
    if dtype is None:
        return "float32"
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32"}.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return name


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Lfm2Config:
    """LFM2 hyper-parameters, fields named as in Hugging Face's `config.json` (plus `dtype`, `param_dtype`,
    `remat`, which are ours and not written to config.json).

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
    rope_theta: float = _DEFAULT_THETA
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

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        set_("dtype", _dtype_name(self.dtype))
        set_("param_dtype", _dtype_name(self.param_dtype))
        if self.cache_dtype is not None:
            try:
                set_("cache_dtype", _dtype_name(self.cache_dtype))
            except ValueError:
                raise ValueError(f"Lfm2Config.cache_dtype is {self.cache_dtype!r}: unsupported; use one of "
                                 f"{sorted(_DTYPES)}, or leave it unset for the activation dtype") from None
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"Lfm2Config.attention is {self.attention!r}: use one of "
                             f"{', '.join(map(repr, ATTENTION_IMPLEMENTATIONS))}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "conv_L_cache", "block_multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Lfm2Config.{name} must be a positive integer, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"Lfm2Config.layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one type per layer")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(
                    f"Lfm2Config.layer_types[{i}] is {kind!r}: unknown layer type; use 'conv' or 'full_attention'")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Lfm2Config.hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); choose heads that divide hidden_size")
        if self.head_dim % 2:
            raise ValueError(f"Lfm2Config.head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Lfm2Config.num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads}); grouped-query attention needs whole groups")
        rows = self.attention_row_block
        if rows is not None and (not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 0):
            raise ValueError(f"Lfm2Config.attention_row_block must be None (automatic), 0 (the whole batch) or a "
                             f"positive number of rows, got {self.attention_row_block!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("Lfm2Config.norm_eps and rope_theta must be positive")

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
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (HF's `full_attn_idxs`)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """Indices of the short-conv layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CONV)

    @property
    def jnp_dtype(self):
        """Activation dtype as a jnp dtype."""
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        """Parameter dtype as a jnp dtype."""
        return _DTYPES[self.param_dtype]

    @property
    def jnp_cache_dtype(self):
        """KV / conv cache dtype as a jnp dtype (`cache_dtype`, else the activation dtype)."""
        return _DTYPES[self.cache_dtype or self.dtype]

    def replace(self, **changes) -> Lfm2Config:
        """A copy with some fields changed (validated again)."""
        if "layer_types" in changes and "num_hidden_layers" not in changes:
            changes["num_hidden_layers"] = len(changes["layer_types"])
        return dataclasses.replace(self, **changes)

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
        theta = d.get("theta", d.get("rope_theta"))
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, Mapping):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(
                    f"config.json rope_parameters.rope_type is {rope_type!r}; only 'default' RoPE is supported")
            theta = rope.get("rope_theta", theta)
        kw["rope_theta"] = float(theta) if theta is not None else _DEFAULT_THETA
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
        path = os.path.join(os.fspath(folder), "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: an LFM2 checkpoint folder needs a config.json")
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:  # e.g. a copy or download cut short
                raise ModelError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): the file "
                                 "is damaged or cut short; copy or download it again") from None
        return cls.from_hf_dict(data, **overrides)

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


# --------------------------------------------------------------------------------------------------
# Sharding: logical axis names -> mesh axes
# --------------------------------------------------------------------------------------------------


def logical_axis_rules(fsdp: bool = True, tensor: bool = False) -> tuple[tuple[str, Any], ...]:
    """Rules mapping the logical axes of the LFM2 params (and "batch") onto mesh axes `data`/`fsdp`/`tensor`.

    fsdp: shard the `embed` dimension of every weight over `fsdp` (and the batch over data x fsdp);
    tensor: shard `vocab`, `mlp`, `heads`, `kv_heads` over `tensor`. Use with
    `nn.logical_to_mesh_sharding(logical_param_specs(config), mesh, rules)`.
    """
    t = "tensor" if tensor else None
    return (
        ("batch", ("data", "fsdp") if fsdp else "data"),
        ("embed", "fsdp" if fsdp else None),
        ("vocab", t),
        ("mlp", t),
        ("heads", t),
        ("kv_heads", t),
        ("conv_in", None),
        ("conv_hidden", None),
        ("conv_window", None),
        ("norm", None),
        ("head_dim", None),
    )


def logical_param_specs(config: Lfm2Config) -> Any:
    """Pytree (same structure as the params) of `PartitionSpec`s over logical axis names."""
    module = Lfm2ForCausalLM(config)
    boxed = jax.eval_shape(
        lambda: nn.Module.init(module, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    return nn.get_partition_spec(boxed)


def param_shardings(config: Lfm2Config, mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]] | None = None):
    """Pytree of `NamedSharding`s for the params on `mesh` (default rules: `logical_axis_rules()`)."""
    rules = logical_axis_rules() if rules is None else rules
    return nn.logical_to_mesh_sharding(logical_param_specs(config), mesh, rules)


def _init(config: Lfm2Config, names: tuple[str | None, ...], init=None):
    init = nn.initializers.normal(config.initializer_range) if init is None else init
    return nn.with_logical_partitioning(init, names)


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


class Lfm2Cache(NamedTuple):
    """Decode state for a batch of B rows (a pytree; donate it to jit).

    lengths: int32[B]                      tokens already in the cache per row
    keys: tuple over attention layers (in layer order) of [B, kv_heads, head_dim, max_len] (after k-norm
          and RoPE; time is the minor axis so the decode's q.k contraction vectorizes on CPU)
    values: tuple over attention layers of [B, kv_heads, max_len, head_dim]
    conv: tuple over conv layers (in layer order) of [B, conv_L_cache - 1, hidden]: the last K-1 inputs of the
          depthwise conv (B * x after in_proj), oldest first
    """

    lengths: jax.Array
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        """Positions available per row (0 when the model has no attention layer)."""
        return self.values[0].shape[2] if self.values else 0


def init_cache(config: Lfm2Config, batch: int, max_len: int, dtype=None) -> Lfm2Cache:
    """An empty cache: lengths 0, zero keys [batch, kv_heads, head_dim, max_len] and values
    [batch, kv_heads, max_len, head_dim], zero conv states [batch, conv_L_cache-1, hidden]; dtype defaults
    to `config.cache_dtype` (itself defaulting to the activation dtype `config.dtype`)."""
    dtype = config.jnp_cache_dtype if dtype is None else dtype
    k_shape = (batch, config.num_key_value_heads, config.head_dim, max_len)
    v_shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
    n_attn = len(config.attention_layers)
    return Lfm2Cache(
        lengths=jnp.zeros((batch,), jnp.int32),
        keys=tuple(jnp.zeros(k_shape, dtype) for _ in range(n_attn)),
        values=tuple(jnp.zeros(v_shape, dtype) for _ in range(n_attn)),
        conv=tuple(jnp.zeros((batch, config.conv_L_cache - 1, config.hidden_size), dtype)
                   for _ in config.conv_layers),
    )


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32: `scale * (x / rms(x)).astype(x.dtype)` (no +1 offset)."""

    config: Lfm2Config
    logical_axis: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", _init(self.config, (self.logical_axis,), nn.initializers.ones),
                           (x.shape[-1],), self.config.jnp_param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.norm_eps)
        return jnp.asarray(scale, x.dtype) * xf.astype(x.dtype)


def _dense(config: Lfm2Config, features: int, names: tuple[str, str], name: str, bias: bool = False):
    """A Dense projection [..., in] -> [..., features], run on the rows flattened to 2-D: [N, in] @ [in, out].

    The flattening is free (a bitcast) and leaves the parameters and values as they were, but the
    backward's weight gradient is then one plain [in, N] @ [N, out] product instead of a contraction over
    two batch axes, which XLA:CPU lays out with extra transposes (the CPU preset's every-row GRPO update:
    2.58 -> 2.15 s in `experiments/benchmarks/train_throughput.py`, results/train_throughput*.log).
    """
    dense = nn.Dense(features, use_bias=bias, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
                     kernel_init=_init(config, names),
                     bias_init=_init(config, (names[1],), nn.initializers.zeros), name=name)

    def project(x: jax.Array) -> jax.Array:
        return dense(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (features,))

    return project


class MLP(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`; x [B, T, D] -> [B, T, D], hidden width `config.ff_dim`."""

    config: Lfm2Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        gate = _dense(cfg, cfg.ff_dim, ("embed", "mlp"), "w1")(x)
        up = _dense(cfg, cfg.ff_dim, ("embed", "mlp"), "w3")(x)
        return _dense(cfg, cfg.hidden_size, ("mlp", "embed"), "w2")(nn.silu(gate) * up)


class DepthwiseCausalConv(nn.Module):
    """Depthwise conv without padding: seq [B, K-1+T, D] -> [B, T, D], out[t] = sum_k kernel[k] * seq[t + k]
    (+ bias). Param `kernel` [K, D] is torch's Conv1d weight [D, 1, K] transposed."""

    config: Lfm2Config

    @nn.compact
    def __call__(self, seq: jax.Array) -> jax.Array:
        cfg = self.config
        D, K = cfg.hidden_size, cfg.conv_L_cache
        T = seq.shape[1] - (K - 1)
        kernel = self.param("kernel", _init(cfg, ("conv_window", "conv_hidden")), (K, D), cfg.jnp_param_dtype)
        kernel = jnp.asarray(kernel, cfg.jnp_dtype)
        out = seq[:, 0:T] * kernel[0]
        for k in range(1, K):
            out = out + seq[:, k:k + T] * kernel[k]
        if cfg.conv_bias:
            bias = self.param("bias", _init(cfg, ("conv_hidden",), nn.initializers.zeros), (D,), cfg.jnp_param_dtype)
            out = out + jnp.asarray(bias, cfg.jnp_dtype)
        return out


class ShortConv(nn.Module):
    """Gated short convolution. x [B, T, D] -> ([B, T, D], new conv state [B, K-1, D]).

    `state` [B, K-1, D] holds the K-1 conv inputs before x (zeros: the zero left padding of the full forward);
    `num_valid` [B] (cached path only): only x[b, :num_valid[b]] are real; the new state is the last K-1 real
    inputs of the concatenation [state, B*x].
    """

    config: Lfm2Config

    @nn.compact
    def __call__(self, x: jax.Array, state: jax.Array, num_valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        D, K = cfg.hidden_size, cfg.conv_L_cache
        T = x.shape[1]
        bcx = _dense(cfg, 3 * D, ("embed", "conv_in"), "in_proj", cfg.conv_bias)(x)
        b, c, xx = jnp.split(bcx, 3, axis=-1)
        bx = b * xx  # [B, T, D], the conv input
        seq = jnp.concatenate([state.astype(bx.dtype), bx], axis=1)  # [B, K-1+T, D]
        conv = DepthwiseCausalConv(cfg, name="conv")(seq)
        y = _dense(cfg, D, ("conv_hidden", "embed"), "out_proj", cfg.conv_bias)(c * conv)
        if K == 1:
            new_state = state
        elif num_valid is None:
            new_state = seq[:, T:]  # last K-1 inputs
        else:  # last K-1 REAL inputs of row b: seq[b, num_valid[b] : num_valid[b] + K-1]
            idx = num_valid[:, None] + jnp.arange(K - 1)[None, :]
            new_state = jnp.take_along_axis(seq, idx[:, :, None], axis=1)
        return y, new_state.astype(state.dtype)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, hd], positions int32[B, T]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))  # float32 like torch
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, hd/2]
    cos = jnp.cos(freqs).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(freqs).astype(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    """GQA with q/k RMSNorm and RoPE. x [B, T, D], positions int32[B, T] -> ([B, T, D], (K, V) or None).

    Without `kv` (full forward) keys are this call's tokens, causal by position. With `kv` = (K [B, KV, hd, S],
    V [B, KV, S, hd]) the T new keys/values of row b go to `positions[b]` (entries t >= num_valid[b] are
    dropped) and a query at position q attends to the cached keys at positions <= q. A decode step (T = 1)
    attends to the cache and to its own key before writing it, so XLA updates the cache in place.
    """

    config: Lfm2Config

    @nn.compact
    def __call__(self, x, positions, num_valid, kv):
        cfg = self.config
        B, T, _ = x.shape
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = _dense(cfg, H * hd, ("embed", "heads"), "q_proj")(x).reshape(B, T, H, hd)
        k = _dense(cfg, KV * hd, ("embed", "kv_heads"), "k_proj")(x).reshape(B, T, KV, hd)
        v = _dense(cfg, KV * hd, ("embed", "kv_heads"), "v_proj")(x).reshape(B, T, KV, hd)
        q = RMSNorm(cfg, "head_dim", name="q_layernorm")(q)
        k = RMSNorm(cfg, "head_dim", name="k_layernorm")(k)
        q = _rope(q, positions, cfg.rope_theta)
        k = _rope(k, positions, cfg.rope_theta)
        G = H // KV  # head h = kv * G + g, as transformers' repeat_kv
        # Queries as [B, KV, G*T, hd]: one (G*T, hd) block per row and kv head, so the contractions are
        # plain batched matmuls (a [B, T, KV, G, hd] operand made XLA:CPU transpose inside the dot).
        qq = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        # Cache layouts (see Lfm2Cache): keys [B, KV, hd, S], values [B, KV, S, hd]; both contractions then
        # reduce over a non-minor axis, which XLA:CPU vectorizes well (8-15x faster per decode step than
        # [B, S, KV, hd]). This call's own keys/values stay [B, T, KV, hd].
        chunk = (k, "bskd", v, "bskd", jnp.arange(T)[None, None, :] <= jnp.arange(T)[None, :, None])  # causal

        def project(out):  # [B, KV, G*T, hd] -> out_proj of [B, T, H*hd]
            out = out.reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H * hd)
            return _dense(cfg, cfg.hidden_size, ("heads", "embed"), "out_proj")(out)

        row_block = attention_rows(cfg.attention_row_block, B, KV * G * T * (T if kv is None else kv[0].shape[-1]))
        fused = attention_implementation(cfg.attention, cfg.dtype, hd, cached=kv is not None) if T > 1 else "ours"
        if kv is None:
            if fused != "ours":  # [B, T, H, hd], head h = kv * G + g as ours
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=fused)
                return _dense(cfg, cfg.hidden_size, ("heads", "embed"), "out_proj")(out.reshape(B, T, H * hd)), None
            return project(_attend(qq, [chunk], (B, KV, G, T, hd), row_block)), None
        k_cache, v_cache = kv
        S = k_cache.shape[-1]
        write = jnp.where(jnp.arange(T)[None, :] < num_valid[:, None], positions, S)  # S: out of range, dropped
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))

        def written(k_cache, v_cache, k, v):
            return (k_cache.at[rows, :, :, write].set(k.astype(k_cache.dtype), mode="drop"),
                    v_cache.at[rows, :, write, :].set(v.astype(v_cache.dtype), mode="drop"))

        if T > 1:
            # Chunked prefill: write the chunk, then attend over the cache (one [T, S] score block).
            k_cache, v_cache = written(k_cache, v_cache, k, v)
            seen = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
            if fused != "ours":  # the cache in the [B, S, KV, hd] layout the library takes
                keys = k_cache.astype(q.dtype).transpose(0, 3, 1, 2)
                values = v_cache.astype(q.dtype).transpose(0, 2, 1, 3)
                out = jax.nn.dot_product_attention(q, keys, values, mask=seen[:, None], implementation=fused)
                out = _dense(cfg, cfg.hidden_size, ("heads", "embed"), "out_proj")(out.reshape(B, T, H * hd))
                return out, (k_cache, v_cache)
            cache = (k_cache.astype(q.dtype), "bkds", v_cache.astype(q.dtype), "bksd", seen)
            return project(_attend(qq, [cache], (B, KV, G, T, hd), row_block)), (k_cache, v_cache)
        # Decode step: attend to the cached positions and to the new token, then write it. Reading the
        # cache before writing it lets XLA update it in place; the other order made XLA copy every cache
        # buffer at every step at batch 1. A data dependency keeps the writes after the reads: the
        # written k/v pass through a select on the output (true unless a row's output is NaN/inf, which
        # then writes zeros).
        cached = jnp.arange(S)[None, None, :] < positions[:, :, None]  # [B, 1, S]
        out = _attend(qq, [(k_cache.astype(q.dtype), "bkds", v_cache.astype(q.dtype), "bksd", cached), chunk],
                      (B, KV, G, T, hd), row_block)
        ready = jnp.isfinite(out[:, :1, :1, :1]).reshape(B, 1, 1, 1)
        k_cache, v_cache = written(k_cache, v_cache, jnp.where(ready, k, 0.0), jnp.where(ready, v, 0.0))
        return project(out), (k_cache, v_cache)


def attention_implementation(setting: str, dtype: str, head_dim: int, cached: bool = False) -> str:
    """Which attention a multi-token call uses (`Lfm2Config.attention`): "ours", "xla" or "cudnn".

    "auto": on the CPU "ours" (the row-grouped batched matmuls, faster there than XLA's generic
    attention: see experiments/benchmarks/attention_paths.py); on a GPU the cuDNN flash kernel for the
    full causal forward when dtype is bfloat16/float16 and head_dim a multiple of 8 up to 128, else (and
    for cached prefill chunks, whose per-row offsets need a mask) "xla"; on other backends "xla".
    An explicit "cudnn" on a backend without CUDA, or with float32 compute, raises a ValueError naming the
    setting and the fix.
    """
    backend = jax.default_backend()
    if setting == "cudnn":
        if backend not in ("gpu", "cuda"):
            raise ValueError(f"model.attention = 'cudnn' needs a CUDA GPU, but JAX runs on {backend!r}: use "
                             "'auto' (ours on the CPU) or 'xla'")
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"model.attention = 'cudnn' needs dtype bfloat16 or float16 (got {dtype!r}): set "
                             "model.dtype = 'bfloat16', or use 'xla'")
        return "cudnn"
    if setting != "auto":
        return setting
    if backend == "cpu":
        return "ours"
    if backend in ("gpu", "cuda") and not cached and dtype in ("bfloat16", "float16") and head_dim % 8 == 0 \
            and head_dim <= 128:
        return "cudnn"
    return "xla"


def attention_rows(setting: int | None, batch: int, scores_per_row: int) -> int:
    """Batch rows per attention group (`Lfm2Config.attention_row_block`): a divisor of `batch`.

    setting None: automatic -- on the CPU backend the most rows whose float32 scores (`scores_per_row`
    elements each) fit `ATTENTION_BLOCK_BYTES`, elsewhere the whole batch; 0: the whole batch; n: at
    most n rows. Returns the largest divisor of `batch` not above the wanted number (at least 1).
    """
    if setting is None:
        if jax.default_backend() != "cpu":
            return batch
        want = ATTENTION_BLOCK_BYTES // max(4 * scores_per_row, 1)
    else:
        want = setting or batch
    want = max(1, min(batch, int(want)))
    return next(d for d in range(want, 0, -1) if batch % d == 0)


def _attend(qq: jax.Array, blocks, shape: tuple[int, int, int, int, int], rows: int | None = None) -> jax.Array:
    """Softmax attention over the union of key blocks, without concatenating them.

    qq [B, KV, G*T, hd] (queries grouped per kv head); each block is (keys, keys' einsum spec ("bkds" for
    [B, KV, hd, S] or "bskd" for [B, S, KV, hd]), values, values' spec ("bksd" / "bskd"), mask broadcastable
    to [B, T, S], True where a query sees a key). shape = (B, KV, G, T, hd). Scores in float32; the
    normalization comes after the value products (one division per output element, not per score).
    rows (a divisor of B): compute `rows` batch rows at a time in a `lax.map` over contiguous groups (the
    same values; the score block of a group stays in cache memory); None or B: all at once.
    Returns [B, KV, G*T, hd] in the values' dtype.
    """
    B = shape[0]
    if rows is None or rows >= B:
        return _attend_all(qq, blocks, shape)
    if B % rows:
        raise ValueError(f"attention rows {rows} do not divide the batch {B}")
    # Arrays with a batch axis are split into [B // rows, rows, ...]; broadcast ones (leading 1) stay whole.
    arrays = [qq] + [a for keys, _, values, _, mask in blocks for a in (keys, values, mask)]
    split = [a.shape[0] == B and B > 1 for a in arrays]
    groups = [a.reshape((B // rows, rows) + a.shape[1:]) for a, s in zip(arrays, split) if s]

    def group(parts):
        parts = iter(parts)
        q, *rest = [next(parts) if s else a for a, s in zip(arrays, split)]
        blks = [(rest[3 * i], blocks[i][1], rest[3 * i + 1], blocks[i][3], rest[3 * i + 2]) for i in range(len(blocks))]
        return _attend_all(q, blks, (rows,) + tuple(shape[1:]))

    out = jax.lax.map(group, groups)
    return out.reshape((B,) + out.shape[2:])


def _attend_all(qq: jax.Array, blocks, shape: tuple[int, int, int, int, int]) -> jax.Array:
    """`_attend` over the whole batch in one batched op (same arguments, no `rows`)."""
    B, KV, G, T, hd = shape
    scores = []
    for keys, key_spec, _, _, mask in blocks:
        sc = jnp.einsum(f"bkqd,{key_spec}->bkqs", qq, keys, preferred_element_type=jnp.float32)
        sc = sc.reshape(B, KV, G, T, -1) * (hd ** -0.5)
        scores.append(jnp.where(mask[:, None, None], sc, _MASKED))
    top = functools.reduce(jnp.maximum, [sc.max(-1, keepdims=True) for sc in scores])
    weights = [jnp.exp(sc - top) for sc in scores]
    total = sum(w.sum(-1) for w in weights).reshape(B, KV, G * T, 1)
    out = sum(jnp.einsum(f"bkqs,{value_spec}->bkqd", w.astype(values.dtype).reshape(B, KV, G * T, -1), values,
                         preferred_element_type=jnp.float32)
              for w, (_, _, values, value_spec, _) in zip(weights, blocks))
    return (out / total).astype(blocks[0][2].dtype)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: `h = x + op(operator_norm(x))`; `h + feed_forward(ffn_norm(h))`.

    op is `ShortConv` (state: conv state [B, K-1, D]) or `Attention` (state: None or (K, V) cache).
    Returns (out [B, T, D], new state).
    """

    config: Lfm2Config
    is_attention: bool

    @nn.compact
    def __call__(self, x, positions, num_valid, state):
        cfg = self.config
        h = RMSNorm(cfg, name="operator_norm")(x)
        if self.is_attention:
            h, state = Attention(cfg, name="self_attn")(h, positions, num_valid, state)
        else:
            h, state = ShortConv(cfg, name="conv")(h, state, num_valid)
        h = x + h
        out = h + MLP(cfg, name="feed_forward")(RMSNorm(cfg, name="ffn_norm")(h))
        return out, state


class Lfm2ForCausalLM(nn.Module):
    """LFM2 causal LM, weights compatible with `transformers.Lfm2ForCausalLM` (see `models.hf`).

    `init` returns plain arrays (no logical-axis boxes); get the partitioning from `logical_param_specs`.
    """

    config: Lfm2Config
    remat: bool | None = None  # overrides config.remat when set

    @nn.nowrap
    def init(self, rngs, *args, **kwargs):
        """`flax.linen.Module.init`, with the `nn.Partitioned` boxes removed (plain arrays)."""
        return nn.meta.unbox(super().init(rngs, *args, **kwargs))

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: Lfm2Cache | None = None,
                 num_valid: jax.Array | None = None, last_only: bool = False,
                 logit_positions: jax.Array | None = None) -> tuple[jax.Array, Lfm2Cache | None]:
        """tokens int32[B, T] -> (logits float32[B, T, V], new cache or None).

        cache None: full causal forward over positions 0..T-1 (num_valid ignored).
        cache given: row b's tokens go to positions lengths[b]..lengths[b]+T-1; only the first num_valid[b]
        (int32[B], default T) are real, advance the cache (`lengths += num_valid`, conv state = last K-1 real
        inputs) and are attended to; logits at padded slots are garbage. Needs lengths + num_valid <= max_len.
        last_only: logits float32[B, 1, V] of each row's last real token only (position num_valid[b] - 1,
        or T - 1 without a cache), e.g. for a prefill whose other logits are not needed (the LM head
        then costs one position instead of T).
        logit_positions: int32[B, K] (full forward only): the final hidden states are gathered at these
        positions ([B, K, D]) before the final norm and the LM head, and the logits are float32[B, K, V]
        (row b, slot k: the logits at position logit_positions[b, k]). The same values as the full logits
        taken at those positions; the head and everything after it cost K positions instead of T (e.g. only
        the positions that predict loss tokens, in training).
        """
        cfg = self.config
        B, T = tokens.shape
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                         embedding_init=_init(cfg, ("vocab", "embed")), name="embed_tokens")
        x = embed(tokens)
        if cache is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
            num_valid = None
        else:
            num_valid = (jnp.full((B,), T, jnp.int32) if num_valid is None
                         else jnp.asarray(num_valid, jnp.int32).reshape(B))
            positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        remat = cfg.remat if self.remat is None else self.remat
        layer_cls = nn.remat(DecoderLayer) if (remat and cache is None) else DecoderLayer
        zero_conv = jnp.zeros((B, cfg.conv_L_cache - 1, cfg.hidden_size), cfg.jnp_dtype)
        keys, values, convs = [], [], []
        for i, kind in enumerate(cfg.layer_types):
            attn = kind == ATTENTION
            if cache is None:
                state = None if attn else zero_conv
            elif attn:
                state = (cache.keys[len(keys)], cache.values[len(keys)])
            else:
                state = cache.conv[len(convs)]
            x, state = layer_cls(cfg, attn, name=f"layers_{i}")(x, positions, num_valid, state)
            if cache is not None:
                if attn:
                    keys.append(state[0])
                    values.append(state[1])
                else:
                    convs.append(state)
        if last_only and T > 1:  # (with T = 1 the logits are that position's already: no extra op)
            last = jnp.full((B,), T - 1, jnp.int32) if num_valid is None else jnp.clip(num_valid - 1, 0, T - 1)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
        elif logit_positions is not None:
            if cache is not None:
                raise ValueError("logit_positions is for the full forward (cache None)")
            x = jnp.take_along_axis(x, jnp.asarray(logit_positions, jnp.int32)[..., None], axis=1)  # [B, K, D]
        x = RMSNorm(cfg, name="embedding_norm")(x)
        if cfg.tie_word_embeddings:
            w = jnp.asarray(embed.embedding, cfg.jnp_dtype)  # [V, D]
            logits = jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)
        else:
            logits = _LMHead(cfg, name="lm_head")(x)
        new_cache = None
        if cache is not None:
            new_cache = Lfm2Cache(cache.lengths + num_valid, tuple(keys), tuple(values), tuple(convs))
        return logits.astype(jnp.float32), new_cache


class _LMHead(nn.Module):
    """Untied output projection: x [B, T, D] -> float32 logits [B, T, V] (param `kernel` [D, V])."""

    config: Lfm2Config

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kernel = self.param("kernel", _init(cfg, ("embed", "vocab")), (cfg.hidden_size, cfg.vocab_size),
                            cfg.jnp_param_dtype)
        return jnp.einsum("btd,dv->btv", x, jnp.asarray(kernel, cfg.jnp_dtype), preferred_element_type=jnp.float32)


def init_params(config: Lfm2Config, key: jax.Array) -> dict:
    """Random parameters (plain arrays in `config.param_dtype`), normal(initializer_range) weights, unit norms."""
    module = Lfm2ForCausalLM(config)
    return jax.jit(lambda k: module.init(k, jnp.zeros((1, 1), jnp.int32))["params"])(key)


def count_params(params: Any) -> int:
    """Total number of parameters in a pytree (arrays or ShapeDtypeStructs)."""
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
