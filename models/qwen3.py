"""Qwen3 (dense) in Flax: its config, presets and the family record behind the seam.

Matches `transformers.Qwen3ForCausalLM` (same weights, same logits) with the shared decoder
(`models.decoder`): every layer is pre-norm GQA attention (`input_layernorm`, `self_attn`) then a SwiGLU MLP
(`post_attention_layernorm`, `mlp.{gate,up,down}_proj`); per-head RMSNorm on q and k (`q_norm`, `k_norm`)
before RoPE; `head_dim` from the config (128 in the released models, not hidden / heads); q/k/v/o without
bias unless `attention_bias`; the final `norm`; the LM head tied to the embedding or not
(`tie_word_embeddings`); `rope_theta` from the config. Sliding-window layers are refused (`ModelError`).

Parameter tree (Flax layouts; Dense kernels are `[in, out]`, torch's weight transposed)::

    embed_tokens/embedding [V, D]      norm/scale [D]      lm_head/kernel [D, V] (untied)
    layers_{i}/input_layernorm/scale [D]      layers_{i}/post_attention_layernorm/scale [D]
    layers_{i}/self_attn/{q_proj [D, H*hd], k_proj, v_proj [D, KV*hd], o_proj [H*hd, D]}/kernel (+ bias)
    layers_{i}/self_attn/{q_norm,k_norm}/scale [hd]
    layers_{i}/mlp/{gate_proj,up_proj}/kernel [D, F], mlp/down_proj/kernel [F, D]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxrl_base.errors import ModelError
from models.base import ATTENTION, DecoderConfig, LayerNames, ModelFamily, read_config_json, rope_theta_of
from models.decoder import CausalLM, DecodeCache, kv_cache

SLIDING = "sliding_attention"  # transformers' layer type of a sliding-window layer (refused)
# What transformers' Qwen3Config takes for a key config.json leaves out (its defaults, not Qwen3-0.6B's).
_HF_DEFAULTS = {"vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
                "num_attention_heads": 32, "head_dim": 128, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
                "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """Qwen3 hyper-parameters, fields named as in Hugging Face's `config.json` (plus the fields of
    `models.base.OURS`, which are not written to it). Defaults: Qwen3-0.6B. Every layer is full attention
    (`layer_types`); `intermediate_size` is the MLP width."""

    vocab_size: int = 151_936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 40_960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = 151_643
    eos_token_id: int | tuple[int, ...] | None = 151_645
    # --- ours (not in config.json; `models.base.OURS`, as in Lfm2Config) ---
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    attention_row_block: int | None = None
    attention: str = "auto"
    cache_dtype: str | None = None

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    NAMES = LayerNames(attention_norm="input_layernorm", mlp_norm="post_attention_layernorm", mlp="mlp",
                       gate="gate_proj", up="up_proj", down="down_proj", q_norm="q_norm", k_norm="k_norm",
                       out="o_proj", final_norm="norm")
    ARCH_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_ours()
        self._check_positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim")
        self._check_layers()

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Every layer is full attention (sliding-window layers are refused when read)."""
        return (ATTENTION,) * self.num_hidden_layers

    @property
    def norm_eps(self) -> float:
        """The RMSNorm epsilon (`rms_norm_eps`), under the name the shared layers read."""
        return self.rms_norm_eps

    @property
    def ff_dim(self) -> int:
        """The MLP width (`intermediate_size`)."""
        return self.intermediate_size

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides) -> Qwen3Config:
        """Reads a Hugging Face Qwen3 `config.json` dict (transformers 4 or 5: `rope_theta` or `rope_parameters`);
        `overrides` set fields directly (e.g. dtype="bfloat16"). ModelError for what this implementation
        does not run: sliding-window layers, RoPE scaling, an activation other than SiLU."""
        if not isinstance(d, Mapping):
            raise ModelError(f"a Qwen3 config must be a dict (config.json), got {type(d).__name__}")
        if d.get("model_type", "qwen3") != "qwen3":
            raise ModelError(f"config.json has model_type {d['model_type']!r}, not 'qwen3'")
        kw: dict[str, Any] = {**_HF_DEFAULTS, **{k: d[k] for k in _HF_DEFAULTS if d.get(k) is not None}}
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            kw[k] = d.get(k)
        kw["num_key_value_heads"] = d.get("num_key_value_heads") or kw["num_attention_heads"]  # None: MHA
        kw["rope_theta"] = rope_theta_of(d, default=10_000.0)
        if d.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json hidden_act is {d['hidden_act']!r}; Qwen3 here runs 'silu' only")
        n_layers = kw.get("num_hidden_layers", cls.num_hidden_layers)
        types = d.get("layer_types")
        if types is None and d.get("use_sliding_window") and d.get("sliding_window") is not None:
            start = d.get("max_window_layers", 28)
            types = [SLIDING if i >= start else ATTENTION for i in range(n_layers)]
        sliding = [i for i, t in enumerate(types or ()) if t != ATTENTION]
        if sliding:
            raise ModelError(
                f"config.json makes layers {sliding[:8]}{' ...' if len(sliding) > 8 else ''} "
                f"{(types or [])[sliding[0]]!r} (use_sliding_window / layer_types): sliding-window attention is not "
                "supported here; use a Qwen3 checkpoint with full attention in every layer (use_sliding_window "
                "false, as the released Qwen3 models)")
        if types is not None and len(types) != n_layers:
            raise ModelError(f"config.json layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, folder, **overrides) -> Qwen3Config:
        """Reads `folder/config.json` (see `from_hf_dict`)."""
        return cls.from_hf_dict(read_config_json(folder), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict that `transformers.Qwen3Config(**d)` reads back identically."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "use_cache": True,
            "dtype": self.param_dtype,
        }


_SMALL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # small vocabularies: LFM2's presets' ids
PRESETS: dict[str, Qwen3Config] = {
    # The released Qwen3 dense models' architecture (random weights until loaded from a checkpoint).
    "qwen3-0.6b": Qwen3Config(),  # 596,049,920 parameters (tied)
    "qwen3-1.7b": Qwen3Config(hidden_size=2048, intermediate_size=6144),
    # Tests: head_dim 16 != hidden / heads (8), GQA 4/2, two layers.
    "qwen3-tiny": Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=4096, rope_theta=10_000.0, **_SMALL_IDS),
    # CPU experiments: the Qwen3 layout at LFM2 cpu-5m's scale (head_dim 128 = 2 x hidden / heads).
    "qwen3-cpu": Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                             max_position_embeddings=4096, **_SMALL_IDS),
}


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 causal LM, weights compatible with `transformers.Qwen3ForCausalLM` (see `models.hf`): the shared
    `CausalLM`, attention layers only."""


def init_cache(config: Qwen3Config, batch: int, max_len: int, dtype=None) -> DecodeCache:
    """An empty cache: lengths 0, per layer zero keys [batch, kv_heads, head_dim, max_len] and values
    [batch, kv_heads, max_len, head_dim]; dtype defaults to config.cache_dtype, else config.dtype."""
    return kv_cache(config, batch, max_len, dtype)


FAMILY = ModelFamily(
    model_type="qwen3", config=Qwen3Config, module=Qwen3ForCausalLM, init_cache=init_cache, presets=PRESETS,
    # PEFT's names for Qwen3's projections
    lora_targets={"q_proj": ("self_attn", "q_proj"), "k_proj": ("self_attn", "k_proj"),
                  "v_proj": ("self_attn", "v_proj"), "o_proj": ("self_attn", "o_proj"),
                  "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
                  "down_proj": ("mlp", "down_proj")},
    lora_groups={"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")},
)
