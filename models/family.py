"""The model seam: the one interface through which the framework reaches a model of any family.

The sampler, the rollout, the updates, the memory plan, the FLOP count, LoRA and Hugging Face import/export
call these functions with a family's config (or the module built from it), never a family's own names:

    FAMILIES, by_type(model_type), family_of(config)   the families (LFM2, Qwen3) and their `ModelFamily` records
    PRESETS                                             every family's built-in configs by name
    config_from_hf(d, **overrides)                      a config.json dict -> its family's config (by model_type)
    config_from_pretrained(folder, **overrides)         the same from folder/config.json
    module_of(config, remat=None)                       the Flax causal LM (`models.decoder.CausalLM`)
    cached_call(module)                                 its cached call as the sampler's `model_fn`
    init_cache(config, batch, max_len, dtype=None)      an empty decode cache (`.lengths`, `.max_len`)
    init_params / param_shapes / logical_param_specs / param_shardings
    hf_tensor_names(config), to_hf / to_flax            the Hugging Face tensor names and layouts, both ways
    lora_targets(config), LORA_TARGETS, LORA_GROUPS     LoRA target names (per family; all families')
    flops_per_token(config, context), forward_flops     matmul FLOPs

An unsupported model_type is an `UnsupportedModelError` naming the supported ones.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_base.errors import ModelError
from models import lfm2, qwen3
from models.base import ModelFamily, read_config_json

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (lfm2.FAMILY, qwen3.FAMILY)}
PRESETS: dict[str, Any] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}
assert len(PRESETS) == sum(len(f.presets) for f in FAMILIES.values()), "preset names must be unique"


class UnsupportedModelError(ModelError):
    """A model_type (config.json) or config of no supported family; the message lists the supported ones."""


def _supported() -> str:
    return ", ".join(f"{f.model_type!r} ({f.architecture})" for f in FAMILIES.values())


def by_type(model_type: str, where: str = "config.json") -> ModelFamily:
    """The family of a config.json `model_type` (UnsupportedModelError listing the supported ones)."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"{where} has model_type {model_type!r}, not {' or '.join(map(repr, FAMILIES))}: the supported model "
            f"families are {_supported()}")
    return FAMILIES[model_type]


def family_of(config: Any) -> ModelFamily:
    """The family of a config object (an `Lfm2Config`, a `Qwen3Config`)."""
    for f in FAMILIES.values():
        if isinstance(config, f.config):
            return f
    raise UnsupportedModelError(f"{type(config).__name__} is the config of no supported model family ({_supported()})")


def config_from_hf(d: Mapping[str, Any], where: str = "config.json", **overrides) -> Any:
    """A Hugging Face `config.json` dict -> the config of its family (by `model_type`; a dict without one is
    LFM2's, as older LFM2 exports were). `overrides` set fields directly (e.g. dtype="bfloat16")."""
    if not isinstance(d, Mapping):
        raise ModelError(f"{where} must hold a JSON object, got {type(d).__name__}")
    return by_type(d.get("model_type", "lfm2"), where).config.from_hf_dict(d, **overrides)


def config_from_pretrained(folder: str | os.PathLike, **overrides) -> Any:
    """The config of `folder/config.json` (`config_from_hf`)."""
    return config_from_hf(read_config_json(folder), os.path.join(os.fspath(folder), "config.json"), **overrides)


def module_of(config: Any, remat: bool | None = None) -> nn.Module:
    """The family's Flax causal LM for `config` (`remat` overrides config.remat when set)."""
    return family_of(config).module(config, remat=remat)


def cached_call(module: Any):
    """The cached call of a Flax causal LM (or a LoRA-wrapped one) as the sampler's `model_fn`:
    `(params, tokens [B, T], cache, num_valid [B]) -> (logits [B, 1, V] of each row's last real token, cache)`
    (a prefill chunk computes the LM head at one position, not T)."""

    def model_fn(params, tokens, cache, num_valid):
        return module.apply({"params": params}, tokens, cache=cache, num_valid=num_valid, last_only=True)

    return model_fn


def init_cache(config: Any, batch: int, max_len: int, dtype=None):
    """An empty decode cache of `config`'s family for `batch` rows of `max_len` positions
    (`models.decoder.DecodeCache`; dtype defaults to config.cache_dtype, else config.dtype)."""
    return family_of(config).init_cache(config, batch, max_len, dtype)


def init_params(config: Any, key: jax.Array) -> dict:
    """Random parameters (plain arrays in `config.param_dtype`): normal(initializer_range) weights, unit norms."""
    module = module_of(config)
    return jax.jit(lambda k: module.init(k, jnp.zeros((1, 1), jnp.int32))["params"])(key)


@functools.lru_cache(maxsize=64)
def param_shapes(config: Any) -> Any:
    """ShapeDtypeStructs of `config`'s parameters (nothing computed)."""
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def logical_param_specs(config: Any) -> Any:
    """Pytree (same structure as the params) of `PartitionSpec`s over logical axis names."""
    module = module_of(config)
    boxed = jax.eval_shape(
        lambda: nn.Module.init(module, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    return nn.get_partition_spec(boxed)


def param_shardings(config: Any, mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]] | None = None):
    """Pytree of `NamedSharding`s for the params on `mesh` (default rules: `layers.logical_axis_rules()`)."""
    from models.layers import logical_axis_rules

    rules = logical_axis_rules() if rules is None else rules
    return nn.logical_to_mesh_sharding(logical_param_specs(config), mesh, rules)


# ---- Hugging Face tensors ----


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    return {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def hf_name(path: tuple[str, ...]) -> str:
    """Flax param path -> HF tensor name, e.g. ('layers_2', 'self_attn', 'q_proj', 'kernel') ->
    'model.layers.2.self_attn.q_proj.weight' (every family names its modules as transformers does)."""
    *mods, leaf = path
    leaf = "bias" if leaf == "bias" else "weight"
    if mods == ["lm_head"]:
        return f"lm_head.{leaf}"
    parts = [f"layers.{m[len('layers_'):]}" if m.startswith("layers_") else m for m in mods]
    return "model." + ".".join(parts + [leaf])


def hf_tensor_names(config: Any) -> dict[tuple[str, ...], str]:
    """{Flax param path: HF tensor name} of every parameter of `config` (invert it for the other way)."""
    return {path: hf_name(path) for path in _flat(param_shapes(config))}


def _layout(config: Any, path: tuple[str, ...]):
    return next((lay for lay in family_of(config).layouts if lay.matches(path)), None)


def to_hf(config: Any, path: tuple[str, ...], array: Any) -> Any:
    """A Flax parameter -> its HF tensor layout (Dense kernels transposed: Flax [in, out], torch [out, in])."""
    lay = _layout(config, path)
    return lay.to_hf(array) if lay else (array.T if path[-1] == "kernel" else array)


def to_flax(config: Any, path: tuple[str, ...], tensor: Any) -> Any:
    """An HF tensor -> the Flax layout of the parameter at `path`."""
    lay = _layout(config, path)
    return lay.to_flax(tensor) if lay else (tensor.T if path[-1] == "kernel" else tensor)


def hf_shape(config: Any, path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape of the Flax parameter at `path` of `shape`."""
    lay = _layout(config, path)
    return tuple(lay.hf_shape(shape)) if lay else (tuple(reversed(shape)) if path[-1] == "kernel" else tuple(shape))


# ---- LoRA targets ----


def lora_targets(config: Any) -> Mapping[str, tuple[str, str]]:
    """The LoRA target names of `config`'s family: name -> (operator module, Dense module) in `layers_{i}`."""
    return family_of(config).lora_targets


# Every family's target names, each with the module paths it names in any family, and the groups' union:
# what a `[lora]` table may say before the model is known (a name the model lacks is refused at build).
LORA_TARGETS: dict[str, tuple[tuple[str, str], ...]] = {}
LORA_GROUPS: dict[str, tuple[str, ...]] = {}
for _f in FAMILIES.values():
    for _name, _path in _f.lora_targets.items():
        LORA_TARGETS[_name] = tuple(dict.fromkeys((*LORA_TARGETS.get(_name, ()), _path)))
    for _name, _names in _f.lora_groups.items():
        LORA_GROUPS[_name] = tuple(dict.fromkeys((*LORA_GROUPS.get(_name, ()), *_names)))
LORA_GROUPS["all"] = tuple(LORA_TARGETS)


# ---- FLOPs ----


@functools.lru_cache(maxsize=64)
def matmul_weights(config: Any) -> int:
    """Weights a token multiplies by outside the embedding and the LM head: every parameter but those (norm
    scales and conv taps included, a fraction of a percent)."""
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(param_shapes(config)))
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return n_params - config.vocab_size * config.hidden_size - head


def attention_width(config: Any) -> int:
    """The sum over attention layers of heads x head_dim: the width of the q.k and p.v products."""
    return len(config.attention_layers) * config.num_attention_heads * config.head_dim


def flops_per_token(config: Any, context: int, head: bool = True) -> float:
    """Matmul FLOPs of one token that attends to `context` positions: the dense weights (each multiply-add 2
    FLOPs), attention's two score products, and the LM head when `head`. Not counted: the embedding gather,
    norms, activations, a conv's taps, softmax (a few percent on the CPU presets). A training step is 3x its
    forward (the backward's two products per weight), the usual convention."""
    out = 2 * matmul_weights(config) + 2 * 2 * attention_width(config) * context
    return out + (2 * config.vocab_size * config.hidden_size if head else 0)


def forward_flops(config: Any, lengths: Iterable[int], head_positions: int) -> float:
    """FLOPs of one causal forward of rows of `lengths` tokens (the useful work, no padding), with the LM head
    at `head_positions` positions in all (the loss positions)."""
    body, width = matmul_weights(config), attention_width(config)
    total = 0.0
    for n in lengths:
        n = int(n)
        total += 2 * body * n + 2 * width * n * (n + 1)  # causal: position t attends to t + 1 keys, twice
    return total + 2 * config.vocab_size * config.hidden_size * head_positions
