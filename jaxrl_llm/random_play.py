"""Whole games on device with a uniformly random model side: the environment demo and a baseline."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from envs import tictactoe as ttt


def random_legal_move(key: jax.Array, board: jax.Array) -> jax.Array:
    """A uniformly random free cell of `board` int8[9] -> int32[] (-1 on a full board)."""
    legal = ttt.legal_moves(board)
    logits = jnp.where(legal, 0.0, -jnp.inf)
    move = jax.random.categorical(key, logits).astype(jnp.int32)
    return jnp.where(legal.any(), move, -1)


@functools.partial(jax.jit, static_argnames=("num_games", "params"))
def random_games(key: jax.Array, num_games: int, random_move_prob: float, params: ttt.EnvParams = ttt.EnvParams()):
    """Plays `num_games` games to the end; returns the final `State` batch (leading axis num_games)."""
    seed_key, move_key = jax.random.split(key)
    seeds = jax.random.bits(seed_key, (num_games,), jnp.uint32)
    p = jnp.full((num_games,), random_move_prob, jnp.float32)
    state = jax.vmap(ttt.reset, in_axes=(0, 0, None))(seeds, p, params)

    def ply(state, step_key):
        keys = jax.random.split(step_key, num_games)
        moves = jax.vmap(random_legal_move)(keys, state.board)
        return jax.vmap(ttt.step, in_axes=(0, 0, None))(state, moves, params), None

    # The model moves at most 5 times in a game; every step below is a legal move.
    state, _ = jax.lax.scan(ply, state, jax.random.split(move_key, 5))
    return state


def play_random_games(key: jax.Array, num_games: int, random_move_prob: float) -> dict[str, float]:
    """Win/draw/loss rates of a random legal mover against the opponent with probability p of random moves."""
    state = random_games(key, num_games, float(random_move_prob))
    outcome = jax.device_get(state.outcome)
    return {
        "win": float((outcome == ttt.OUTCOME_WIN).mean()),
        "draw": float((outcome == ttt.OUTCOME_DRAW).mean()),
        "loss": float((outcome == ttt.OUTCOME_LOSS).mean()),
    }
