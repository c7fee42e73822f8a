"""Nim against a scripted opponent: a complete environment of the protocol, written outside the package.

The README's "Write your own environment" section shows this file verbatim (a test checks it).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

import envs

START, TOOK, INVALID, NO_TAG, WON, LOST = 0, 1, 4, 5, 6, 7   # status codes; TOOK + k - 1: "took k"
MAX_STONES = 20


class State(NamedTuple):
    stones: jax.Array; status: jax.Array; done: jax.Array; won: jax.Array        # noqa: E702
    invalid: jax.Array; seed: jax.Array; p: jax.Array                             # noqa: E702


@dataclasses.dataclass(frozen=True)
class Stage:
    p_min: float = 0.0    # the opponent's random-move probability, uniform in [p_min, p_max]
    p_max: float = 1.0


@dataclasses.dataclass(frozen=True)
class Params:
    format_weight: float = 0.1


class Nim(envs.Env):
    """Take 1-3 stones a turn; whoever takes the last stone wins. The opponent answers inside step."""

    name, Params, Stage = "nim", Params, Stage
    results_columns = (("W", "win"), ("L", "loss"), ("format", "format"), ("invalid", "invalid"))
    outcome_metrics = ("win", "loss", "unfinished")

    def sample_examples(self, key, num_prompts, group_size, stage):
        seeds = jax.random.bits(key, (num_prompts,), jnp.uint32)
        p = jax.random.uniform(jax.random.fold_in(key, 1), (num_prompts,), minval=stage.p_min, maxval=stage.p_max)
        return jnp.repeat(seeds, group_size), jnp.repeat(p, group_size)

    def eval_settings(self):
        return (envs.EvalSetting("random", Stage(1.0, 1.0)), envs.EvalSetting("optimal", Stage(0.0, 0.0)))

    def reset(self, example, params):
        seed, p = example
        stones = (5 + seed % 16).astype(jnp.int32)
        z = jnp.int32(0)
        return State(stones, jnp.int32(START), jnp.bool_(False), jnp.bool_(False), z, seed, p)

    def step(self, state, reply, params):
        take = reply.value
        legal = reply.found & reply.valid & (take >= 1) & (take <= jnp.minimum(3, state.stones))
        left = state.stones - jnp.where(legal, take, 0)
        key = jax.random.fold_in(jax.random.PRNGKey(state.seed), left)      # a pure function of (seed, stones)
        random_take = jax.random.randint(key, (), 1, jnp.maximum(jnp.minimum(3, left), 1) + 1)
        best = jnp.where(left % 4 == 0, 1, left % 4)                           # leave a multiple of 4
        reply_take = jnp.where(jax.random.uniform(jax.random.fold_in(key, 1)) < state.p, random_take, best)
        won, after = legal & (left == 0), left - jnp.where(legal & (left > 0), reply_take, 0)
        lost = legal & (left > 0) & (after == 0)
        status = jnp.select([~reply.found, ~legal, won, lost], [NO_TAG, INVALID, WON, LOST], TOOK + reply_take - 1)
        new = State(after, status.astype(jnp.int32), won | lost, won, state.invalid + (reply.found & ~legal),
                    state.seed, state.p)
        return jax.tree.map(lambda old, upd: jnp.where(state.done, old, upd), state, new)

    def done(self, state):
        return state.done

    def system_prompt(self, params):
        return "Nim: take 1, 2 or 3 stones a turn; taking the last stone wins. Reply <take>k</take>.\n"

    def message_spec(self, params):
        status = ["You start.\n", "Opponent took 1.\n", "Opponent took 2.\n", "Opponent took 3.\n",
                  "Invalid move.\n", "No <take> tag.\n", "You win!\n", "You lose!\n"]
        piles = [f"Stones: {n}\n" for n in range(MAX_STONES + 1)]
        return envs.MessageSpec((envs.Slot("status", tuple(status)), envs.Slot("pile", tuple(piles)),
                                 envs.Slot("turn", ("Your move.", ""))))

    def message_codes(self, state, params):
        return jnp.stack([state.status, state.stones, state.done.astype(jnp.int32)])

    def reply_grammar(self, params):
        return envs.ReplyGrammar(tag="take", content="cell", num_cells=4)

    def rubric(self, params):
        return (envs.RubricPart("win", 1.0), envs.RubricPart("format", params.format_weight))

    def reward_parts(self, state, episode, params):
        return {"win": state.won.astype(jnp.float32), "format": episode.format_score}

    def metrics(self, state, episode, params):
        f = lambda x: x.astype(jnp.float32)  # noqa: E731
        return {"win": f(state.won), "loss": f(state.done & ~state.won), "unfinished": f(~state.done),
                "invalid": f(state.invalid > 0)}
