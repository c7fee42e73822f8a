"""The decoder every family shares: the decode cache, the pre-norm residual layer and the causal LM around a
stack of them (embedding, layers, final norm, tied or untied head; a full forward and a cached call).

A family's module is `CausalLM` with its config: the layer types "full_attention" (`models.attention`) and,
for a family with other layers (LFM2's short convs), `OPERATORS` naming the module of each other type.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.attention import Attention
from models.base import ATTENTION
from models.layers import GatedMLP, LMHead, RMSNorm, param_init


class DecodeCache(NamedTuple):
    """Decode state for a batch of B rows (a pytree; donate it to jit).

    lengths: int32[B]                      tokens already in the cache per row
    keys: tuple over attention layers (in layer order) of [B, kv_heads, head_dim, max_len] (after k-norm
          and RoPE; time is the minor axis so the decode's q.k contraction vectorizes on CPU)
    values: tuple over attention layers of [B, kv_heads, max_len, head_dim]
    conv: tuple over the other layers (LFM2's short convs, in layer order) of their state, e.g.
          [B, conv_L_cache - 1, hidden]: the last K-1 inputs of the depthwise conv, oldest first; () for a
          family of attention layers only
    """

    lengths: jax.Array
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...] = ()

    @property
    def max_len(self) -> int:
        """Positions available per row (0 when the model has no attention layer)."""
        return self.values[0].shape[2] if self.values else 0


def kv_cache(config: Any, batch: int, max_len: int, dtype=None, states: tuple = ()) -> DecodeCache:
    """An empty cache: lengths 0, zero keys [batch, kv_heads, head_dim, max_len] and values
    [batch, kv_heads, max_len, head_dim] per attention layer, and the given `states` of the other layers;
    dtype defaults to `config.cache_dtype` (itself defaulting to the activation dtype `config.dtype`)."""
    dtype = config.jnp_cache_dtype if dtype is None else dtype
    k_shape = (batch, config.num_key_value_heads, config.head_dim, max_len)
    v_shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
    n_attn = len(config.attention_layers)
    return DecodeCache(lengths=jnp.zeros((batch,), jnp.int32),
                       keys=tuple(jnp.zeros(k_shape, dtype) for _ in range(n_attn)),
                       values=tuple(jnp.zeros(v_shape, dtype) for _ in range(n_attn)),
                       conv=tuple(states))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: `h = x + op(attention_norm(x))`; `h + mlp(mlp_norm(h))` (names: `config.NAMES`).

    op is `Attention` (kind "full_attention"; state: None or the (K, V) cache) or the family's `operator`,
    (module name, class) for another kind (LFM2's `ShortConv`; state: None in the full forward, else its
    cache entry). Returns (out [B, T, D], new state).
    """

    config: Any
    kind: str
    operator: Any = None

    @nn.compact
    def __call__(self, x, positions, num_valid, state):
        cfg, names = self.config, self.config.NAMES
        h = RMSNorm(cfg, name=names.attention_norm)(x)
        if self.kind == ATTENTION:
            h, state = Attention(cfg, name="self_attn")(h, positions, num_valid, state)
        else:
            name, module = self.operator
            h, state = module(cfg, name=name)(h, state, num_valid)
        h = x + h
        out = h + GatedMLP(cfg, name=names.mlp)(RMSNorm(cfg, name=names.mlp_norm)(h))
        return out, state


class CausalLM(nn.Module):
    """A decoder-only causal LM of a family: `embed_tokens`, `layers_{i}` (`DecoderLayer` of
    `config.layer_types[i]`), the final norm (`config.NAMES.final_norm`), the LM head tied to the embedding
    unless `config.tie_word_embeddings` is false (`lm_head`). A family subclasses it and sets `OPERATORS`
    {layer type: (module name, class)} for its layers other than attention.

    `init` returns plain arrays (no logical-axis boxes); get the partitioning from
    `models.family.logical_param_specs`.
    """

    config: Any
    remat: bool | None = None  # overrides config.remat when set
    OPERATORS = {}  # (a class attribute, not a field)

    @nn.nowrap
    def init(self, rngs, *args, **kwargs):
        """`flax.linen.Module.init`, with the `nn.Partitioned` boxes removed (plain arrays)."""
        return nn.meta.unbox(super().init(rngs, *args, **kwargs))

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: DecodeCache | None = None,
                 num_valid: jax.Array | None = None, last_only: bool = False,
                 logit_positions: jax.Array | None = None) -> tuple[jax.Array, DecodeCache | None]:
        """tokens int32[B, T] -> (logits float32[B, T, V], new cache or None).

        cache None: full causal forward over positions 0..T-1 (num_valid ignored).
        cache given: row b's tokens go to positions lengths[b]..lengths[b]+T-1; only the first num_valid[b]
        (int32[B], default T) are real, advance the cache (`lengths += num_valid`, a conv state = its last
        K-1 real inputs) and are attended to; logits at padded slots are garbage. Needs lengths + num_valid
        <= max_len.
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
                         embedding_init=param_init(cfg, ("vocab", "embed")), name="embed_tokens")
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
        keys, values, states = [], [], []
        for i, kind in enumerate(cfg.layer_types):
            attn = kind == ATTENTION
            if cache is None:
                state = None
            elif attn:
                state = (cache.keys[len(keys)], cache.values[len(keys)])
            else:
                state = cache.conv[len(states)]
            operator = None if attn else self.OPERATORS[kind]
            x, state = layer_cls(cfg, kind, operator, name=f"layers_{i}")(x, positions, num_valid, state)
            if cache is not None:
                if attn:
                    keys.append(state[0])
                    values.append(state[1])
                else:
                    states.append(state)
        if last_only and T > 1:  # (with T = 1 the logits are that position's already: no extra op)
            last = jnp.full((B,), T - 1, jnp.int32) if num_valid is None else jnp.clip(num_valid - 1, 0, T - 1)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
        elif logit_positions is not None:
            if cache is not None:
                raise ValueError("logit_positions is for the full forward (cache None)")
            x = jnp.take_along_axis(x, jnp.asarray(logit_positions, jnp.int32)[..., None], axis=1)  # [B, K, D]
        x = RMSNorm(cfg, name=cfg.NAMES.final_norm)(x)
        if cfg.tie_word_embeddings:
            w = jnp.asarray(embed.embedding, cfg.jnp_dtype)  # [V, D]
            logits = jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)
        else:
            logits = LMHead(cfg, name="lm_head")(x)
        new_cache = None
        if cache is not None:
            new_cache = DecodeCache(cache.lengths + num_valid, tuple(keys), tuple(values), tuple(states))
        return logits.astype(jnp.float32), new_cache


def count_params(params: Any) -> int:
    """Total number of parameters in a pytree (arrays or ShapeDtypeStructs)."""
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
