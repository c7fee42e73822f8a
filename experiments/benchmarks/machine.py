"""The machine facts CPU benchmarks depend on, and the float32 matmul peak through JAX, measured in the run.

`machine_facts()` -> dict: CPU model, logical CPUs (and those this process may use), per-level cache sizes
(from /sys/devices/system/cpu/cpu0/cache, None where unreadable), the attention score block the model
derives from them (`models.attention.ATTENTION_BLOCK_BYTES`), jax version and backend. `describe(facts)` is
one printable line.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> dict:
    from models.attention import ATTENTION_BLOCK_BYTES, cpu_cache_bytes

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "l1d_bytes": cpu_cache_bytes(1),
        "l2_bytes": cpu_cache_bytes(2),
        "l3_bytes": cpu_cache_bytes(3),
        "attention_block_bytes": ATTENTION_BLOCK_BYTES,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }


def describe(facts: dict) -> str:
    mib = lambda b: "?" if b is None else f"{b / 2**20:g} MiB"  # noqa: E731
    return (f"# {facts['cpu']}, {facts['cpus']} CPUs ({facts['cpus_usable']} usable), caches per core L1d "
            f"{mib(facts['l1d_bytes'])} / L2 {mib(facts['l2_bytes'])}, L3 {mib(facts['l3_bytes'])}; attention "
            f"score block {mib(facts['attention_block_bytes'])}; jax {facts['jax']} ({facts['backend']})")


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best float32 [size, size] @ [size, size] FLOP/s through JAX on this machine (best of `repeats`)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def best_seconds(fn, repeats: int, warmup: bool = True) -> float:
    """Best wall time of `fn()` (blocked until its arrays are ready) over `repeats` calls, after one
    untimed call when `warmup` (the compile)."""
    if warmup:
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best
