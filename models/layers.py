"""The Flax layers every family shares: RMSNorm, the Dense projection, the gated MLP, rotate-half RoPE and
the untied LM head, with the logical axis names their parameters are sharded by. Each takes the family's
config (`models.base.DecoderConfig`) and reads the fields it needs; module names come from `config.NAMES`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def param_init(config: Any, names: tuple[str | None, ...], init=None):
    """A parameter initializer (normal(initializer_range) by default) boxed with its logical axis names."""
    init = nn.initializers.normal(config.initializer_range) if init is None else init
    return nn.with_logical_partitioning(init, names)


def logical_axis_rules(fsdp: bool = True, tensor: bool = False) -> tuple[tuple[str, Any], ...]:
    """Rules mapping the logical axes of the params (and "batch") onto mesh axes `data`/`fsdp`/`tensor`.

    fsdp: shard the `embed` dimension of every weight over `fsdp` (and the batch over data x fsdp);
    tensor: shard `vocab`, `mlp`, `heads`, `kv_heads` over `tensor`. Use with
    `nn.logical_to_mesh_sharding(models.family.logical_param_specs(config), mesh, rules)`.
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


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32: `scale * (x / rms(x)).astype(x.dtype)` (no +1 offset;
    epsilon `config.norm_eps`)."""

    config: Any
    logical_axis: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", param_init(self.config, (self.logical_axis,), nn.initializers.ones),
                           (x.shape[-1],), self.config.jnp_param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.norm_eps)
        return jnp.asarray(scale, x.dtype) * xf.astype(x.dtype)


def dense(config: Any, features: int, names: tuple[str, str], name: str, bias: bool = False):
    """A Dense projection [..., in] -> [..., features], run on the rows flattened to 2-D: [N, in] @ [in, out].

    The flattening is free (a bitcast) and leaves the parameters and values as they were, but the
    backward's weight gradient is then one plain [in, N] @ [N, out] product instead of a contraction over
    two batch axes, which XLA:CPU lays out with extra transposes (the CPU preset's every-row GRPO update:
    2.58 -> 2.15 s in `experiments/benchmarks/train_throughput.py`, results/train_throughput*.log).
    """
    layer = nn.Dense(features, use_bias=bias, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
                     kernel_init=param_init(config, names),
                     bias_init=param_init(config, (names[1],), nn.initializers.zeros), name=name)

    def project(x: jax.Array) -> jax.Array:
        return layer(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (features,))

    return project


class GatedMLP(nn.Module):
    """SwiGLU: `down(silu(gate x) * up x)`; x [B, T, D] -> [B, T, D], hidden width `config.ff_dim`; the three
    projections are named by `config.NAMES` (LFM2: w1, w3, w2; Qwen3: gate_proj, up_proj, down_proj)."""

    config: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, names = self.config, self.config.NAMES
        gate = dense(cfg, cfg.ff_dim, ("embed", "mlp"), names.gate)(x)
        up = dense(cfg, cfg.ff_dim, ("embed", "mlp"), names.up)(x)
        return dense(cfg, cfg.hidden_size, ("mlp", "embed"), names.down)(nn.silu(gate) * up)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, hd], positions int32[B, T]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))  # float32 like torch
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, hd/2]
    cos = jnp.cos(freqs).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(freqs).astype(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LMHead(nn.Module):
    """Untied output projection: x [B, T, D] -> float32 logits [B, T, V] (param `kernel` [D, V])."""

    config: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kernel = self.param("kernel", param_init(cfg, ("embed", "vocab")), (cfg.hidden_size, cfg.vocab_size),
                            cfg.jnp_param_dtype)
        return jnp.einsum("btd,dv->btv", x, jnp.asarray(kernel, cfg.jnp_dtype), preferred_element_type=jnp.float32)
