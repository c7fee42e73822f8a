"""The rollout's turn-loop state (`Carry`: the conversation buffer, per-game flags, the per-turn log) and
the row-wise writes into it. `rollout.py` plays the turns; this module only holds and fills the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp



class Buffer(NamedTuple):
    """The conversation of every game: tokens int32[B, L], loss_mask / logprobs / decision float32[B, L],
    choice_set int8[B, L], cursor int32[B]."""

    tokens: jax.Array
    loss_mask: jax.Array
    logprobs: jax.Array
    cursor: jax.Array
    decision: jax.Array
    choice_set: jax.Array


class Flags(NamedTuple):
    """Per-game bools[B]: the last reply was cut without its end-of-turn token, the final message of a
    finished game is in the buffer, the game was cut by the context limit."""

    needs_end: jax.Array
    final_sent: jax.Array
    context_cut: jax.Array


class TurnLog(NamedTuple):
    """Per-game, per-turn facts [B, T]: reply lengths, format flags, truncation, parse kind and value; the
    reply's first position, the turn's reward, the key of the state it was played from, its legal
    choices [B, T, C]."""

    lengths: jax.Array
    format: jax.Array
    truncated: jax.Array
    kind: jax.Array
    value: jax.Array
    start: jax.Array
    reward: jax.Array
    key: jax.Array
    legal: jax.Array


class Carry(NamedTuple):
    """The state of the turn loop."""

    turn: jax.Array  # int32[]: turns played so far
    key: jax.Array
    state: Any  # the env's states [B]
    cache: Any  # the model cache (None for a scripted policy)
    buffer: Buffer
    flags: Flags
    log: TurnLog


def write_rows(buffer: jax.Array, start: jax.Array, values: jax.Array, lengths: jax.Array, fill) -> jax.Array:
    """Row-wise write of values[b, :lengths[b]] at buffer[b, start[b]:]: [B, L], [B], [B, W], [B] -> [B, L].

    Positions past each row's length get `fill`; writes past L are dropped.
    """
    width = values.shape[1]
    cols = jnp.arange(width, dtype=jnp.int32)
    values = jnp.where(cols[None, :] < lengths[:, None], values, jnp.asarray(fill, values.dtype))
    rows = jnp.arange(buffer.shape[0], dtype=jnp.int32)[:, None]
    return buffer.at[rows, start[:, None] + cols[None, :]].set(values, mode="drop")


def extend_buffer(buffer: Buffer, tokens: jax.Array, lengths: jax.Array, pad_id: int, sampled: bool,
            logprobs: jax.Array | None = None, reply=None, decision: jax.Array | None = None
            ) -> Buffer:
    """Appends tokens[b, :lengths[b]] to every game's conversation (loss mask 1 iff `sampled`; a reply's
    own `sampled` mask, when it has one, leaves its forced tokens out; `reply`: the policy's `Reply` or None);
    decision bool[B, N] or None."""
    shape = tokens.shape
    mask = jnp.ones(shape, jnp.float32) if sampled else jnp.zeros(shape, jnp.float32)
    if sampled and reply is not None and reply.sampled is not None:
        mask = reply.sampled.astype(jnp.float32)
    logprobs = jnp.zeros(shape, jnp.float32) if logprobs is None else logprobs
    decision = jnp.zeros(shape, jnp.float32) if decision is None else decision.astype(jnp.float32)
    choice_set = jnp.full(shape, -1, jnp.int8)
    if reply is not None and reply.choice_set is not None:
        choice_set = reply.choice_set.astype(jnp.int8)
    return Buffer(
        tokens=write_rows(buffer.tokens, buffer.cursor, tokens, lengths, pad_id),
        loss_mask=write_rows(buffer.loss_mask, buffer.cursor, mask, lengths, 0.0),
        logprobs=write_rows(buffer.logprobs, buffer.cursor, logprobs, lengths, 0.0),
        cursor=buffer.cursor + lengths,
        decision=write_rows(buffer.decision, buffer.cursor, decision, lengths, 0.0),
        choice_set=write_rows(buffer.choice_set, buffer.cursor, choice_set, lengths, -1),
    )


def initial_carry(key: jax.Array, state, cache, prefix: jax.Array, pad_id: int, length: int, max_turns: int,
                  num_choices: int) -> Carry:
    """The carry before the first turn: every buffer holds the system prefix int32[P] then `pad_id` up to
    `length`; no flags set; an empty log of `max_turns` turns (kind -1: not played; C = num_choices)."""
    batch = jax.tree_util.tree_leaves(state)[0].shape[0]
    p0 = prefix.shape[0]
    no = jnp.zeros((batch,), bool)
    return Carry(
        turn=jnp.zeros((), jnp.int32),
        key=key,
        state=state,
        cache=cache,
        buffer=Buffer(tokens=jnp.full((batch, length), pad_id, jnp.int32).at[:, :p0].set(prefix[None, :]),
                      loss_mask=jnp.zeros((batch, length), jnp.float32),
                      logprobs=jnp.zeros((batch, length), jnp.float32),
                      cursor=jnp.full((batch,), p0, jnp.int32),
                      decision=jnp.zeros((batch, length), jnp.float32),
                      choice_set=jnp.full((batch, length), -1, jnp.int8)),
        flags=Flags(needs_end=no, final_sent=no, context_cut=no),
        log=TurnLog(lengths=jnp.zeros((batch, max_turns), jnp.int32), format=jnp.zeros((batch, max_turns), bool),
                    truncated=jnp.zeros((batch, max_turns), bool),
                    kind=jnp.full((batch, max_turns), -1, jnp.int8),
                    value=jnp.zeros((batch, max_turns), jnp.int32),
                    start=jnp.zeros((batch, max_turns), jnp.int32),
                    reward=jnp.zeros((batch, max_turns), jnp.float32),
                    key=jnp.zeros((batch, max_turns), jnp.uint32),
                    legal=jnp.zeros((batch, max_turns, num_choices), bool)),
    )


def where_rows(mask: jax.Array, new, old):
    """Per-row select over two pytrees of arrays with a leading batch axis."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), new, old)
