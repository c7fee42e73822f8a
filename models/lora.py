"""LoRA for every family of the seam: low-rank adapters on the Dense projections, kept in a pytree of their own.

A targeted projection `y = x W` (W [in, out], Flax layout) becomes

    y = x W + (alpha / rank) * dropout(x) A B        A [in, rank] ~ U(-1/sqrt(in), 1/sqrt(in)), B [rank, out] = 0

so a fresh adapter changes nothing (B = 0) and only A, B are trained. The base model code is not touched:
`LoraModel.apply` runs the family's module `apply` with a `flax.linen.intercept_methods` interceptor that
adds the low-rank term to the output of each targeted Dense call (found by its module path), so the full
forward, the cached prefill / decode and rematerialization all see the adapters.

Trees (plain dicts):

    adapters  {"layers_0": {"self_attn": {"q_proj": {"lora_a": [D, r], "lora_b": [r, H*hd]}, ...}}, ...}   float32
    policy    {"base": <model params>, "lora": adapters}  (+ "dropout_key": uint32[2] while training)
              -- `join`; what `LoraModel.apply` takes. A plain base tree there means "adapters off".

`merge` folds the adapters into the base (`W + (alpha / rank) A B`): a plain params tree with the same
logits, which `models.hf.save_hf` exports.

Target names (`LoraConfig.targets`) are each family's (`ModelFamily.lora_targets`, through the seam's
`models.family.LORA_TARGETS`): attention q_proj, k_proj, v_proj, o_proj (LFM2's `self_attn.out_proj`); LFM2's
MLP w1, w2, w3 and short-conv conv_in, conv_out; Qwen3's MLP gate_proj, up_proj, down_proj; and the groups
"attention", "mlp", "conv" (LFM2), "all". A name the model lacks is refused when the model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_base.checks import ConfigError, check_float, check_int
from models.family import LORA_GROUPS, LORA_TARGETS

# Every family's target names -> the (operator module, Dense module) paths inside a layer `layers_{i}` that they
# name in some family, and the groups (the seam's union of the families' tables)
TARGETS: dict[str, tuple[tuple[str, str], ...]] = LORA_TARGETS
GROUPS: dict[str, tuple[str, ...]] = LORA_GROUPS
A, B = "lora_a", "lora_b"
BASE, LORA, DROPOUT_KEY = "base", "lora", "dropout_key"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (the `[lora]` table). rank 0 (the default) trains the full model, without adapters.

    rank: r, the adapters' inner width (>= 1 turns LoRA on); alpha: the adapters' output is scaled by
    alpha / rank; dropout: in [0, 1), dropout on each adapter's input while training (sampling and the
    reference never drop); targets: names of `TARGETS` and/or `GROUPS` (default: every projection).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention", "mlp", "conv")

    def __post_init__(self):
        check_int(self, "rank", 0)
        check_float(self, "alpha", low=0.0, low_open=True)
        check_float(self, "dropout", 0.0, 1.0, high_open=True)
        if isinstance(self.targets, str) or not isinstance(self.targets, (list, tuple)):
            raise ConfigError(f"must be an array of names, got {self.targets!r}", ("targets",), "LoraConfig")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ConfigError(f"must name at least one projection (e.g. {list(GROUPS)})", ("targets",), "LoraConfig")
        names = [*TARGETS, *GROUPS]
        for i, name in enumerate(self.targets):
            if name not in names:
                close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown target {name!r}{hint} (targets: {', '.join(names)})", ("targets", i),
                                  "LoraConfig")
        if self.rank == 0:  # LoRA off: settings of the adapters would be silently ignored
            default = LoraConfig.__dataclass_fields__
            changed = [k for k in ("targets", "dropout") if getattr(self, k) != default[k].default]
            if changed:
                raise ConfigError(f"lora.{changed[0]} is set but lora.rank is 0, which trains the full model without "
                                  f"adapters: set lora.rank >= 1 (e.g. 8) to train LoRA adapters, or remove "
                                  f"lora.{changed[0]}", ("rank",), "LoraConfig")

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (rank >= 1)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the adapters' output."""
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        """The target names with the groups expanded, in `TARGETS` order, each once."""
        chosen = {t for name in self.targets for t in GROUPS.get(name, (name,))}
        return tuple(t for t in TARGETS if t in chosen)


# --------------------------------------------------------------------------------------------------
# Adapter trees
# --------------------------------------------------------------------------------------------------


def adapter_paths(config: LoraConfig, base: Any) -> list[tuple[str, ...]]:
    """Module paths (e.g. ("layers_1", "self_attn", "q_proj")) of the base's Dense layers that get an
    adapter, in layer order. base: the model's params (arrays or ShapeDtypeStructs). ValueError when a
    named target exists in no layer of the model (e.g. "conv_in" on a model without conv layers, "w1" on
    Qwen3, whose MLP is gate_proj / up_proj / down_proj)."""
    layers = sorted((k for k in base if k.startswith("layers_")), key=lambda k: int(k[len("layers_"):]))
    paths, used = [], set()
    for layer in layers:
        for name in config.modules:
            for op, dense in TARGETS[name]:
                if op in base[layer] and dense in base[layer][op]:
                    paths.append((layer, op, dense))
                    used.add(name)
    unused = [n for n in config.targets if n in TARGETS and n not in used]  # (a group may match partly)
    if unused:
        raise ValueError(f"lora.targets {unused} match no layer of this model: remove them")
    if not paths:
        raise ValueError(f"lora.targets {list(config.targets)} match no layer of this model")
    return paths


def check_rank(config: LoraConfig, base: Any) -> None:
    """ValueError when `config.rank` is above the smaller side of a targeted projection (its input or output
    width): such an adapter is no low-rank update and costs more than the weight. base: the model's params
    (arrays or ShapeDtypeStructs)."""
    for path in adapter_paths(config, base):
        d_in, d_out = _get(base, path)["kernel"].shape
        if config.rank > min(d_in, d_out):
            raise ValueError(f"lora.rank {config.rank} is above the width of {'/'.join(path)} ({d_in} x {d_out}): "
                             f"use a rank <= {min(d_in, d_out)} (typically 4-64)")


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def init_adapters(config: LoraConfig, base: Any, key: jax.Array) -> dict:
    """Fresh adapters for `base` (only its shapes are read): per target A float32[in, r] ~ U(+-1/sqrt(in))
    (PEFT's default), B float32[r, out] = 0. Traceable (`jax.eval_shape` gives the checkpoint target)."""
    if not config.enabled:
        raise ValueError("init_adapters needs LoraConfig.rank >= 1")
    adapters: dict = {}
    for i, path in enumerate(adapter_paths(config, base)):
        d_in, d_out = _get(base, path)["kernel"].shape
        bound = 1.0 / d_in ** 0.5
        a = jax.random.uniform(jax.random.fold_in(key, i), (d_in, config.rank), jnp.float32, -bound, bound)
        _set(adapters, path, {A: a, B: jnp.zeros((config.rank, d_out), jnp.float32)})
    return adapters


def flat_adapters(adapters: Any) -> dict[tuple[str, ...], dict]:
    """{module path: {"lora_a", "lora_b"}} of an adapter tree."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict) and A in node and B in node:
            out[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))

    walk(adapters, ())
    return out


def join(base: Any, adapters: Any, dropout_key: jax.Array | None = None) -> dict:
    """The policy params `LoraModel.apply` takes: the frozen base with its adapters (and, while training with
    dropout, the key of this forward's dropout masks). No array is copied."""
    out = {BASE: base, LORA: adapters}
    if dropout_key is not None:
        out[DROPOUT_KEY] = dropout_key
    return out


def is_joined(params: Any) -> bool:
    """Whether `params` is a `join` tree (else a plain params tree)."""
    return isinstance(params, dict) and BASE in params and LORA in params


def merge(config: LoraConfig, params: Any) -> Any:
    """A plain params tree with the adapters folded in: kernel + (alpha / rank) A B (in float32,
    stored in the kernel's dtype). A plain tree is returned as it is. Its logits equal the adapted model's."""
    if not is_joined(params):
        return params
    base, adapters = params[BASE], params[LORA]
    merged = jax.tree_util.tree_map(lambda x: x, base)  # new containers, the same arrays
    for path, ab in flat_adapters(adapters).items():
        node = _get(merged, path)
        kernel = node["kernel"]
        delta = config.scale * (jnp.asarray(ab[A], jnp.float32) @ jnp.asarray(ab[B], jnp.float32))
        node["kernel"] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
    return merged


# --------------------------------------------------------------------------------------------------
# The adapted model
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoraModel:
    """A family's causal LM with LoRA adapters: the same `apply` / `init` interface (so samplers, losses and
    evaluation use it unchanged), hashable (a static jit argument).

    `apply({"params": join(base, adapters[, dropout_key])}, tokens, cache, num_valid, last_only)` runs the
    base with the adapters; `apply({"params": base}, ...)` runs the base alone (adapters off: the KL
    reference). `init` returns the base's params (the adapters come from `init_adapters`).
    """

    module: Any  # the family's Flax module (`models.family.module_of(config)`)
    lora: LoraConfig

    @property
    def config(self):
        """The base model's config."""
        return self.module.config

    def init(self, rngs, *args, **kwargs):
        return self.module.init(rngs, *args, **kwargs)

    def apply(self, variables, *args, **kwargs):
        params = variables["params"]
        if not is_joined(params):
            return self.module.apply({**variables, "params": params}, *args, **kwargs)
        adapters = flat_adapters(params[LORA])
        dropout_key = params.get(DROPOUT_KEY) if self.lora.dropout > 0 else None
        order = {path: i for i, path in enumerate(adapters)}
        applied: set = set()
        scale, rate = self.lora.scale, self.lora.dropout

        def interceptor(next_fun, args_, kwargs_, context):
            path = tuple(context.module.path)
            out = next_fun(*args_, **kwargs_)
            if context.method_name != "__call__" or path not in adapters:
                return out
            applied.add(path)
            x = args_[0]
            if dropout_key is not None:
                keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, order[path]), 1.0 - rate, x.shape)
                x = jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)
            ab = adapters[path]
            low = jnp.dot(x, jnp.asarray(ab[A], x.dtype))
            delta = jnp.dot(low, jnp.asarray(ab[B], x.dtype)) * jnp.asarray(scale, x.dtype)
            return out + delta.astype(out.dtype)

        with nn.intercept_methods(interceptor):
            result = self.module.apply({**variables, "params": params[BASE]}, *args, **kwargs)
        missing = sorted(set(adapters) - applied)
        if missing:  # the model no longer calls a module the adapters were made for: never a silent no-op
            raise RuntimeError(f"LoRA adapters {['/'.join(p) for p in missing[:3]]} were not applied: the model has "
                               "no such Dense call; the adapter tree does not fit this model")
        return result
