"""The jitted batched sampler: prefill, then a `lax.while_loop` of cached decode steps.

Everything between the prompt and the generated tokens runs on the accelerator: one compiled program
per (batch, prompt length, cache length, config), no Python per token, caches donated.

Layout conventions
------------------
* Prompts are RIGHT padded: row b's real tokens are `prompt[b, :prompt_lengths[b]]`; what follows is
  padding (any id) and never enters the cache.
* Generated tokens are written to `tokens[b, :lengths[b]]`; the rest of the row holds `pad_id`.
  A row that stops includes its stop token (it counts in `lengths`), and the stop token is fed into the
  cache, so a multi-turn conversation can continue right after it.
* The same call continues an existing cache: the prompt is then the next chunk of the conversation,
  appended at each row's own offset `cache.lengths[b]`, and nothing already cached is read again.
* `active[b] = False` rows take no part: they generate nothing (`lengths = 0`) and their cache is left
  as it was.

Constrained replies (`SamplingConfig.constrained`, off by default): the env's reply grammar drives decoding.
A `text.grammar.ReplyTemplate` (from `text.tables_for_env`: `tables.reply_template`) is passed to `decode`;
each row then runs a small automaton inside the decode loop: the template's prefix tokens are written
without sampling, then the content is sampled from the logits restricted to the tokens its grammar allows
at that step (a cell: one choice token; an integer: "-" or digits up to max_digits, then the end; text: any
token until the suffix's first token), then the suffix and the end-of-turn token are written. Forced tokens
get log-prob 0 and `sampled = False` (they are out of the loss). A sampled token's `logprobs` entry is its
log-prob under the restricted distribution: the logits outside the allowed set are -inf, then temperature,
top-k and top-p as usual (`choice_set` records which set it was). The trainer computes the same with
`restrict_logits` on its logits at those positions before its log-softmax (same set, same temperature); the
forced tokens it must leave out of the loss. The content runs out of room gracefully: when only the suffix
still fits in max_new_tokens, the suffix is forced (an integer then has at least one digit as long as
max_new_tokens >= prefix + 1 + suffix, which `check_constrained` asks for).

The model enters as a function `model_fn(params, tokens[B, T], cache, num_valid[B]) -> (logits, cache)`,
the cached call of a model of any family; the model seam builds it (`models.family.cached_call(module)`),
and the cache is the family's (`models.family.init_cache`: only its `lengths` and `max_len` are read here).
Only each row's last real logits are used, so `logits` may be [B, T, V] or just [B, 1, V] (the logits at
position num_valid[b] - 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.text.grammar import ReplyTemplate

ModelFn = Callable[[Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


# Fields of a config dataclass that the TOML loader neither reads nor writes (set by the code, e.g. from the
# tokenizer): `dataclasses.field(metadata=NOT_IN_TOML)`.
NOT_IN_TOML = {"toml": False}


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How replies are sampled (the `[sampling]` table; stages and eval may override it key by key).

    temperature: divides the logits (ignored when greedy); a finite number > 0 (>= 0 when greedy).
    top_k: keep the k most likely tokens (0 keeps all).
    top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches top_p (1.0 keeps all).
    greedy: take the argmax instead of sampling.
    constrained: decode replies through the env's reply grammar (the module docstring): the fixed text is
        forced, only the content is sampled, from the tokens the grammar allows there.
    max_new_tokens: tokens generated per call (per turn in a rollout) at most, stop token included.
    stop_token_ids: ids that end a row (e.g. `<|im_end|>`); the stop token is kept in the output. Set by
        the code from the tokenizer, not in TOML.
    pad_id: written after the end of each row (from the tokenizer, not in TOML).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    constrained: bool = False
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = dataclasses.field(default=(), metadata=NOT_IN_TOML)
    pad_id: int = dataclasses.field(default=0, metadata=NOT_IN_TOML)

    def __post_init__(self):
        from jaxrl_llm.checks import ConfigError, check_float, check_int

        if not isinstance(self.greedy, bool):
            raise ConfigError(f"must be a boolean, got {self.greedy!r}", ("greedy",), "SamplingConfig")
        if not isinstance(self.constrained, bool):
            raise ConfigError(f"must be a boolean, got {self.constrained!r}", ("constrained",), "SamplingConfig")
        check_float(self, "temperature", low=0.0, low_open=not self.greedy)  # greedy ignores it: 0 is fine
        check_float(self, "top_p", 0.0, 1.0, low_open=True)
        check_int(self, "top_k", 0)
        check_int(self, "max_new_tokens", 1)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def with_tokenizer(self, stop_token_ids: tuple[int, ...], pad_id: int) -> "SamplingConfig":
        """This config with the stop ids (added to its own) and the pad id of a tokenizer."""
        stops = self.stop_token_ids + tuple(int(t) for t in stop_token_ids if int(t) not in self.stop_token_ids)
        return dataclasses.replace(self, stop_token_ids=stops, pad_id=int(pad_id))


class SampleOutput(NamedTuple):
    """What one sampling call returns (B rows, N = max_new_tokens).

    tokens: int32[B, N] generated ids, `pad_id` after each row's end.
    lengths: int32[B] generated tokens per row (stop token included).
    done: bool[B] the row ended with a stop token.
    truncated: bool[B] the row reached max_new_tokens (or the cache's end) without a stop token.
    logprobs: float32[B, N] log-prob of each token under the distribution it was sampled from
        (temperature, top-k, top-p applied; 0 in greedy mode); 0 past the row's end.
    model_logprobs: float32[B, N] log-prob of each token under the untempered model; 0 past the end.
    cache: the model cache with prompt and generated tokens appended.
    sampled: bool[B, N] the token was sampled (False for a constrained reply's forced tokens and past the
        row's end); without constraints every generated token.
    content: bool[B, N] a constrained reply's content tokens (the choice, the digits and sign); all False
        without constraints.
    choice_set: int8[B, N] the index into `ReplyTemplate.sets` of the set a constrained token was sampled
        from; -1 for tokens sampled from the whole vocabulary, forced tokens and past the end.
    """

    tokens: jax.Array
    lengths: jax.Array
    done: jax.Array
    truncated: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array
    cache: Any
    sampled: jax.Array
    content: jax.Array
    choice_set: jax.Array


def process_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """Logits of the distribution actually sampled from: float32[B, V] -> float32[B, V].

    Temperature first, then top-k and top-p; masked entries are -inf. In greedy mode the logits are
    returned unchanged (the argmax is taken from them).
    """
    logits = logits.astype(jnp.float32)
    if config.greedy:
        return logits
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Probability mass strictly before each sorted token; keep while it is below top_p.
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < config.top_p
        # The smallest kept logit is the threshold; ties with it are kept too.
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def _choose(key: jax.Array, logits: jax.Array, config: SamplingConfig):
    """One token per row from last-position logits float32[B, V]: ids, sampled and model log-probs."""
    processed = process_logits(logits, config)
    if config.greedy:
        token = jnp.argmax(processed, axis=-1).astype(jnp.int32)
        logprob = jnp.zeros(token.shape, jnp.float32)
    else:
        token = jax.random.categorical(key, processed, axis=-1).astype(jnp.int32)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(processed, axis=-1), token[:, None], axis=-1)[:, 0]
    model_logprob = jnp.take_along_axis(
        jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), token[:, None], axis=-1
    )[:, 0]
    return token, logprob, model_logprob


class _LoopState(NamedTuple):
    step: jax.Array  # int32[]
    key: jax.Array
    cache: Any
    next_logits: jax.Array  # float32[B, V] logits for the token to be sampled at `step`
    tokens: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array
    lengths: jax.Array
    finished: jax.Array  # bool[B] no more tokens for this row
    done: jax.Array  # bool[B] ended with a stop token
    auto: Any = None  # _Automaton of constrained decoding (None without constraints)


# Phases of a constrained reply's automaton.
PREFIX, CONTENT, SUFFIX, DONE = range(4)


class _Automaton(NamedTuple):
    """Per-row state of constrained decoding, and what it records per generated token."""

    phase: jax.Array  # int32[B] PREFIX, CONTENT, SUFFIX or DONE
    pos: jax.Array  # int32[B] next index into the prefix or the suffix
    count: jax.Array  # int32[B] content tokens so far (integer: digits)
    signed: jax.Array  # bool[B] integer: the content began with "-"
    sampled: jax.Array  # bool[B, N]
    content: jax.Array  # bool[B, N]
    choice_set: jax.Array  # int8[B, N]


def restrict_logits(logits: jax.Array, set_ids: jax.Array, sets: jax.Array) -> jax.Array:
    """Logits restricted to allowed sets: float[..., V], set ids int[...] (-1: no restriction), sets bool[K, V']
    -> float32[..., V], -inf outside the row's set (ids >= V' are outside every set).

    The sampler samples a constrained token from `process_logits(restrict_logits(...))`; a trainer that
    recomputes its log-prob applies the same restriction to the logits that predict it, e.g. for the
    logits [B, L, V] of a forward over a trajectory's tokens: `restrict_logits(logits[:, :-1],
    trajectory.choice_set[:, 1:], tables.reply_template.sets)`, then temperature and log-softmax."""
    vocab = logits.shape[-1]
    sets = jnp.asarray(sets, bool)
    sets = sets[:, :vocab] if sets.shape[1] >= vocab else jnp.pad(sets, ((0, 0), (0, vocab - sets.shape[1])))
    set_ids = jnp.asarray(set_ids, jnp.int32)
    allowed = (set_ids < 0)[..., None]
    for k in range(sets.shape[0]):
        allowed = allowed | ((set_ids == k)[..., None] & sets[k])
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)


def check_constrained(config: SamplingConfig, template: ReplyTemplate | None) -> None:
    """Constrained decoding needs a template and room for prefix + one content token + suffix (host check)."""
    if template is None:
        raise ValueError("SamplingConfig.constrained needs the env's reply template (text.tables_for_env(...)"
                         ".reply_template, see text.tables.require_reply_template)")
    need = template.prefix.shape[0] + 1 + template.suffix.shape[0]
    if config.max_new_tokens < need:
        raise ValueError(f"constrained replies need max_new_tokens >= {need} (the reply's fixed prefix "
                         f"{template.prefix.shape[0]}, one content token, the suffix and end of turn "
                         f"{template.suffix.shape[0]}), got {config.max_new_tokens}")


def _plan(template: ReplyTemplate, a: _Automaton, remaining: jax.Array):
    """This step of each row's automaton: (phase, pos after a forced end of the content, the forced token or
    -1, the allowed set of a sampled token or -1). `remaining`: int32[B] tokens the row may still write."""
    n_suffix = template.suffix.shape[0]
    if template.kind == "cell":
        must_end = jnp.zeros_like(remaining, bool)
    elif template.kind == "integer":
        must_end = (a.count >= template.max_digits) | (remaining <= n_suffix)
    else:
        must_end = remaining <= n_suffix
    end_now = (a.phase == CONTENT) & must_end
    phase = jnp.where(end_now, SUFFIX, a.phase)
    pos = jnp.where(end_now, 0, a.pos)
    prefix = jnp.concatenate([template.prefix.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    forced = jnp.where(phase == PREFIX, prefix[jnp.clip(pos, 0, prefix.shape[0] - 1)],
                       jnp.where(phase == SUFFIX, template.suffix[jnp.clip(pos, 0, n_suffix - 1)], -1))
    if template.kind == "integer":
        from jaxrl_llm.text.grammar import INT_DIGIT, INT_DIGIT_OR_END, INT_START

        first = jnp.where(a.signed | (remaining <= n_suffix + 1), INT_DIGIT, INT_START)
        set_id = jnp.where(a.count == 0, first, INT_DIGIT_OR_END)
    else:
        set_id = jnp.zeros_like(remaining)
    return phase, pos, forced.astype(jnp.int32), jnp.where(phase == CONTENT, set_id, -1).astype(jnp.int32)


def _advance(template: ReplyTemplate, a: _Automaton, phase, pos, token, live, step, sampled, set_id) -> _Automaton:
    """The automaton after row b wrote `token` at `step` (rows with live = False keep their state)."""
    n_prefix, n_suffix = template.prefix.shape[0], template.suffix.shape[0]
    in_prefix, in_content, in_suffix = phase == PREFIX, phase == CONTENT, phase == SUFFIX
    is_end = token == template.suffix[0]
    if template.kind == "cell":
        ends = in_content  # one choice token, then the whole suffix
        next_pos_end = 0
    else:
        ends = in_content & is_end  # the sampled end is the suffix's first token
        next_pos_end = 1
    new_phase = jnp.where(in_prefix & (pos + 1 >= n_prefix), CONTENT, phase)
    new_pos = jnp.where(in_prefix, jnp.where(pos + 1 >= n_prefix, 0, pos + 1), pos)
    new_phase = jnp.where(ends, SUFFIX, new_phase)
    new_pos = jnp.where(ends, next_pos_end, new_pos)
    new_pos = jnp.where(in_suffix, pos + 1, new_pos)
    new_phase = jnp.where((new_phase == SUFFIX) & (new_pos >= n_suffix), DONE, new_phase)
    is_content = in_content & ~ends if template.kind != "cell" else in_content
    is_minus = token == template.minus_id
    new = _Automaton(
        phase=new_phase.astype(jnp.int32),
        pos=new_pos.astype(jnp.int32),
        count=a.count + (is_content & ~is_minus).astype(jnp.int32),
        signed=a.signed | (is_content & is_minus),
        sampled=a.sampled.at[:, step].set(live & sampled),
        content=a.content.at[:, step].set(live & sampled & is_content),
        choice_set=a.choice_set.at[:, step].set(jnp.where(live & sampled, set_id, -1).astype(jnp.int8)),
    )
    keep = ("phase", "pos", "count", "signed")
    return new._replace(**{f: jnp.where(live, getattr(new, f), getattr(a, f)) for f in keep})


def last_logits(logits: jax.Array, num_valid: jax.Array) -> jax.Array:
    """Logits at each row's last real position: float32[B, T, V], int32[B] -> float32[B, V] (logits
    [B, 1, V] of a `last_only` call are that position's already)."""
    last = jnp.clip(num_valid - 1, 0, logits.shape[1] - 1)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def decode(
    model_fn: ModelFn,
    config: SamplingConfig,
    params,
    next_logits: jax.Array,
    cache,
    key: jax.Array,
    active: jax.Array,
    constraint: ReplyTemplate | None = None,
) -> SampleOutput:
    """The decode loop from given next-token logits float32[B, V] (the prefill already done).

    Used by `sample` and by multi-turn rollouts, which append each environment message with their own
    chunked prefill and then decode the reply. Rows with `active = False` generate nothing. A row stops at
    a stop token, at `max_new_tokens`, or when its cache is full (then `truncated`). With
    `config.constrained`, `constraint` (the env's reply template) drives each reply (the module docstring);
    otherwise it is ignored.
    """
    if config.constrained:
        check_constrained(config, constraint)
        return _decode_constrained(model_fn, config, params, next_logits, cache, key, active, constraint)
    batch = next_logits.shape[0]
    n_new = config.max_new_tokens
    room = jnp.where(active, _cache_capacity(cache) - cache.lengths, 0)
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)
    state = _LoopState(
        step=jnp.zeros((), jnp.int32),
        key=key,
        cache=cache,
        next_logits=next_logits.astype(jnp.float32),
        tokens=jnp.full((batch, n_new), config.pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, n_new), jnp.float32),
        model_logprobs=jnp.zeros((batch, n_new), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        finished=~active | (room <= 0),
        done=jnp.zeros((batch,), bool),
    )

    def cond(s: _LoopState):
        return (s.step < n_new) & ~jnp.all(s.finished)

    def body(s: _LoopState):
        key, sub = jax.random.split(s.key)
        token, logprob, model_logprob = _choose(sub, s.next_logits, config)
        live = ~s.finished
        token = jnp.where(live, token, config.pad_id)
        tokens = s.tokens.at[:, s.step].set(token)
        logprobs = s.logprobs.at[:, s.step].set(jnp.where(live, logprob, 0.0))
        model_logprobs = s.model_logprobs.at[:, s.step].set(jnp.where(live, model_logprob, 0.0))
        lengths = s.lengths + live.astype(jnp.int32)
        hit_stop = live & jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        # Feed the new token (stop token included) so the cache holds the whole reply.
        logits, cache = model_fn(params, token[:, None], s.cache, live.astype(jnp.int32))
        finished = s.finished | hit_stop | (lengths >= room)
        return _LoopState(
            step=s.step + 1,
            key=key,
            cache=cache,
            next_logits=logits[:, 0].astype(jnp.float32),
            tokens=tokens,
            logprobs=logprobs,
            model_logprobs=model_logprobs,
            lengths=lengths,
            finished=finished,
            done=s.done | hit_stop,
        )

    state = jax.lax.while_loop(cond, body, state)
    written = jnp.arange(n_new, dtype=jnp.int32)[None, :] < state.lengths[:, None]
    return _output(state, active, sampled=written, content=jnp.zeros((batch, n_new), bool),
                   choice_set=jnp.full((batch, n_new), -1, jnp.int8))


def _output(state, active: jax.Array, sampled: jax.Array, content: jax.Array, choice_set: jax.Array
            ) -> SampleOutput:
    """The SampleOutput of a finished decode loop's state (either loop's: the fields they share), with the
    per-token masks the loop computed (bool[B, N], bool[B, N], int8[B, N])."""
    return SampleOutput(
        tokens=state.tokens,
        lengths=state.lengths,
        done=state.done,
        truncated=active & ~state.done,
        logprobs=state.logprobs,
        model_logprobs=state.model_logprobs,
        cache=state.cache,
        sampled=sampled,
        content=content,
        choice_set=choice_set,
    )


def _decode_constrained(model_fn: ModelFn, config: SamplingConfig, params, next_logits: jax.Array, cache,
                        key: jax.Array, active: jax.Array, template: ReplyTemplate) -> SampleOutput:
    """`decode` with every reply driven by `template` (the module docstring)."""
    batch = next_logits.shape[0]
    n_new = config.max_new_tokens
    room = jnp.where(active, _cache_capacity(cache) - cache.lengths, 0)
    budget = jnp.minimum(room, n_new)
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)
    start = PREFIX if template.prefix.shape[0] else CONTENT
    zeros = jnp.zeros((batch,), jnp.int32)
    state = _LoopState(
        step=jnp.zeros((), jnp.int32),
        key=key,
        cache=cache,
        next_logits=next_logits.astype(jnp.float32),
        tokens=jnp.full((batch, n_new), config.pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, n_new), jnp.float32),
        model_logprobs=jnp.zeros((batch, n_new), jnp.float32),
        lengths=zeros,
        finished=~active | (room <= 0),
        done=jnp.zeros((batch,), bool),
        auto=_Automaton(phase=jnp.full((batch,), start, jnp.int32), pos=zeros, count=zeros,
                        signed=jnp.zeros((batch,), bool), sampled=jnp.zeros((batch, n_new), bool),
                        content=jnp.zeros((batch, n_new), bool), choice_set=jnp.full((batch, n_new), -1, jnp.int8)),
    )

    def cond(s: _LoopState):
        return (s.step < n_new) & ~jnp.all(s.finished)

    def body(s: _LoopState):
        key, sub = jax.random.split(s.key)
        live = ~s.finished
        phase, pos, forced, set_id = _plan(template, s.auto, budget - s.lengths)
        token, logprob, _ = _choose(sub, restrict_logits(s.next_logits, set_id, template.sets), config)
        is_forced = forced >= 0
        token = jnp.where(is_forced, forced, token)
        logprob = jnp.where(is_forced, 0.0, logprob)
        model_logprob = jnp.take_along_axis(jax.nn.log_softmax(s.next_logits, axis=-1), token[:, None], axis=-1)[:, 0]
        token = jnp.where(live, token, config.pad_id)
        auto = _advance(template, s.auto, phase, pos, token, live, s.step, ~is_forced, set_id)
        lengths = s.lengths + live.astype(jnp.int32)
        hit_stop = live & jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        logits, cache = model_fn(params, token[:, None], s.cache, live.astype(jnp.int32))
        complete = live & (auto.phase == DONE)
        return _LoopState(
            step=s.step + 1,
            key=key,
            cache=cache,
            next_logits=logits[:, 0].astype(jnp.float32),
            tokens=s.tokens.at[:, s.step].set(token),
            logprobs=s.logprobs.at[:, s.step].set(jnp.where(live, logprob, 0.0)),
            model_logprobs=s.model_logprobs.at[:, s.step].set(jnp.where(live, model_logprob, 0.0)),
            lengths=lengths,
            finished=s.finished | hit_stop | complete | (lengths >= room),
            done=s.done | hit_stop,
            auto=auto,
        )

    state = jax.lax.while_loop(cond, body, state)
    return _output(state, active, sampled=state.auto.sampled, content=state.auto.content,
                   choice_set=state.auto.choice_set)


def _sample_impl(
    model_fn: ModelFn,
    config: SamplingConfig,
    params,
    prompt: jax.Array,
    prompt_lengths: jax.Array,
    cache,
    key: jax.Array,
    active: jax.Array,
    constraint: ReplyTemplate | None = None,
) -> SampleOutput:
    """Prefill the prompt chunk at each row's offset, then decode."""
    prompt_lengths = jnp.where(active, prompt_lengths, 0).astype(jnp.int32)
    logits, cache = model_fn(params, prompt, cache, prompt_lengths)
    return decode(model_fn, config, params, last_logits(logits, prompt_lengths), cache, key, active & (prompt_lengths >= 1),
                  constraint)


def _cache_capacity(cache) -> int:
    """Static number of positions the cache holds (`cache.max_len`; unlimited without attention layers)."""
    return int(cache.max_len) or 2**30


def make_sampler(model_fn: ModelFn, config: SamplingConfig, donate_cache: bool = True,
                 constraint: ReplyTemplate | None = None) -> Callable[..., SampleOutput]:
    """Compile-once sampler: `sampler(params, prompt, prompt_lengths, cache, key, active=None) -> SampleOutput`.

    prompt: int32[B, P] right padded; prompt_lengths: int32[B], >= 1 for active rows (the logits of a
    row's last prompt token give its first new token);
    cache: the model cache (new from `init_cache`, or one a previous call returned; donated);
    key: a PRNG key; active: bool[B] rows taking part (default all).
    Calls with the same shapes reuse one compiled program. constraint: the reply template of
    `config.constrained` (`tables.reply_template`).
    """
    if config.constrained:
        check_constrained(config, constraint)
    jitted = jax.jit(
        functools.partial(_sample_impl, model_fn, config, constraint=constraint),
        donate_argnames=("cache",) if donate_cache else (),
    )

    def sampler(params, prompt, prompt_lengths, cache, key, active=None) -> SampleOutput:
        prompt = jnp.asarray(prompt, jnp.int32)
        if prompt.ndim != 2:
            raise ValueError(f"prompt must be int32[B, P], got shape {prompt.shape}")
        batch = prompt.shape[0]
        prompt_lengths = jnp.broadcast_to(jnp.asarray(prompt_lengths, jnp.int32), (batch,))
        if cache.lengths.shape != (batch,):
            raise ValueError(f"cache is for batch {cache.lengths.shape[0]} but the prompt has {batch} rows")
        capacity = _cache_capacity(cache)
        if prompt.shape[1] + config.max_new_tokens > capacity:
            raise ValueError(
                f"a prompt of {prompt.shape[1]} tokens + max_new_tokens {config.max_new_tokens} exceed the "
                f"cache's {capacity} positions; create the cache with max_len >= "
                f"{prompt.shape[1] + config.max_new_tokens} or lower max_new_tokens"
            )
        if active is None:
            active = jnp.ones((batch,), bool)
        return jitted(params, prompt, prompt_lengths, cache, key, jnp.asarray(active, bool))

    sampler.jitted = jitted  # exposed for compile-count checks
    return sampler


def sample(
    model_fn: ModelFn,
    params,
    prompt: jax.Array,
    prompt_lengths: jax.Array,
    cache,
    key: jax.Array,
    config: SamplingConfig,
    active: jax.Array | None = None,
    constraint: ReplyTemplate | None = None,
) -> SampleOutput:
    """One sampling call without keeping a compiled sampler around (traceable inside a larger jit).

    Shapes as in `make_sampler`. Inside your own `jit` this is the function to call: it adds no
    host-side checks and compiles as part of the enclosing program.
    """
    if active is None:
        active = jnp.ones((prompt.shape[0],), bool)
    return _sample_impl(model_fn, config, params, prompt, prompt_lengths, cache, key, active, constraint)
