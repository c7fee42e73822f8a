"""Guess the number: a multi-turn env written outside the package, from the protocol alone (`envs.core`).

The env picks a secret in 1..N; the model answers `<guess>k</guess>` and hears "Higher.", "Lower." or
"Correct!" until it finds it or has used `max_guesses` replies. `guesses` is a mean (replies per game),
declared in `metric_kinds`; `solved` and `invalid` are 0/1 rates.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from envs.core import Env, EvalSetting, MessageFamily, MessageSpec, ReplyGrammar, RubricPart, Slot

START, HIGHER, LOWER, INVALID, NO_TAG, CORRECT, OUT = range(7)


class State(NamedTuple):
    secret: jax.Array  # int32[]
    guesses: jax.Array  # int32[] replies so far
    invalid: jax.Array  # int32[] replies that were no guess in 1..N
    status: jax.Array  # int32[] which message the state shows
    done: jax.Array  # bool[]


@dataclasses.dataclass(frozen=True)
class Params:
    max_number: int = 16
    max_guesses: int = 6

    def __post_init__(self):
        if not 2 <= self.max_number <= 99 or self.max_guesses < 1:
            raise ValueError("need 2 <= max_number <= 99 and max_guesses >= 1")


@dataclasses.dataclass(frozen=True)
class Stage:
    """Secrets are drawn uniformly from 1..high (high <= max_number)."""

    high: int = 16


class GuessNumber(Env):
    """Guess a secret number from higher / lower hints."""

    name = "guess"
    Params = Params
    Stage = Stage
    results_columns = (("solved", "solved"), ("guesses", "guesses"), ("invalid", "invalid"), ("format", "format"))
    outcome_metrics = ("solved",)
    metric_kinds = {"guesses": "mean"}

    def sample_examples(self, key, num_prompts, group_size, stage):
        secrets = jax.random.randint(key, (num_prompts,), 1, min(stage.high, self.params.max_number) + 1)
        return jnp.repeat(secrets, group_size).astype(jnp.int32)

    def eval_settings(self):
        return (EvalSetting("all", Stage(self.params.max_number)),)

    def reset(self, example, params):
        zero = jnp.int32(0)
        return State(jnp.asarray(example, jnp.int32), zero, zero, jnp.int32(START), jnp.bool_(False))

    def step(self, state, reply, params):
        value = reply.value
        ok = reply.found & reply.valid & (value >= 1) & (value <= params.max_number)
        status = jnp.where(~reply.found, NO_TAG, jnp.where(~ok, INVALID, jnp.where(
            value == state.secret, CORRECT, jnp.where(value < state.secret, HIGHER, LOWER))))
        guesses = state.guesses + 1
        status = jnp.where((status != CORRECT) & (guesses >= params.max_guesses), OUT, status)
        new = State(state.secret, guesses, state.invalid + (~ok).astype(jnp.int32), status.astype(jnp.int32),
                    status >= CORRECT)
        return jax.tree.map(lambda old, upd: jnp.where(state.done, old, upd), state, new)

    def done(self, state):
        return state.done

    def system_prompt(self, params):
        return (f"I think of a number from 1 to {params.max_number}. Guess it in at most {params.max_guesses} "
                "tries. Answer with <guess>N</guess>.")

    def message_spec(self, params):
        pieces = ("Your first guess?", "Higher.", "Lower.", f"Give a number from 1 to {params.max_number}.",
                  "No <guess> tag.", "Correct! You win.", "Out of guesses.")
        return MessageSpec((Slot("status", pieces),),
                           (MessageFamily(((START, HIGHER, LOWER, INVALID, NO_TAG),)),
                            MessageFamily(((CORRECT, OUT),), final=True)))

    def message_codes(self, state, params):
        return state.status[None]

    def reply_grammar(self, params):
        return ReplyGrammar("guess", "integer", max_digits=2, value_range=(1, params.max_number))

    def rubric(self, params):
        return (RubricPart("solved", 1.0), RubricPart("format", 0.1))

    def reward_parts(self, state, episode, params):
        return {"solved": (state.status == CORRECT).astype(jnp.float32), "format": episode.format_score}

    def metrics(self, state, episode, params):
        return {"solved": (state.status == CORRECT).astype(jnp.float32), "guesses": state.guesses.astype(jnp.float32),
                "invalid": (state.invalid > 0).astype(jnp.float32)}
