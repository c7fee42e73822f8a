"""Multi-turn rollouts: a language model plays whole episodes of any env as text, inside one `jit`.

`rollout` is three named stages of one traceable program: `_set_up` (reset the games, plan the cache
stages, prefill the system prefix, the empty `Carry` of `carry.py`), `_turn_loop` (the turns, then
`_send_final_messages`) and `_trajectory` (the buffers, rubric and metrics as a `Trajectory`).

One turn, for every game of the batch at once (`_turn`, in four named parts, then `_log_turn`):
  1. `_append_message`: render the env's message for each game's state as tokens (the env's slot codes
     through `text.render_turn`) and append it to the conversation buffer and, through one chunked
     prefill at each game's own offset, to the model cache;
  2. `_generate_reply`: decode the reply with the policy (the sampler, continuing that cache);
  3. `_parse_reply`: the reply's tokens as bytes, read by the env's grammar (`text.parse_reply`);
  4. `_env_step`: `env.step` with the parsed reply (the scripted opponent answers inside it).
Games that are over stop generating; the loop ends when every game is done or after `max_turns`
replies. A game that would not fit its next message and a full reply into the context is cut there
(`context_cut`). A finished game's last message (`You win!`, ...) is appended too when the env has one,
so the buffer is the whole conversation, exactly as the tokenizer's chat template writes it.

Invariant: for every game, the cache holds exactly the buffer's tokens `tokens[b, :length[b]]`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from envs.core import Env, Episode, ParsedReply
from jaxrl_llm import text
from jaxrl_llm.checks import check_int
from jaxrl_llm.generate import sampler as sampling
from jaxrl_llm.rollout.carry import (  # noqa: F401 (Buffer, Flags: re-exported)
    Buffer, Carry, Flags, TurnLog, extend_buffer, initial_carry, where_rows,
)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits of a rollout (static under jit; the `[rollout]` table, per stage in `[grpo.rollout]`).

    context_length: positions of the conversation buffer and of the model cache per game.
    max_turns: the most replies the model makes in a game (1: a single-turn task); a game still going
        then ends unfinished.
    cache_stages: the model cache grows with the conversation in this many steps. The turns are split
        into `cache_stages` runs; during a run the cache holds only the positions its last turn can
        reach at most (prefix + turns x (longest message + 1 + max_new_tokens), capped at
        context_length), so attention reads a cache sized to the conversation so far instead of the
        whole context. Each stage compiles its own copy of the turn loop; 1 keeps one full-size cache.
        The games, tokens and log-probs do not depend on it.
    """

    context_length: int = 1024
    max_turns: int = 8
    cache_stages: int = 1

    def __post_init__(self):
        check_int(self, "context_length", 16)
        check_int(self, "max_turns", 1)
        check_int(self, "cache_stages", 1)


class Trajectory(NamedTuple):
    """A batch of B finished episodes (L = context_length, T = max_turns); what every env shares.

    tokens: int32[B, L] the conversation (prefix, messages, replies), pad_id after `length`.
    length: int32[B] tokens used.
    loss_mask: float32[B, L] 1 exactly on the model's sampled tokens (end-of-turn token included).
    logprobs: float32[B, L] the sampler's log-prob of each sampled token (0 elsewhere).
    reply_lengths: int32[B, T] tokens of each reply (0 for turns not played).
    reply_format: bool[B, T] each reply matched the grammar's format pattern.
    reply_truncated: bool[B, T] the reply hit max_new_tokens without an end-of-turn token.
    reply_kind: int8[B, T] -1 turn not played, 0 no answer tag, 1 a tag with invalid content, 2 valid.
    reply_value: int32[B, T] the parsed value of each valid reply (0 otherwise).
    turns: int32[B] replies the model made.
    context_cut: bool[B] the game was cut by the context limit.
    truncated: bool[B] the rollout stopped the game before the env ended it (turn limit or context).
    reward: float32[B] the rubric's weighted sum.
    reward_parts: {name: float32[B]} the rubric's parts, unweighted (env.rubric gives the weights).
    metrics: {name: float32[B]} the env's per-game metrics.
    examples: the env's examples (pytree, leading axis B).
    final_state: the env's states at the end (pytree, leading axis B).
    token_turn: int32[B, L] the turn of each model (loss-mask) token, -1 elsewhere.
    turn_rewards: float32[B, T] the env's reward of each turn (`Env.turn_reward`; 0 for turns not played).
    turn_keys: uint32[B, T] the key of the state each turn was played from (`Env.state_key`, never 0 for a
        played turn), 0 for turns not played.
    turn_legal: bool[B, T, C] the legal choices at each turn (`Env.legal_choices`; C = 0 when the env
        cannot say; all False for turns not played).
    decision_mask: float32[B, L] 1 on the model tokens that carry the reply grammar's content (the move
        digit, the answer's sign and digits), 0 elsewhere. Constrained replies: the sampled content tokens;
        otherwise the reply tokens whose bytes overlap the parsed (stripped) content (`text.grammar.
        content_span`), none when a reply has no `<tag>...</tag>` or an empty content.
    choice_set: int8[B, L] constrained replies: the allowed set (an index into `tables.reply_template.sets`)
        each content token was sampled from; -1 elsewhere and always without constraints. A trainer
        recomputes those tokens' log-probs with `generate.restrict_logits` (see `generate.sampler`).
    """

    tokens: jax.Array
    length: jax.Array
    loss_mask: jax.Array
    logprobs: jax.Array
    reply_lengths: jax.Array
    reply_format: jax.Array
    reply_truncated: jax.Array
    reply_kind: jax.Array
    reply_value: jax.Array
    turns: jax.Array
    context_cut: jax.Array
    truncated: jax.Array
    reward: jax.Array
    reward_parts: dict
    metrics: dict
    examples: Any
    final_state: Any
    token_turn: jax.Array = None
    turn_rewards: jax.Array = None
    turn_keys: jax.Array = None
    turn_legal: jax.Array = None
    decision_mask: jax.Array = None
    choice_set: jax.Array = None


class Reply(NamedTuple):
    """One turn's replies for the batch (N = max new tokens): what a policy returns."""

    tokens: jax.Array  # int32[B, N]
    lengths: jax.Array  # int32[B]
    ended: jax.Array  # bool[B] the reply ends with the end-of-turn token
    logprobs: jax.Array  # float32[B, N]
    cache: Any
    sampled: Any = None  # bool[B, N] tokens in the loss (None: every token of the reply)
    content: Any = None  # bool[B, N] a constrained reply's content tokens (None: find them by parsing)
    choice_set: Any = None  # int8[B, N] a constrained token's allowed set, -1 elsewhere (None: all -1)


# A policy turns (turn index, next-token logits [B, V] or None, cache, key, active[B]) into a Reply.
Policy = Callable[[jax.Array, Any, Any, jax.Array, jax.Array], Reply]


def model_policy(model_fn: sampling.ModelFn, params, config: sampling.SamplingConfig, constraint=None) -> Policy:
    """The language model as a policy: each reply sampled with `sampling.decode` from the cache.

    With `config.constrained` the replies follow the reply template `constraint` (`tables.reply_template`;
    `rollout` passes its tables' template at call time)."""

    def policy(turn, next_logits, cache, key, active, constraint=constraint):
        out = sampling.decode(model_fn, config, params, next_logits, cache, key, active, constraint)
        content = out.content if config.constrained else None  # None: the rollout finds it by parsing
        return Reply(out.tokens, out.lengths, out.done, out.logprobs, out.cache, out.sampled, content,
                     out.choice_set)

    return policy


def scripted_policy(reply_tokens: jax.Array, reply_lengths: jax.Array, eos_id: int) -> Policy:
    """Replies given in advance: reply_tokens int32[B, T, N], reply_lengths int32[B, T] (turn t's reply).

    For tests and demos without a model (the rollout then runs with `model_fn=None` and no cache).
    Build the arrays from text with `records.script_replies`.
    """
    reply_tokens = jnp.asarray(reply_tokens, jnp.int32)
    reply_lengths = jnp.asarray(reply_lengths, jnp.int32)

    def policy(turn, next_logits, cache, key, active, constraint=None):
        tokens = reply_tokens[:, turn]
        lengths = jnp.where(active, reply_lengths[:, turn], 0)
        last = jnp.take_along_axis(tokens, jnp.clip(lengths - 1, 0)[:, None], axis=1)[:, 0]
        ended = active & (lengths > 0) & (last == eos_id)
        return Reply(tokens, lengths, ended, jnp.zeros(tokens.shape, jnp.float32), cache)

    return policy


def cache_stage_plan(config: RolloutConfig, max_new_tokens: int, prefix_len: int, max_chunk: int
                     ) -> list[tuple[int, int]]:
    """Static (end turn, cache positions) of each cache stage, in order; the last holds context_length.

    A turn appends at most one chunk (`max_chunk` = longest message + 1) and one reply, so after turn t
    (counted from 1) a conversation holds at most prefix_len + t * (max_chunk + max_new_tokens) tokens.
    Stages that would not shrink the cache are merged into the next.
    """
    turns = config.max_turns
    per_turn = max_chunk + max_new_tokens
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


@dataclasses.dataclass(frozen=True, eq=False)
class _Run:
    """What every stage of one rollout call reads and never changes: the env, the policy and model, the
    tables, the limits, and the batch's static sizes (B games, C legal choices per turn, 0 when the env
    cannot say). Built by `_set_up`; a plain Python object inside the trace, not a carried pytree."""

    env: Env
    policy: Policy
    model_fn: sampling.ModelFn | None
    params: Any
    init_cache: Callable[[int, int], Any] | None
    tables: text.TextTables
    grammar: Any
    config: RolloutConfig
    sampling_config: sampling.SamplingConfig
    batch: int
    num_choices: int

    def legal_of(self, state) -> jax.Array:
        """The legal choices bool[C] of one game's state (`Env.legal_choices`)."""
        return self.env.legal_choices(state, params=self.env.params)


def _message_chunk(env: Env, tables: text.TextTables, state, first, needs_end, send):
    """The next chunk per game: [`<|im_end|>` if the reply was cut] + the rendered user turn.

    Returns (tokens int32[B, max_msg + 1], lengths int32[B]); rows with `send = False` get length 0.
    """
    codes = jax.vmap(env.message_codes, in_axes=(0, None))(state, env.params)
    final = jax.vmap(env.done)(state)
    msg, msg_len = jax.vmap(text.render_turn, in_axes=(None, 0, None, 0))(tables, codes, first, final)
    width = msg.shape[1] + 1
    shift = needs_end.astype(jnp.int32)
    src = jnp.arange(width, dtype=jnp.int32)[None, :] - shift[:, None]
    chunk = jnp.take_along_axis(msg, jnp.clip(src, 0, msg.shape[1] - 1), axis=1)
    chunk = jnp.where(src < 0, tables.eos_id, chunk)
    chunk = jnp.where(src >= msg.shape[1], tables.pad_id, chunk)
    lengths = jnp.where(send, msg_len + shift, 0)
    return chunk, lengths


# ----------------------------------------------------------------------------------------------------------
# Stage 1: set-up (the run's constants, the context check, the cache plan, the prefilled prefix)
# ----------------------------------------------------------------------------------------------------------


def _check_context(tables: text.TextTables, config: RolloutConfig, n_new: int) -> None:
    """Raises ValueError when the context cannot hold the system prefix, one message and one reply."""
    p0, length = tables.prefix.shape[0], config.context_length
    if p0 + tables.max_msg + 1 + n_new > length:
        raise ValueError(
            f"context_length {length} cannot hold the system prefix ({p0} tokens), one message "
            f"({tables.max_msg}) and one reply ({n_new}); raise context_length to >= {p0 + tables.max_msg + 1 + n_new}"
        )


def _prefilled_prefix(run: _Run, max_len: int):
    """A cache of `max_len` positions per game holding the system prefix (None without a model).

    The prefix is the same for every game: prefilled once, its cache broadcast to the batch."""
    if run.model_fn is None:
        return None
    prefix = run.tables.prefix
    one = run.init_cache(1, max_len)
    _, one = run.model_fn(run.params, prefix[None, :], one, jnp.full((1,), prefix.shape[0], jnp.int32))
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (run.batch,) + x.shape[1:]), one)


def _set_up(env: Env, policy: Policy, model_fn, params, init_cache, tables: text.TextTables, examples,
            key: jax.Array, config: RolloutConfig, sampling_config: sampling.SamplingConfig):
    """The run's constants, its cache plan (`cache_stage_plan`) and the carry before the first turn."""
    batch = jax.tree_util.tree_leaves(examples)[0].shape[0]
    state = jax.vmap(env.reset, in_axes=(0, None))(examples, env.params)
    legal_of = functools.partial(env.legal_choices, params=env.params)
    legal_shape = jax.eval_shape(legal_of, jax.tree_util.tree_map(lambda x: x[0], state))
    run = _Run(env=env, policy=policy, model_fn=model_fn, params=params, init_cache=init_cache, tables=tables,
               grammar=env.reply_grammar(env.params), config=config, sampling_config=sampling_config,
               batch=batch, num_choices=0 if legal_shape is None else legal_shape.shape[-1])
    n_new = sampling_config.max_new_tokens
    _check_context(tables, config, n_new)
    stages = cache_stage_plan(config, n_new, tables.prefix.shape[0], tables.max_msg + 1)
    carry = initial_carry(key, state, _prefilled_prefix(run, stages[0][1]), tables.prefix, tables.pad_id,
                          config.context_length, config.max_turns, run.num_choices)
    return run, stages, carry


# ----------------------------------------------------------------------------------------------------------
# Stage 2: the turn loop (one turn in four named parts, then its log)
# ----------------------------------------------------------------------------------------------------------


def _playing(run: _Run, c: Carry) -> jax.Array:
    """bool[B]: the game is neither over nor cut by the context."""
    return ~jax.vmap(run.env.done)(c.state) & ~c.flags.context_cut


def _pending_final(run: _Run, c: Carry) -> jax.Array:
    """bool[B]: the game is over and its final message (when the env has one) is not in the buffer yet."""
    if not run.env.final_message:
        return jnp.zeros((run.batch,), bool)
    return jax.vmap(run.env.done)(c.state) & ~c.flags.final_sent & ~c.flags.context_cut


def _append_message(run: _Run, c: Carry, chunk, chunk_len):
    """Writes the chunk into the buffer and the cache; returns (carry, next-token logits [B, V])."""
    next_logits, cache = None, c.cache
    if run.model_fn is not None:
        logits, cache = run.model_fn(run.params, chunk, c.cache, chunk_len)
        next_logits = sampling.last_logits(logits, chunk_len)
    return c._replace(buffer=extend_buffer(c.buffer, chunk, chunk_len, run.tables.pad_id, sampled=False),
                      cache=cache), next_logits


def _generate_reply(run: _Run, c: Carry, next_logits, active):
    """The policy's reply for the active games, appended to the buffer; returns (carry, reply, lengths)."""
    tables = run.tables
    key, sub = jax.random.split(c.key)
    if run.sampling_config.constrained:
        reply = run.policy(c.turn, next_logits, c.cache, sub, active, constraint=text.require_reply_template(tables))
    else:
        reply = run.policy(c.turn, next_logits, c.cache, sub, active)
    lengths = jnp.where(active, reply.lengths, 0)
    decision = reply.content
    if decision is None:  # the tokens of the parsed content (the parser reads the reply without its end of turn)
        text_len = lengths - (reply.ended & active).astype(jnp.int32)
        decision = jax.vmap(text.content_token_mask, in_axes=(None, None, 0, 0))(tables, run.grammar, reply.tokens,
                                                                                  text_len)
    buffer = extend_buffer(c.buffer, reply.tokens, lengths, tables.pad_id, sampled=True, logprobs=reply.logprobs,
                           reply=reply, decision=decision)
    return c._replace(key=key, cache=reply.cache, buffer=buffer), reply, lengths


def _parse_reply(run: _Run, reply: Reply, lengths, ended) -> ParsedReply:
    """The env's grammar read over each reply (without its end-of-turn token)."""
    text_len = lengths - ended.astype(jnp.int32)
    return jax.vmap(text.parse_reply, in_axes=(None, None, 0, 0))(run.tables, run.grammar, reply.tokens, text_len)


def _env_step(run: _Run, c: Carry, parsed: ParsedReply, active):
    """`env.step` with the parsed replies, for the active games only."""
    stepped = jax.vmap(run.env.step, in_axes=(0, 0, None))(c.state, parsed, run.env.params)
    return c._replace(state=where_rows(active, stepped, c.state))


def _state_facts(run: _Run, log: TurnLog, state, active):
    """The key (uint32[B], never 0 for an active game, 0 otherwise) and the legal choices bool[B, C] of the
    states a turn is played from."""
    state_key = jax.vmap(run.env.state_key, in_axes=(0, None))(state, run.env.params)
    state_key = jnp.where(active, jnp.where(state_key == 0, 1, state_key), 0).astype(jnp.uint32)
    legal = log.legal[:, 0]
    if run.num_choices:
        legal = jax.vmap(run.legal_of)(state) & active[:, None]
    return state_key, legal


def _log_turn(log: TurnLog, t, active, lengths, ended, parsed: ParsedReply, start, turn_reward, state_key,
              legal) -> TurnLog:
    """Turn t's facts written into column t of the log (the defaults for games not active)."""
    kind = jnp.where(active, jnp.where(parsed.found, jnp.where(parsed.valid, 2, 1), 0), -1).astype(jnp.int8)
    return TurnLog(lengths=log.lengths.at[:, t].set(lengths),
                   format=log.format.at[:, t].set(active & parsed.format_ok),
                   truncated=log.truncated.at[:, t].set(active & ~ended),
                   kind=log.kind.at[:, t].set(kind),
                   value=log.value.at[:, t].set(jnp.where(active & parsed.valid, parsed.value, 0)),
                   start=log.start.at[:, t].set(jnp.where(active, start, 0)),
                   reward=log.reward.at[:, t].set(jnp.where(active, turn_reward, 0.0)),
                   key=log.key.at[:, t].set(state_key),
                   legal=log.legal.at[:, t].set(legal))


def _turn(run: _Run, c: Carry) -> Carry:
    """One turn of every game: message, reply, parse, env step, log."""
    live = _playing(run, c)
    send = live | _pending_final(run, c)
    chunk, chunk_len = _message_chunk(run.env, run.tables, c.state, c.turn == 0, c.flags.needs_end, send)
    # A game whose message and a full reply would overflow the context is cut before this turn.
    fits = c.buffer.cursor + chunk_len + run.sampling_config.max_new_tokens <= run.config.context_length
    send = send & fits
    c = c._replace(flags=c.flags._replace(final_sent=c.flags.final_sent | (send & ~live),
                                          context_cut=c.flags.context_cut | (live & ~fits)))
    c, next_logits = _append_message(run, c, chunk, jnp.where(send, chunk_len, 0))
    active = live & fits
    start, prev_state = c.buffer.cursor, c.state
    state_key, legal = _state_facts(run, c.log, prev_state, active)
    c, reply, lengths = _generate_reply(run, c, next_logits, active)
    ended = reply.ended & active
    parsed = _parse_reply(run, reply, lengths, ended)
    c = _env_step(run, c, parsed, active)
    turn_reward = jax.vmap(run.env.turn_reward, in_axes=(0, 0, None))(prev_state, c.state, run.env.params)
    log = _log_turn(c.log, c.turn, active, lengths, ended, parsed, start, turn_reward, state_key, legal)
    return c._replace(turn=c.turn + 1, flags=c.flags._replace(needs_end=jnp.where(active, ~ended, c.flags.needs_end)),
                      log=log)


def _turn_loop(run: _Run, stages: list[tuple[int, int]], carry: Carry) -> Carry:
    """Turns until every game is done or `max_turns` replies: one `while_loop` per cache stage, the cache
    grown between stages."""

    def going(c: Carry, end: int):
        return (c.turn < run.config.max_turns) & jnp.any(_playing(run, c)) & (c.turn < end)

    for i, (end_turn, _) in enumerate(stages):
        if i > 0 and run.model_fn is not None:
            carry = carry._replace(cache=grow_cache(carry.cache, run.init_cache, run.batch, stages[i][1]))
        carry = jax.lax.while_loop(functools.partial(going, end=end_turn), functools.partial(_turn, run), carry)
    return carry


def _send_final_messages(run: _Run, carry: Carry) -> Carry:
    """The last message of games that finished on the last turn played (when it fits the context)."""
    send = _pending_final(run, carry)
    chunk, chunk_len = _message_chunk(run.env, run.tables, carry.state, carry.turn == 0, carry.flags.needs_end, send)
    send = send & (carry.buffer.cursor + chunk_len <= run.config.context_length)
    carry = carry._replace(flags=carry.flags._replace(final_sent=carry.flags.final_sent | send))
    carry, _ = _append_message(run, carry, chunk, jnp.where(send, chunk_len, 0))
    return carry


def rollout(
    env: Env,
    policy: Policy,
    model_fn: sampling.ModelFn | None,
    params,
    init_cache: Callable[[int, int], Any] | None,
    tables: text.TextTables,
    examples: Any,
    key: jax.Array,
    config: RolloutConfig,
    sampling_config: sampling.SamplingConfig,
    return_cache: bool = False,
):
    """Plays B episodes of `env` to the end (traceable; wrap it in `jax.jit`, or use `make_rollout`).

    env: the environment (static; its `params` are used); policy: `model_policy(...)` or
    `scripted_policy(...)`; model_fn / params: the model's cached call (None for a scripted policy,
    which then runs without a model); init_cache(batch, max_len): a new cache; tables: the text tables of
    the tokenizer and the env's messages (`text.tables_for_env`); examples: the env's examples, leading
    axis B; key: sampling randomness; sampling_config: its max_new_tokens is the per-turn limit.
    Returns the `Trajectory`, or `(Trajectory, cache)` with `return_cache` (the cache then holds
    exactly `tokens[b, :length[b]]` for every game).

    Three stages: `_set_up` (reset, cache plan, prefilled prefix, the empty carry), `_turn_loop` (then
    `_send_final_messages`) and `_trajectory` (the buffers, rubric and metrics as a `Trajectory`).
    """
    run, stages, carry = _set_up(env, policy, model_fn, params, init_cache, tables, examples, key, config,
                                 sampling_config)
    carry = _send_final_messages(run, _turn_loop(run, stages, carry))
    trajectory = _trajectory(env, tables, carry, examples)
    return (trajectory, carry.cache) if return_cache else trajectory


# ----------------------------------------------------------------------------------------------------------
# Stage 3: the trajectory
# ----------------------------------------------------------------------------------------------------------


def _token_turns(log: TurnLog, loss_mask: jax.Array) -> jax.Array:
    """int32[B, L]: the turn of each model (loss-mask) token, -1 elsewhere."""
    length = loss_mask.shape[1]
    token_turn = jnp.full(loss_mask.shape, -1, jnp.int32)
    position = jnp.arange(length, dtype=jnp.int32)[None, :]
    for t in range(log.start.shape[1]):  # turn t's reply holds positions start .. start + length - 1
        first, end = log.start[:, t:t + 1], log.start[:, t:t + 1] + log.lengths[:, t:t + 1]
        token_turn = jnp.where((position >= first) & (position < end), t, token_turn)
    return jnp.where(loss_mask > 0, token_turn, -1)


def _trajectory(env: Env, tables: text.TextTables, carry: Carry, examples) -> Trajectory:
    """The Trajectory of a finished loop: buffers cut at the cursor, the episode facts, rubric and metrics."""
    buffer, log, state = carry.buffer, carry.log, carry.state
    length = buffer.tokens.shape[1]
    inside = jnp.arange(length, dtype=jnp.int32)[None, :] < buffer.cursor[:, None]
    turns = (log.kind >= 0).sum(axis=1).astype(jnp.int32)
    format_score = (log.format.sum(axis=1) / jnp.maximum(turns, 1)).astype(jnp.float32)
    truncated = ~jax.vmap(env.done)(state)
    episode = Episode(format_score=format_score, turns=turns, truncated=truncated,
                      context_cut=carry.flags.context_cut)
    parts = jax.vmap(env.reward_parts, in_axes=(0, 0, None))(state, episode, env.params)
    reward = jax.vmap(env.reward, in_axes=(0, 0, None))(state, episode, env.params)
    metrics = jax.vmap(env.metrics, in_axes=(0, 0, None))(state, episode, env.params)
    loss_mask = jnp.where(inside, buffer.loss_mask, 0.0)
    return Trajectory(
        tokens=jnp.where(inside, buffer.tokens, tables.pad_id),
        length=buffer.cursor,
        loss_mask=loss_mask,
        logprobs=jnp.where(inside, buffer.logprobs, 0.0),
        reply_lengths=log.lengths,
        reply_format=log.format,
        reply_truncated=log.truncated,
        reply_kind=log.kind,
        reply_value=log.value,
        turns=turns,
        context_cut=carry.flags.context_cut,
        truncated=truncated,
        reward=reward,
        reward_parts=parts,
        metrics=metrics,
        examples=examples,
        final_state=state,
        token_turn=_token_turns(log, loss_mask),
        turn_rewards=log.reward,
        turn_keys=log.key,
        turn_legal=log.legal,
        decision_mask=jnp.where(inside, buffer.decision, 0.0),
        choice_set=jnp.where(inside, buffer.choice_set, -1).astype(jnp.int8),
    )


def make_rollout(env: Env, model_fn, init_cache, tables: text.TextTables, config: RolloutConfig,
                 sampling_config: sampling.SamplingConfig, return_cache: bool = False):
    """A jitted `run(params, examples, key) -> Trajectory` of `env` for a model policy.

    model_fn: the model's cached call (`models.family.cached_call(module)`); init_cache(batch, max_len): a new
    cache (`lambda b, n: models.family.init_cache(config, b, n)`). The sampling config's stop tokens gain the
    tokenizer's end of turn and its pad id the tables' pad id.
    """
    sconf = sampling_config.with_tokenizer((tables.eos_id,), tables.pad_id)

    @jax.jit
    def run(params, examples, key):
        policy = model_policy(model_fn, params, sconf)
        return rollout(env, policy, model_fn, params, init_cache, tables, examples, key, config, sconf, return_cache)

    return run
