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

The model enters as a function `model_fn(params, tokens[B, T], cache, num_valid[B]) -> (logits, cache)`,
the cached call of `models.lfm2.Lfm2ForCausalLM`; `lfm2_model_fn` builds it. Only each row's last real
logits are used, so `logits` may be [B, T, V] or just [B, 1, V] (the logits at position num_valid[b] - 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

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
    max_new_tokens: tokens generated per call (per turn in a rollout) at most, stop token included.
    stop_token_ids: ids that end a row (e.g. `<|im_end|>`); the stop token is kept in the output. Set by
        the code from the tokenizer, not in TOML.
    pad_id: written after the end of each row (from the tokenizer, not in TOML).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = dataclasses.field(default=(), metadata=NOT_IN_TOML)
    pad_id: int = dataclasses.field(default=0, metadata=NOT_IN_TOML)

    def __post_init__(self):
        from jaxrl_llm.checks import ConfigError, check_float, check_int

        if not isinstance(self.greedy, bool):
            raise ConfigError(f"must be a boolean, got {self.greedy!r}", ("greedy",), "SamplingConfig")
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
    """

    tokens: jax.Array
    lengths: jax.Array
    done: jax.Array
    truncated: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array
    cache: Any


def lfm2_model_fn(module) -> ModelFn:
    """The cached call of a Flax LFM2 module as a `model_fn` for `sample`: logits [B, 1, V] of each row's
    last real token (a prefill chunk computes the LM head at one position, not T)."""

    def model_fn(params, tokens, cache, num_valid):
        return module.apply({"params": params}, tokens, cache=cache, num_valid=num_valid, last_only=True)

    return model_fn


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
) -> SampleOutput:
    """The decode loop from given next-token logits float32[B, V] (the prefill already done).

    Used by `sample` and by multi-turn rollouts, which append each environment message with their own
    chunked prefill and then decode the reply. Rows with `active = False` generate nothing. A row stops at
    a stop token, at `max_new_tokens`, or when its cache is full (then `truncated`).
    """
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
    return SampleOutput(
        tokens=state.tokens,
        lengths=state.lengths,
        done=state.done,
        truncated=active & ~state.done,
        logprobs=state.logprobs,
        model_logprobs=state.model_logprobs,
        cache=state.cache,
    )


def _sample_impl(
    model_fn: ModelFn,
    config: SamplingConfig,
    params,
    prompt: jax.Array,
    prompt_lengths: jax.Array,
    cache,
    key: jax.Array,
    active: jax.Array,
) -> SampleOutput:
    """Prefill the prompt chunk at each row's offset, then decode."""
    prompt_lengths = jnp.where(active, prompt_lengths, 0).astype(jnp.int32)
    logits, cache = model_fn(params, prompt, cache, prompt_lengths)
    return decode(model_fn, config, params, last_logits(logits, prompt_lengths), cache, key, active & (prompt_lengths >= 1))


def _cache_capacity(cache) -> int:
    """Static number of positions the cache holds (`cache.max_len`; unlimited without attention layers)."""
    return int(cache.max_len) or 2**30


def make_sampler(model_fn: ModelFn, config: SamplingConfig, donate_cache: bool = True) -> Callable[..., SampleOutput]:
    """Compile-once sampler: `sampler(params, prompt, prompt_lengths, cache, key, active=None) -> SampleOutput`.

    prompt: int32[B, P] right padded; prompt_lengths: int32[B], >= 1 for active rows (the logits of a
    row's last prompt token give its first new token);
    cache: the model cache (new from `init_cache`, or one a previous call returned; donated);
    key: a PRNG key; active: bool[B] rows taking part (default all).
    Calls with the same shapes reuse one compiled program.
    """
    jitted = jax.jit(
        functools.partial(_sample_impl, model_fn, config),
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
) -> SampleOutput:
    """One sampling call without keeping a compiled sampler around (traceable inside a larger jit).

    Shapes as in `make_sampler`. Inside your own `jit` this is the function to call: it adds no
    host-side checks and compiles as part of the enclosing program.
    """
    if active is None:
        active = jnp.ones((prompt.shape[0],), bool)
    return _sample_impl(model_fn, config, params, prompt, prompt_lengths, cache, key, active)
