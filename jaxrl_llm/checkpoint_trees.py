"""The pytree side of checkpoints (`jaxrl_llm.checkpoint`): leaf paths, PRNG keys stored as their uint32 data,
abstract targets with a placement, and Orbax's metadata tree as ShapeDtypeStructs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_llm import distributed


def _key_str(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_str(path: tuple) -> str:
    return "/".join(_key_str(e) for e in path)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    """Typed PRNG key leaves -> their raw uint32 key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """An array or ShapeDtypeStruct -> ShapeDtypeStruct (key leaves as their uint32 data)."""
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=distributed.default_sharding())
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = distributed.default_sharding()  # multi-host: replicated, not on process 0's first device
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _flatten_metadata(tree: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Orbax's metadata tree (nested dicts / lists, None for empty nodes) -> {"a/0/b": ArrayMetadata}."""
    if tree is None:
        return {}
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {"/".join(prefix): tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten_metadata(v, (*prefix, str(k))))
    return out


def _unflatten_metadata(tree: Any) -> Any:
    """Orbax's metadata tree -> the same tree of ShapeDtypeStructs on the first device (None nodes kept)."""
    device = distributed.default_sharding()
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        return {k: _unflatten_metadata(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_unflatten_metadata(v) for v in tree]
    return jax.ShapeDtypeStruct(tuple(tree.shape), tree.dtype, sharding=device)


def _wrap_keys(restored: Any, target: Any) -> Any:
    """Key-typed target leaves: wrap the restored uint32 data as keys of the same implementation."""
    def wrap(t, r):
        if _is_key(t):
            impl = jax.random.key_impl(t) if isinstance(t, jax.Array) else t.dtype._impl
            return jax.random.wrap_key_data(r, impl=impl)
        return r

    return jax.tree.map(wrap, target, restored)
