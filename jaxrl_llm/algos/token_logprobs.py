"""Per-token log-probs for the GRPO update: of whole sequences, and of "slots" (the loss positions gathered
before the LM head), with the constrained replies' logit restriction.

Moved out of `algos.grpo` (which re-exports the public names); a position t holds log p(tokens[t]) under
the logits at t - 1, aligned with `Trajectory.logprobs`. A row's K slots (`slot_layout`) are its loss
positions with `GrpoConfig.logits_at_loss_only`, or all its positions (K = L) without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxrl_llm.generate.sampler import restrict_logits

if TYPE_CHECKING:  # lazy: import cycle with algos.grpo (type hints only)
    from jaxrl_llm.algos.grpo_config import GrpoConfig


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-prob of each token under the previous position's logits: float32[B, L, V], int32[B, L] -> float32[B, L].

    out[:, t] = log_softmax(logits[:, t - 1])[tokens[:, t]] for t >= 1 and out[:, 0] = 0, aligned with
    `Trajectory.logprobs` (the logits at the last position predict nothing and are unused).
    """
    logits = logits[:, :-1].astype(jnp.float32)
    target = tokens[:, 1:].astype(jnp.int32)
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the distribution each token was drawn from: float32[B, L, V] -> float32[B, L].

    out[:, t] = H(softmax(logits[:, t - 1])) for t >= 1 and out[:, 0] = 0 (aligned like `token_logprobs`).
    """
    return jnp.pad(logits_entropy(logits[:, :-1].astype(jnp.float32)), ((0, 0), (1, 0)))


def policy_logprobs(module, params, tokens: jax.Array, temperature: float = 1.0, with_entropy: bool = False):
    """Full forward, then per-token log-probs (and entropies): int32[B, L] -> float32[B, L] (, float32[B, L]).

    The logits are divided by `temperature` first. The entropy is None unless `with_entropy`.
    """
    logits, _ = module.apply({"params": params}, tokens)
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, tokens)
    return logp, (token_entropy(logits) if with_entropy else None)


def loss_slots(loss_mask: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """Where each row's loss tokens are: float32[B, L], K -> (positions int32[B, K], valid bool[B, K]).

    Slot k of row b holds the k-th loss position of the row (ascending); slots past the row's count are
    invalid (position 0). A row's loss tokens past the K-th are in no slot.
    """
    on = loss_mask > 0
    order = jnp.argsort(~on, axis=1, stable=True)[:, :slots].astype(jnp.int32)
    valid = jnp.take_along_axis(on, order, axis=1)
    return jnp.where(valid, order, 0), valid


def slot_logits(module, params, tokens: jax.Array, positions: jax.Array | None, temperature: float = 1.0):
    """The logits each slot's token was drawn from, divided by `temperature`: float32[R, K, V].

    positions int32[R, K] (token positions, >= 1 where used): the model's logits at positions - 1 only,
    the final hidden states gathered before the LM head (`logit_positions`). None: the slots are the
    positions 0 .. T-1 of tokens int32[R, T] (K = T; the full logits shifted by one, slot 0 zeros since
    nothing predicts the first token).
    """
    if positions is not None:
        logits, _ = module.apply({"params": params}, tokens, logit_positions=jnp.maximum(positions - 1, 0))
    else:
        logits, _ = module.apply({"params": params}, tokens)
        logits = jnp.pad(logits[:, :-1], ((0, 0), (1, 0), (0, 0)))
    logits = logits.astype(jnp.float32)
    return logits / temperature if temperature != 1.0 else logits


def picked_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[target]: float32[R, K, V], int32[R, K] -> float32[R, K]."""
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def logits_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis: float32[..., V] -> float32[...].

    Logits of -inf (a token outside a constrained reply's allowed set) count 0, and so does their gradient:
    the log-prob is replaced by 0 where it is not finite before the product (p * log p with p = 0 and
    log p = -inf would be NaN, and a `where` after it still lets that NaN into the gradient)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1)


def slot_layout(config: GrpoConfig, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """The update's per-token layout, K slots a row: float32[B, L] -> (positions int32[B, K], valid bool[B, K], K).

    With logits_at_loss_only the slots are the loss positions (`loss_slots`; K = max_completion_tokens
    rounded up to 8, at most L, or L when it is unset); else the positions themselves (K = L; positions unused).
    """
    batch, length = loss_mask.shape
    if not config.logits_at_loss_only:
        return jnp.zeros((batch, length), jnp.int32), loss_mask > 0, length
    bound = config.max_completion_tokens or length
    slots = min(length, -(-bound // 8) * 8)
    positions, valid = loss_slots(loss_mask, slots)
    return positions, valid, slots


def at_slots(config: GrpoConfig, positions: jax.Array, x: jax.Array) -> jax.Array:
    """The values at the slots of `slot_layout`: [B, L, ...] -> [B, K, ...] (x itself when K = L)."""
    if not config.logits_at_loss_only:
        return x
    return jnp.take_along_axis(x, positions.reshape(positions.shape + (1,) * (x.ndim - 2)), axis=1)


def slot_forward(module, config: GrpoConfig, temperature: float, choice_sets, policy, tokens, positions, kb: int,
                 cset=None):
    """The logits of rows' first kb slots, divided by the sampler's `temperature`: tokens int32[R, lb] (cut to
    their bucket), positions int32[R, K] -> float32[R, kb, V]. policy: the params `module.apply` takes (with
    LoRA, joined); cset int8[R, kb]: the slots' allowed sets (the logits restricted to them, as the
    sampler's; after the temperature is the same)."""
    logits = slot_logits(module, policy, tokens, positions[:, :kb] if config.logits_at_loss_only else None,
                         temperature)
    return restrict_logits(logits, cset, choice_sets) if cset is not None else logits


def forward_inputs(data: dict) -> dict:
    """What a no-gradient forward of the update's rows reads: tokens, pos, target (and cset)."""
    return {k: data[k] for k in ("tokens", "pos", "target", "cset") if k in data}


def slot_logprobs(module, config: GrpoConfig, temperature: float, slots: int, choice_sets, policy, bucket: int,
                  chunk: dict) -> tuple:
    """The log-probs of a chunk's slot tokens at a bucket length (logits divided by `temperature`), padded to
    K slots: (float32[R, K],) (the `update.bucketed_map` fn; chunk: `forward_inputs` of R rows)."""
    kb = min(slots, bucket)
    cset = chunk["cset"][:, :kb] if "cset" in chunk else None
    logits = slot_forward(module, config, temperature, choice_sets, policy, chunk["tokens"][:, :bucket], chunk["pos"],
                          kb, cset)
    return (jnp.pad(picked_logprobs(logits, chunk["target"][:, :kb]), ((0, 0), (0, slots - kb))),)
