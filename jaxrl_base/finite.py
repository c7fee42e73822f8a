"""Which arrays of a pytree hold NaN or infinite values: the one check behind "non-finite values are refused
where they enter" (weights loaded from a checkpoint or a Hugging Face folder, weights about to be saved or
exported, an env's rewards and metrics).

The counts are reduced where the arrays live (one small device -> host copy per floating leaf), so a large
model is never copied to the host whole. Integer, boolean and key leaves are finite by construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["non_finite", "flat_names", "describe_non_finite"]


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    try:
        dt = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) hold no float
        return False
    return dt.kind in "fc" or "float" in dt.name  # ml_dtypes' bfloat16 and float8 types are of kind "V"


def _host_counts(x: Any) -> tuple[int, int]:
    """(NaN count, infinite count) of a host array."""
    a = np.asarray(x)
    if a.dtype.kind not in "fc":
        a = a.astype(np.float32)
    return int(np.isnan(a).sum()), int(np.isinf(a).sum())


def non_finite(named: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """{name: (NaN count, infinite count, size)} of the floating arrays in `named` ({name: array}) that are
    not all finite, in the order given. Device arrays are reduced on their devices and fetched together (one
    transfer of two counts per array)."""
    floating = {name: x for name, x in named.items() if x is not None and _floating(x)}
    on_device = {name: x for name, x in floating.items() if type(x).__module__.startswith(("jax", "jaxlib"))}
    counts: dict[str, tuple[int, int]] = {}
    if on_device:
        import jax  # lazy: the envs' checks run on host values too
        import jax.numpy as jnp

        # Values being traced (a loader called inside jit) have no numbers yet: they are checked where concrete.
        on_device = {name: x for name, x in on_device.items() if not isinstance(x, jax.core.Tracer)}
        floating = {name: x for name, x in floating.items() if not isinstance(x, jax.core.Tracer)}
        pending = {name: (jnp.isnan(x).sum(), jnp.isinf(x).sum()) for name, x in on_device.items()}
        counts = {name: (int(a), int(b)) for name, (a, b) in jax.device_get(pending).items()}
    out = {}
    for name, x in floating.items():
        nan, inf = counts[name] if name in counts else _host_counts(x)
        if nan or inf:
            out[name] = (nan, inf, int(np.prod(np.shape(x))))
    return out


def flat_names(tree: Any) -> dict[str, Any]:
    """A pytree's leaves by their "/"-joined key path, e.g. {"params/layers_0/q_proj/kernel": array}."""
    import jax  # lazy: only pytrees need it

    def key(entry: Any) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                return str(getattr(entry, attr))
        return str(entry)

    return {"/".join(key(e) for e in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def describe_non_finite(bad: dict[str, tuple[int, int, int]], limit: int = 3) -> str:
    """The first `limit` entries of `non_finite`'s result as text: "'a' (4 NaN of 16), 'b' (1 inf of 8) and 2
    more"."""
    def one(name: str, counts: tuple[int, int, int]) -> str:
        nan, inf, size = counts
        what = " and ".join(t for t in (f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else "") if t)
        return f"{name!r} ({what} of {size})"

    shown = ", ".join(one(n, c) for n, c in list(bad.items())[:limit])
    return shown + (f" and {len(bad) - limit} more" if len(bad) > limit else "")
