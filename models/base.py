"""What every model family shares below its Flax code: dtype names, the config fields that are ours (not
config.json's) with their checks, the Flax names of a family's modules, and `ModelFamily`, the record of one
family that the seam (`models.family`) holds.

A family's config is a frozen dataclass whose fields are named as in Hugging Face's `config.json`, plus the
fields of `OURS`; it derives from `DecoderConfig` for the shared properties and checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from jaxrl_base.errors import ModelError

ATTENTION = "full_attention"  # the layer type of grouped-query attention (every family has it)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = ("auto", "ours", "xla", "cudnn")  # `DecoderConfig.attention`
DEFAULT_THETA = 1_000_000.0
# The config fields that are ours, not config.json's: how the model runs, not what it is (a checkpoint
# restores across them; `to_hf_dict` writes none of them but `dtype` as the weights' dtype).
OURS = ("dtype", "param_dtype", "remat", "attention_row_block", "attention", "cache_dtype")


def dtype_name(dtype: Any) -> str:
    """Canonical name ("float32", "bfloat16", "float16") of a dtype given as a string or numpy/jax dtype."""
    if dtype is None:
        return "float32"
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class LayerNames:
    """The Flax names of a family's modules, which are also its Hugging Face module names
    (`model.layers.{i}.<name>`): the shared layers read them from `config.NAMES`."""

    attention_norm: str  # the norm before the attention (or the layer's other operator)
    mlp_norm: str  # the norm before the MLP
    mlp: str  # the gated MLP module ...
    gate: str  # ... and its three projections: down(silu(gate x) * up x)
    up: str
    down: str
    q_norm: str  # the per-head RMSNorms of the queries and keys, inside `self_attn`
    k_norm: str
    out: str  # the attention's output projection
    final_norm: str  # the norm after the last layer


class DecoderConfig:
    """The shared half of a family's frozen config dataclass (a mixin: the fields are the family's own).

    A family sets the class attributes below and has the fields vocab_size, hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, tie_word_embeddings, initializer_range, rope_theta,
    max_position_embeddings and the fields of `OURS`; `head_dim`, `norm_eps`, `ff_dim` and `layer_types`
    are fields or properties.
    """

    model_type: ClassVar[str]  # config.json's "model_type"
    architecture: ClassVar[str]  # config.json's "architectures"[0]: the transformers class
    LAYER_TYPES: ClassVar[tuple[str, ...]] = (ATTENTION,)  # the layer types the family supports
    NAMES: ClassVar[LayerNames]
    # Fields that fix the parameter shapes: a checkpoint's must equal the config's (`model.init_from` with
    # overrides, `--checkpoint` of an exported folder).
    ARCH_FIELDS: ClassVar[tuple[str, ...]] = ()
    attention_bias: bool = False  # biases on q/k/v/o (a family with the field overrides this default)

    # ---- derived sizes ----
    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Indices of the layers that are not attention (LFM2's short convs): their cache is a state."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != ATTENTION)

    @property
    def jnp_dtype(self):
        """Activation dtype as a jnp dtype."""
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        """Parameter dtype as a jnp dtype."""
        return DTYPES[self.param_dtype]

    @property
    def jnp_cache_dtype(self):
        """KV (and state) cache dtype as a jnp dtype (`cache_dtype`, else the activation dtype)."""
        return DTYPES[self.cache_dtype or self.dtype]

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def first_layers(self, n: int):
        """The same model cut to its first `n` layers (the memory plan compiles such a cut)."""
        return self.replace(num_hidden_layers=n)

    # ---- checks ----
    def _check_ours(self) -> None:
        """Normalizes and checks the fields of `OURS` (ValueError naming the field)."""
        name = type(self).__name__
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("dtype", dtype_name(self.dtype))
        set_("param_dtype", dtype_name(self.param_dtype))
        if self.cache_dtype is not None:
            try:
                set_("cache_dtype", dtype_name(self.cache_dtype))
            except ValueError:
                raise ValueError(f"{name}.cache_dtype is {self.cache_dtype!r}: unsupported; use one of "
                                 f"{sorted(DTYPES)}, or leave it unset for the activation dtype") from None
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"{name}.attention is {self.attention!r}: use one of "
                             f"{', '.join(map(repr, ATTENTION_IMPLEMENTATIONS))}")

    def _check_positive(self, *fields: str) -> None:
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{type(self).__name__}.{field} must be a positive integer, got {value!r}")

    def _check_layers(self) -> None:
        """Checks the layer types, the attention's head layout, the row block and the norm and RoPE constants."""
        name = type(self).__name__
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{name}.layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one type per layer")
        for i, kind in enumerate(self.layer_types):
            if kind not in self.LAYER_TYPES:
                raise ValueError(f"{name}.layer_types[{i}] is {kind!r}: unknown layer type; use "
                                 f"{' or '.join(map(repr, self.LAYER_TYPES))}")
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads}); grouped-query attention needs whole groups")
        rows = self.attention_row_block
        if rows is not None and (not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 0):
            raise ValueError(f"{name}.attention_row_block must be None (automatic), 0 (the whole batch) or a "
                             f"positive number of rows, got {self.attention_row_block!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"{name}.{'norm_eps' if 'norm_eps' in self.__dataclass_fields__ else 'rms_norm_eps'} "
                             "and rope_theta must be positive")


def rope_theta_of(d: Mapping[str, Any], default: float = DEFAULT_THETA) -> float:
    """RoPE's base from a config.json dict: `rope_parameters` (transformers 5) or `rope_scaling` with
    `rope_theta` / `theta`; only the default (unscaled) RoPE is supported (ModelError otherwise)."""
    theta = d.get("theta", d.get("rope_theta"))
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(rope, Mapping):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelError(
                f"config.json rope_parameters.rope_type is {rope_type!r}; only 'default' RoPE is supported")
        theta = rope.get("rope_theta", theta)
    return float(theta) if theta is not None else default


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """A parameter whose Hugging Face tensor is not the Flax array (nor its transpose, as every Dense kernel):
    `matches(flax path)`, and the conversions and the HF shape."""

    matches: Callable[[tuple[str, ...]], bool]
    to_hf: Callable[[Any], Any]
    to_flax: Callable[[Any], Any]
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family behind the seam (`models.family`): what the framework may know of it.

    model_type: config.json's "model_type"; config: the config class (`from_hf_dict(d, **overrides)`,
    `to_hf_dict()`, `from_pretrained(folder)`); module: the Flax causal LM, `module(config)` (its call:
    `models.layers.CausalLM.__call__`); init_cache(config, batch, max_len, dtype=None): an empty decode
    cache; presets: built-in configs by name; lora_targets: LoRA target name -> (operator module, Dense
    module) inside a layer `layers_{i}`, lora_groups: group name -> target names; layouts: the tensors whose
    HF layout is special (Dense kernels are transposed, other tensors kept).
    """

    model_type: str
    config: type
    module: type
    init_cache: Callable[..., Any]
    presets: Mapping[str, Any]
    lora_targets: Mapping[str, tuple[str, str]]
    lora_groups: Mapping[str, tuple[str, ...]]
    layouts: tuple[TensorLayout, ...] = ()

    @property
    def architecture(self) -> str:
        """The transformers class of this family (config.json's "architectures")."""
        return self.config.architecture


def read_config_json(folder: str | os.PathLike) -> dict[str, Any]:
    """The dict of `folder/config.json`; FileNotFoundError when it is missing, ModelError naming the line when
    it is not valid JSON (a copy or download cut short)."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a Hugging Face checkpoint folder needs a config.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): the file "
                             "is damaged or cut short; copy or download it again") from None
