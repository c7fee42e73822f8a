"""Grouped-query attention with its decode cache, shared by every family: per-head RMSNorm on q and k, rotate-half
RoPE, causal softmax; a full causal forward, chunked prefill into the cache and single-token decode steps.

Multi-token attention runs as our batched matmuls ("ours", in groups of batch rows whose scores fit the CPU's
caches) or through `jax.nn.dot_product_attention` ("xla", "cudnn"): `config.attention`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.layers import RMSNorm, dense, rope

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


class Attention(nn.Module):
    """GQA with q/k RMSNorm and RoPE. x [B, T, D], positions int32[B, T] -> ([B, T, D], (K, V) or None).

    `config.head_dim` per head (LFM2: hidden / heads; Qwen3: its own, e.g. 128); the per-head norms and the
    output projection are named by `config.NAMES`; q/k/v/o carry biases when `config.attention_bias`.

    Without `kv` (full forward) keys are this call's tokens, causal by position. With `kv` = (K [B, KV, hd, S],
    V [B, KV, S, hd]) the T new keys/values of row b go to `positions[b]` (entries t >= num_valid[b] are
    dropped) and a query at position q attends to the cached keys at positions <= q. A decode step (T = 1)
    attends to the cache and to its own key before writing it, so XLA updates the cache in place.
    """

    config: Any

    @nn.compact
    def __call__(self, x, positions, num_valid, kv):
        cfg = self.config
        B, T, _ = x.shape
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        names, bias = cfg.NAMES, cfg.attention_bias
        q = dense(cfg, H * hd, ("embed", "heads"), "q_proj", bias)(x).reshape(B, T, H, hd)
        k = dense(cfg, KV * hd, ("embed", "kv_heads"), "k_proj", bias)(x).reshape(B, T, KV, hd)
        v = dense(cfg, KV * hd, ("embed", "kv_heads"), "v_proj", bias)(x).reshape(B, T, KV, hd)
        q = RMSNorm(cfg, "head_dim", name=names.q_norm)(q)
        k = RMSNorm(cfg, "head_dim", name=names.k_norm)(k)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        G = H // KV  # head h = kv * G + g, as transformers' repeat_kv
        # Queries as [B, KV, G*T, hd]: one (G*T, hd) block per row and kv head, so the contractions are
        # plain batched matmuls (a [B, T, KV, G, hd] operand made XLA:CPU transpose inside the dot).
        qq = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        # Cache layouts (see models.decoder.DecodeCache): keys [B, KV, hd, S], values [B, KV, S, hd]; both contractions then
        # reduce over a non-minor axis, which XLA:CPU vectorizes well (8-15x faster per decode step than
        # [B, S, KV, hd]). This call's own keys/values stay [B, T, KV, hd].
        chunk = (k, "bskd", v, "bskd", jnp.arange(T)[None, None, :] <= jnp.arange(T)[None, :, None])  # causal

        def project(out):  # [B, KV, G*T, hd] -> out_proj of [B, T, H*hd]
            out = out.reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H * hd)
            return dense(cfg, cfg.hidden_size, ("heads", "embed"), names.out, bias)(out)

        row_block = attention_rows(cfg.attention_row_block, B, KV * G * T * (T if kv is None else kv[0].shape[-1]))
        fused = attention_implementation(cfg.attention, cfg.dtype, hd, cached=kv is not None) if T > 1 else "ours"
        if kv is None:
            if fused != "ours":  # [B, T, H, hd], head h = kv * G + g as ours
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=fused)
                return dense(cfg, cfg.hidden_size, ("heads", "embed"), names.out, bias)(out.reshape(B, T, H * hd)), None
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
                out = dense(cfg, cfg.hidden_size, ("heads", "embed"), names.out, bias)(out.reshape(B, T, H * hd))
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
    """Which attention a multi-token call uses (`config.attention`): "ours", "xla" or "cudnn".

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
    """Batch rows per attention group (`config.attention_row_block`): a divisor of `batch`.

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
