"""Whole games on device with a uniformly random model side: the environment demo (`jaxrl-llm demo`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from envs.tictactoe import game as ttt
from envs.tictactoe.env import outcome_rates


def random_legal_move(key: jax.Array, board: jax.Array) -> jax.Array:
    """A uniformly random free cell of `board` int8[9] -> int32[] (-1 on a full board)."""
    legal = ttt.legal_moves(board)
    logits = jnp.where(legal, 0.0, -jnp.inf)
    move = jax.random.categorical(key, logits).astype(jnp.int32)
    return jnp.where(legal.any(), move, -1)


@functools.partial(jax.jit, static_argnames=("num_games",))
def random_games(key: jax.Array, num_games: int, random_move_prob: float):
    """Plays `num_games` games to the end; returns the final `State` batch (leading axis num_games)."""
    seed_key, move_key = jax.random.split(key)
    seeds = jax.random.bits(seed_key, (num_games,), jnp.uint32)
    p = jnp.full((num_games,), random_move_prob, jnp.float32)
    state = jax.vmap(ttt.reset)(seeds, p)

    def ply(state, step_key):
        keys = jax.random.split(step_key, num_games)
        moves = jax.vmap(random_legal_move)(keys, state.board)
        return jax.vmap(ttt.step)(state, moves), None

    # The model moves at most 5 times in a game; every step below is a legal move.
    state, _ = jax.lax.scan(ply, state, jax.random.split(move_key, 5))
    return state


def play_random_games(key: jax.Array, num_games: int, random_move_prob: float) -> dict[str, float]:
    """Win/draw/loss rates of a random legal mover against the opponent with probability p of random moves."""
    state = random_games(key, num_games, float(random_move_prob))
    rates = outcome_rates(state.outcome, state.done)
    return {k: rates[k] for k in ("win", "draw", "loss")}
