"""Multi-turn rollouts: a language model plays whole Tic-Tac-Toe games as text inside one `jit`.

One turn, for every game of the batch at once:
  1. render the environment's message for the game's state as tokens (`text.render_user_turn`) and
     append it to the conversation buffer and, through one chunked prefill at each game's own offset,
     to the model cache;
  2. decode the reply with the sampler, continuing that cache (`sampling.decode`);
  3. turn the reply's tokens into bytes, parse the move and the format flag (`text.parse_reply`);
  4. step the game (`envs.tictactoe.step`: the move or an invalid one, then the opponent's reply).
Games that are over stop generating; the loop ends when every game is done or at `max_turns`. A game
that would not fit its next message and a full reply into the context is cut there (`context_cut`,
outcome UNFINISHED). A finished game's last message (`You win!`, ...) is appended too, so the buffer
is the whole conversation, exactly as the tokenizer's chat template writes it.

Invariant: for every game, the cache holds exactly the buffer's tokens `tokens[b, :length[b]]`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs import tictactoe as ttt
from jaxrl_llm import sampling, text


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits and sampling of a rollout (static under jit).

    context_length: positions of the conversation buffer and of the model cache per game.
    sampling: how each reply is sampled; its `max_new_tokens` is the per-turn limit. Its stop token must
        be the tokenizer's end of turn (`<|im_end|>`), which `rollout` adds if missing.
    env: the environment's limits and reward weights (`max_turns` counts the model's replies).
    cache_stages: the model cache grows with the conversation in this many steps. The turns are split
        into `cache_stages` runs; during a run the cache holds only the positions its last turn can
        reach at most (prefix + turns x (longest message + 1 + max_new_tokens), capped at
        context_length), so attention reads a cache sized to the conversation so far instead of the
        whole context. Each stage compiles its own copy of the turn loop; 1 keeps one full-size cache.
        The games, tokens and log-probs do not depend on it.
    """

    context_length: int = 1024
    sampling: sampling.SamplingConfig = sampling.SamplingConfig(max_new_tokens=64)
    env: ttt.EnvParams = ttt.EnvParams()
    cache_stages: int = 1

    def __post_init__(self):
        if self.context_length < 16:
            raise ValueError(f"RolloutConfig.context_length must be >= 16 (got {self.context_length})")
        if not isinstance(self.cache_stages, int) or self.cache_stages < 1:
            raise ValueError(f"RolloutConfig.cache_stages must be an integer >= 1 (got {self.cache_stages!r})")


class Trajectory(NamedTuple):
    """A batch of B finished games (L = context_length, T = max_turns).

    tokens: int32[B, L] the conversation (prefix, messages, replies), pad_id after `length`.
    length: int32[B] tokens used.
    loss_mask: float32[B, L] 1 exactly on the model's sampled tokens (end-of-turn token included).
    logprobs: float32[B, L] the sampler's log-prob of each sampled token (0 elsewhere).
    reply_lengths: int32[B, T] tokens of each reply (0 for turns not played).
    reply_format: bool[B, T] each reply matched the format pattern.
    reply_moves: int32[B, T] the parsed move of each reply (-1 none, 9 not a cell; -2 turn not played).
    reply_truncated: bool[B, T] the reply hit max_new_tokens without an end-of-turn token.
    turns: int32[B] replies the model made.
    outcome: int8[B] envs.tictactoe.OUTCOME_*.
    invalid_moves, missing_moves: int32[B] replies with an invalid cell / without a move tag.
    format_score: float32[B] mean of reply_format over the replies made.
    win_reward, invalid_reward, format_reward, reward: float32[B] the rubric's parts (weighted) and total.
    context_cut: bool[B] the game was cut by the context limit.
    final_state: the environment state at the end.
    """

    tokens: jax.Array
    length: jax.Array
    loss_mask: jax.Array
    logprobs: jax.Array
    reply_lengths: jax.Array
    reply_format: jax.Array
    reply_moves: jax.Array
    reply_truncated: jax.Array
    turns: jax.Array
    outcome: jax.Array
    invalid_moves: jax.Array
    missing_moves: jax.Array
    format_score: jax.Array
    win_reward: jax.Array
    invalid_reward: jax.Array
    format_reward: jax.Array
    reward: jax.Array
    context_cut: jax.Array
    final_state: Any


class Reply(NamedTuple):
    """One turn's replies for the batch (N = max new tokens): what a policy returns."""

    tokens: jax.Array  # int32[B, N]
    lengths: jax.Array  # int32[B]
    ended: jax.Array  # bool[B] the reply ends with the end-of-turn token
    logprobs: jax.Array  # float32[B, N]
    cache: Any


# A policy turns (turn index, next-token logits [B, V] or None, cache, key, active[B]) into a Reply.
Policy = Callable[[jax.Array, Any, Any, jax.Array, jax.Array], Reply]


def model_policy(model_fn: sampling.ModelFn, params, config: sampling.SamplingConfig) -> Policy:
    """The language model as a policy: each reply sampled with `sampling.decode` from the cache."""

    def policy(turn, next_logits, cache, key, active):
        out = sampling.decode(model_fn, config, params, next_logits, cache, key, active)
        return Reply(out.tokens, out.lengths, out.done, out.logprobs, out.cache)

    return policy


def scripted_policy(reply_tokens: jax.Array, reply_lengths: jax.Array, eos_id: int) -> Policy:
    """Replies given in advance: reply_tokens int32[B, T, N], reply_lengths int32[B, T] (turn t's reply).

    For tests and demos without a model (the rollout then runs with `model_fn=None` and no cache).
    Build the arrays from text with `script_replies`.
    """
    reply_tokens = jnp.asarray(reply_tokens, jnp.int32)
    reply_lengths = jnp.asarray(reply_lengths, jnp.int32)

    def policy(turn, next_logits, cache, key, active):
        tokens = reply_tokens[:, turn]
        lengths = jnp.where(active, reply_lengths[:, turn], 0)
        last = jnp.take_along_axis(tokens, jnp.clip(lengths - 1, 0)[:, None], axis=1)[:, 0]
        ended = active & (lengths > 0) & (last == eos_id)
        return Reply(tokens, lengths, ended, jnp.zeros(tokens.shape, jnp.float32), cache)

    return policy


def script_replies(tokenizer, replies: Sequence[Sequence[str]], max_turns: int, max_new_tokens: int, end_turn: bool = True):
    """Host helper: reply texts per game and turn -> (int32[B, T, N] tokens, int32[B, T] lengths).

    Each reply is tokenized as the chat template would (`tokenizer.encode` without special tokens) and,
    with `end_turn`, closed by the end-of-turn token; replies longer than max_new_tokens are cut there
    (as the sampler would cut them, without the end-of-turn token).
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id or 0
    tokens = np.full((len(replies), max_turns, max_new_tokens), pad, np.int32)
    lengths = np.zeros((len(replies), max_turns), np.int32)
    for b, game in enumerate(replies):
        if len(game) > max_turns:
            raise ValueError(f"game {b} has {len(game)} scripted replies but max_turns is {max_turns}")
        for t, reply in enumerate(game):
            ids = tokenizer.encode(reply, add_special_tokens=False) + ([eos] if end_turn else [])
            ids = ids[:max_new_tokens]
            tokens[b, t, : len(ids)] = ids
            lengths[b, t] = len(ids)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def _write(buffer: jax.Array, start: jax.Array, values: jax.Array, lengths: jax.Array, fill) -> jax.Array:
    """Row-wise write of values[b, :lengths[b]] at buffer[b, start[b]:]: [B, L], [B], [B, W], [B] -> [B, L].

    Positions past each row's length get `fill`; writes past L are dropped.
    """
    width = values.shape[1]
    cols = jnp.arange(width, dtype=jnp.int32)
    values = jnp.where(cols[None, :] < lengths[:, None], values, jnp.asarray(fill, values.dtype))
    rows = jnp.arange(buffer.shape[0], dtype=jnp.int32)[:, None]
    return buffer.at[rows, start[:, None] + cols[None, :]].set(values, mode="drop")


class _Carry(NamedTuple):
    turn: jax.Array
    key: jax.Array
    state: ttt.State
    cache: Any
    tokens: jax.Array
    loss_mask: jax.Array
    logprobs: jax.Array
    cursor: jax.Array
    needs_end: jax.Array  # bool[B] the last reply was cut without its end-of-turn token
    final_sent: jax.Array  # bool[B] the final message of a finished game is in the buffer
    context_cut: jax.Array
    reply_lengths: jax.Array
    reply_format: jax.Array
    reply_moves: jax.Array
    reply_truncated: jax.Array


def cache_stage_plan(config: RolloutConfig, prefix_len: int, max_chunk: int) -> list[tuple[int, int]]:
    """Static (end turn, cache positions) of each cache stage, in order; the last holds context_length.

    A turn appends at most one chunk (`max_chunk` = longest message + 1) and one reply, so after turn t
    (counted from 1) a conversation holds at most prefix_len + t * (max_chunk + max_new_tokens) tokens.
    Stages that would not shrink the cache are merged into the next.
    """
    turns = config.env.max_turns
    per_turn = max_chunk + config.sampling.max_new_tokens
    n = min(config.cache_stages, turns)
    plan: list[tuple[int, int]] = []
    for s in range(n):
        end = -(-(s + 1) * turns // n)
        positions = config.context_length if s == n - 1 else min(config.context_length, prefix_len + end * per_turn)
        if plan and plan[-1][1] == positions:
            plan[-1] = (end, positions)
        elif not plan or plan[-1][0] < end:
            plan.append((end, positions))
    return plan


def grow_cache(cache, init_cache: Callable[[int, int], Any], batch: int, max_len: int):
    """The same cache with room for `max_len` positions: every leaf copied to the front of a new one."""
    bigger = init_cache(batch, max_len)

    def copy(new, old):
        if new.shape == old.shape:
            return old
        return jax.lax.dynamic_update_slice(new, old.astype(new.dtype), (0,) * new.ndim)

    return jax.tree_util.tree_map(copy, bigger, cache)


def _message_chunk(tables: text.TextTables, state: ttt.State, first, needs_end, send):
    """The next chunk per game: [`<|im_end|>` if the reply was cut] + the rendered user turn.

    Returns (tokens int32[B, max_msg + 1], lengths int32[B]); rows with `send = False` get length 0.
    """
    msg, msg_len = jax.vmap(text.render_user_turn, in_axes=(None, 0, 0, 0, None))(
        tables, state.board, state.status, state.last_opponent_move, first
    )
    width = msg.shape[1] + 1
    shift = needs_end.astype(jnp.int32)
    src = jnp.arange(width, dtype=jnp.int32)[None, :] - shift[:, None]
    chunk = jnp.take_along_axis(msg, jnp.clip(src, 0, msg.shape[1] - 1), axis=1)
    chunk = jnp.where(src < 0, tables.eos_id, chunk)
    chunk = jnp.where(src >= msg.shape[1], tables.pad_id, chunk)
    lengths = jnp.where(send, msg_len + shift, 0)
    return chunk, lengths


def rollout(
    policy: Policy,
    model_fn: sampling.ModelFn | None,
    params,
    init_cache: Callable[[int, int], Any] | None,
    tables: text.TextTables,
    seeds: jax.Array,
    random_move_prob: jax.Array,
    key: jax.Array,
    config: RolloutConfig,
    return_cache: bool = False,
):
    """Plays B games to the end (traceable; wrap it in `jax.jit`, or use `make_rollout`).

    policy: `model_policy(...)` or `scripted_policy(...)`; model_fn / params: the model's cached call
    (None for a scripted policy, which then runs without a model); init_cache(batch, max_len): a new
    cache; tables: the text tables of the tokenizer and prompt preset; seeds uint32[B] and
    random_move_prob float32[B]: the examples; key: sampling randomness.
    Returns the `Trajectory`, or `(Trajectory, cache)` with `return_cache` (the cache then holds
    exactly `tokens[b, :length[b]]` for every game).
    """
    batch = seeds.shape[0]
    length = config.context_length
    n_new = config.sampling.max_new_tokens
    env = config.env
    max_turns = env.max_turns
    state = jax.vmap(ttt.reset, in_axes=(0, 0, None))(seeds, random_move_prob, env)

    prefix = tables.prefix
    p0 = prefix.shape[0]
    if p0 + tables.max_msg + 1 + n_new > length:
        raise ValueError(
            f"context_length {length} cannot hold the system prefix ({p0} tokens), one message "
            f"({tables.max_msg}) and one reply ({n_new}); raise context_length to >= {p0 + tables.max_msg + 1 + n_new}"
        )
    tokens = jnp.full((batch, length), tables.pad_id, jnp.int32).at[:, :p0].set(prefix[None, :])
    stages = cache_stage_plan(config, p0, tables.max_msg + 1)
    cache = None
    if model_fn is not None:
        # The system prefix is the same for every game: prefill it once, broadcast its cache.
        one = init_cache(1, stages[0][1])
        _, one = model_fn(params, prefix[None, :], one, jnp.full((1,), p0, jnp.int32))
        cache = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (batch,) + x.shape[1:]), one)

    carry = _Carry(
        turn=jnp.zeros((), jnp.int32),
        key=key,
        state=state,
        cache=cache,
        tokens=tokens,
        loss_mask=jnp.zeros((batch, length), jnp.float32),
        logprobs=jnp.zeros((batch, length), jnp.float32),
        cursor=jnp.full((batch,), p0, jnp.int32),
        needs_end=jnp.zeros((batch,), bool),
        final_sent=jnp.zeros((batch,), bool),
        context_cut=jnp.zeros((batch,), bool),
        reply_lengths=jnp.zeros((batch, max_turns), jnp.int32),
        reply_format=jnp.zeros((batch, max_turns), bool),
        reply_moves=jnp.full((batch, max_turns), -2, jnp.int32),
        reply_truncated=jnp.zeros((batch, max_turns), bool),
    )

    def append(c: _Carry, chunk, chunk_len):
        """Writes the chunk into the buffer and the cache; returns (carry, next-token logits [B, V])."""
        tokens = _write(c.tokens, c.cursor, chunk, chunk_len, tables.pad_id)
        loss_mask = _write(c.loss_mask, c.cursor, jnp.zeros(chunk.shape, jnp.float32), chunk_len, 0.0)
        logprobs = _write(c.logprobs, c.cursor, jnp.zeros(chunk.shape, jnp.float32), chunk_len, 0.0)
        next_logits, cache = None, c.cache
        if model_fn is not None:
            logits, cache = model_fn(params, chunk, c.cache, chunk_len)
            next_logits = sampling.last_logits(logits, chunk_len)
        c = c._replace(tokens=tokens, loss_mask=loss_mask, logprobs=logprobs, cursor=c.cursor + chunk_len, cache=cache)
        return c, next_logits

    def pending_final(c: _Carry):
        final = (c.state.status >= text.FIRST_FINAL_STATUS) & (c.state.outcome != ttt.OUTCOME_UNFINISHED)
        return c.state.done & final & ~c.final_sent & ~c.context_cut

    def body(c: _Carry) -> _Carry:
        playing = ~c.state.done
        send = playing | pending_final(c)
        chunk, chunk_len = _message_chunk(tables, c.state, c.turn == 0, c.needs_end, send)
        # A game whose message and a full reply would overflow the context is cut before this turn.
        fits = c.cursor + chunk_len + n_new <= length
        cut = playing & ~fits
        send = send & fits
        chunk_len = jnp.where(send, chunk_len, 0)
        c = c._replace(final_sent=c.final_sent | (send & ~playing), context_cut=c.context_cut | cut)
        c, next_logits = append(c, chunk, chunk_len)

        active = playing & fits
        key, sub = jax.random.split(c.key)
        reply = policy(c.turn, next_logits, c.cache, sub, active)
        reply_len = jnp.where(active, reply.lengths, 0)
        tokens = _write(c.tokens, c.cursor, reply.tokens, reply_len, tables.pad_id)
        loss_mask = _write(c.loss_mask, c.cursor, jnp.ones(reply.tokens.shape, jnp.float32), reply_len, 0.0)
        logprobs = _write(c.logprobs, c.cursor, reply.logprobs, reply_len, 0.0)

        ended = reply.ended & active
        # The parser reads the reply without its end-of-turn token.
        text_len = reply_len - ended.astype(jnp.int32)
        move, format_ok = jax.vmap(text.parse_reply, in_axes=(None, 0, 0))(tables, reply.tokens, text_len)
        stepped = jax.vmap(ttt.step, in_axes=(0, 0, None))(c.state, move, env)
        state = jax.tree_util.tree_map(
            lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old), stepped, c.state
        )
        # Cut games end unfinished.
        state = state._replace(
            done=state.done | cut,
            outcome=jnp.where(cut, jnp.int8(ttt.OUTCOME_UNFINISHED), state.outcome).astype(state.outcome.dtype),
            to_play=jnp.where(cut, 0, state.to_play).astype(state.to_play.dtype),
        )
        t = c.turn
        return c._replace(
            turn=t + 1,
            key=key,
            state=state,
            cache=reply.cache,
            tokens=tokens,
            loss_mask=loss_mask,
            logprobs=logprobs,
            cursor=c.cursor + reply_len,
            needs_end=jnp.where(active, ~ended, c.needs_end),
            reply_lengths=c.reply_lengths.at[:, t].set(reply_len),
            reply_format=c.reply_format.at[:, t].set(active & format_ok),
            reply_moves=c.reply_moves.at[:, t].set(jnp.where(active, move, -2)),
            reply_truncated=c.reply_truncated.at[:, t].set(active & ~ended),
        )

    def cond(c: _Carry):
        return (c.turn < max_turns) & ~jnp.all(c.state.done)

    for i, (end_turn, _) in enumerate(stages):
        if i > 0 and model_fn is not None:
            carry = carry._replace(cache=grow_cache(carry.cache, init_cache, batch, stages[i][1]))
        carry = jax.lax.while_loop(lambda c, end=end_turn: cond(c) & (c.turn < end), body, carry)
    # The last message of games that finished on the last turn played.
    send = pending_final(carry)
    chunk, chunk_len = _message_chunk(tables, carry.state, carry.turn == 0, carry.needs_end, send)
    send = send & (carry.cursor + chunk_len <= length)
    carry = carry._replace(final_sent=carry.final_sent | send)
    carry, _ = append(carry, chunk, jnp.where(send, chunk_len, 0))

    pos = jnp.arange(length, dtype=jnp.int32)[None, :]
    inside = pos < carry.cursor[:, None]
    state = carry.state
    turns = state.turns
    format_score = carry.reply_format.sum(axis=1) / jnp.maximum(turns, 1)
    win = env.win_weight * ttt.win_reward(state, env)
    invalid = env.invalid_weight * ttt.invalid_reward(state, env)
    total = ttt.total_reward(state, format_score, env)
    trajectory = Trajectory(
        tokens=jnp.where(inside, carry.tokens, tables.pad_id),
        length=carry.cursor,
        loss_mask=jnp.where(inside, carry.loss_mask, 0.0),
        logprobs=jnp.where(inside, carry.logprobs, 0.0),
        reply_lengths=carry.reply_lengths,
        reply_format=carry.reply_format,
        reply_moves=carry.reply_moves,
        reply_truncated=carry.reply_truncated,
        turns=turns,
        outcome=state.outcome,
        invalid_moves=state.invalid_moves,
        missing_moves=state.missing_moves,
        format_score=format_score.astype(jnp.float32),
        win_reward=win,
        invalid_reward=invalid,
        format_reward=(env.format_weight * format_score).astype(jnp.float32),
        reward=total,
        context_cut=carry.context_cut,
        final_state=state,
    )
    return (trajectory, carry.cache) if return_cache else trajectory


def make_rollout(model_fn, init_cache, tables: text.TextTables, config: RolloutConfig, return_cache: bool = False):
    """A jitted `run(params, seeds, random_move_prob, key) -> Trajectory` for a model policy.

    model_fn: the model's cached call (`sampling.lfm2_model_fn(module)`); init_cache(batch, max_len):
    a new cache (`lambda b, n: models.lfm2.init_cache(config, b, n)`). The sampling config's stop
    tokens gain the tokenizer's end of turn and its pad id the tables' pad id.
    """
    eos = tables.eos_id
    sconf = config.sampling
    if eos not in sconf.stop_token_ids:
        sconf = dataclasses.replace(sconf, stop_token_ids=sconf.stop_token_ids + (eos,))
    sconf = dataclasses.replace(sconf, pad_id=tables.pad_id)
    config = dataclasses.replace(config, sampling=sconf)

    @jax.jit
    def run(params, seeds, random_move_prob, key):
        policy = model_policy(model_fn, params, sconf)
        return rollout(policy, model_fn, params, init_cache, tables, seeds, random_move_prob, key, config, return_cache)

    return run


# ----------------------------------------------------------------------------------------------------------
# Host helpers: read games back as text
# ----------------------------------------------------------------------------------------------------------

OUTCOME_NAMES = {
    ttt.OUTCOME_ONGOING: "ongoing",
    ttt.OUTCOME_WIN: "win",
    ttt.OUTCOME_DRAW: "draw",
    ttt.OUTCOME_LOSS: "loss",
    ttt.OUTCOME_UNFINISHED: "unfinished",
}


def decode_game(tokenizer, trajectory: Trajectory, index: int) -> str:
    """The conversation of game `index` as text, special tokens included (host)."""
    n = int(trajectory.length[index])
    ids = np.asarray(trajectory.tokens[index, :n]).tolist()
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def game_record(tokenizer, trajectory: Trajectory, index: int) -> dict:
    """One game as a JSON-ready dict: conversation text, outcome, reward parts, per-turn facts."""
    turns = int(trajectory.turns[index])
    return {
        "index": index,
        "seed": int(trajectory.final_state.seed[index]),
        "random_move_prob": float(trajectory.final_state.random_move_prob[index]),
        "outcome": OUTCOME_NAMES[int(trajectory.outcome[index])],
        "reward": float(trajectory.reward[index]),
        "win_reward": float(trajectory.win_reward[index]),
        "format_reward": float(trajectory.format_reward[index]),
        "invalid_reward": float(trajectory.invalid_reward[index]),
        "turns": turns,
        "invalid_moves": int(trajectory.invalid_moves[index]),
        "missing_moves": int(trajectory.missing_moves[index]),
        "moves": np.asarray(trajectory.reply_moves[index, :turns]).tolist(),
        "reply_lengths": np.asarray(trajectory.reply_lengths[index, :turns]).tolist(),
        "context_cut": bool(trajectory.context_cut[index]),
        "conversation": decode_game(tokenizer, trajectory, index),
    }


def write_games_jsonl(path: str | Path, tokenizer, trajectory: Trajectory, indices: Sequence[int] | None = None) -> Path:
    """Writes games (default: all) as JSON lines to `path`; returns the path."""
    trajectory = jax.device_get(trajectory)
    if indices is None:
        indices = range(trajectory.tokens.shape[0])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in indices:
            f.write(json.dumps(game_record(tokenizer, trajectory, int(i))) + "\n")
    return path
