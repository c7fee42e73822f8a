"""Envs a user might write with one mistake each, for `jaxrl-llm check-env` in tests/test_user_errors.py (named
there as "user_error_envs:ClassName"; pytest puts tests/ on the path). Each is the example GuessNumber env
(examples/guess_env) with one method broken."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "guess_env"))

from guess_env.env import GuessNumber  # noqa: E402


class NaNReward(GuessNumber):
    """Its 'solved' reward part is NaN in every game."""

    def reward_parts(self, state, episode, params):
        return {**super().reward_parts(state, episode, params), "solved": jnp.full((), jnp.nan, jnp.float32)}


class InfiniteMetric(GuessNumber):
    """Its 'guesses' metric is infinite in every game."""

    def metrics(self, state, episode, params):
        return {**super().metrics(state, episode, params), "guesses": jnp.float32(jnp.inf)}


class BadCodes(GuessNumber):
    """message_codes stacks a field of the wrong shape: it raises inside the env's code."""

    def message_codes(self, state, params):
        return jnp.stack([state.status, jnp.zeros((2,), jnp.int32)])


class RaisingReward(GuessNumber):
    """reward_parts raises a KeyError of its own."""

    def reward_parts(self, state, episode, params):
        return {"solved": {}["no such key"]}


class NaNTurnReward(GuessNumber):
    """turn_reward is NaN."""

    def turn_reward(self, prev_state, state, params):
        return jnp.float32(jnp.nan)
