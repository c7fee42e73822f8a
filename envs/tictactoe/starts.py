"""Tic-Tac-Toe's exploring starts: a game that begins from a random mid-game position (a curriculum option).

`Stage.start_moves = m > 0` (the `[grpo.curriculum]` table) makes each game draw n uniform in 0..m from its
seed and, after the normal `game.reset`, play n rounds of a uniformly random X move and a uniformly random O
reply before the model's first turn. A round that would end the game (a line or a full board) is not played,
and neither are the rounds after it, so the model always starts in a live position, X to move. The first
message then reads "Opponent (O) played at position k." with the whole board (status OPP_MOVED, k the last
random O move), exactly a mid-game message; with n = 0 the game is the normal one. The opponent that follows
is the game's own, at the example's p. Threats and forks, rare from the empty board against a strong
opponent, then come up often (the reference talk's "exploring starts"; Chess-R1 trains from puzzles).

The draws are fold_in(PRNGKey(seed), SALT_START * 2^18 + i) words (`envs.prng`), so the games of a GRPO
group (the same seed) share their start; the opponent's own draws are unchanged. Pure and jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from envs.prng import fold_in_words, pick_set_bit, unit_float
from envs.tictactoe.rules import EMPTY, NUM_CELLS, O, STATUS_OPP_MOVED, X, State, winner

MAX_START_MOVES = 3  # rounds of random X and O moves before the model's first turn (7 pieces at most)
_SALT_START = 3  # distinct from the opponent's salts (first mover 1, moves 2)


def _free_bits(board: jax.Array) -> jax.Array:
    """int8[9] -> int32[]: the mask of the empty cells."""
    return jnp.sum(jnp.where(board == EMPTY, jnp.left_shift(1, jnp.arange(NUM_CELLS)), 0)).astype(jnp.int32)


def _place(board: jax.Array, cell: jax.Array, mark: int) -> jax.Array:
    return jnp.where(jnp.arange(NUM_CELLS) == cell, jnp.int8(mark), board)


def num_start_rounds(seed: jax.Array, start_moves: jax.Array) -> jax.Array:
    """uint32[] seed, int32[] m -> int32[]: the rounds n the game asks for, uniform in 0..m."""
    words = fold_in_words(seed, jnp.uint32(_SALT_START << 18))
    m = jnp.clip(jnp.asarray(start_moves, jnp.int32), 0, MAX_START_MOVES)
    return jnp.minimum((unit_float(words[0]) * (m + 1).astype(jnp.float32)).astype(jnp.int32), m)


def exploring_start(state: State, start_moves: jax.Array) -> State:
    """A reset State (the model to move), int32[] m -> the State after n (uniform in 0..m, drawn from the
    state's seed) rounds of a random X move and a random O reply; rounds that would end the game are not
    played (see the module docstring). m = 0 returns the state unchanged."""
    seed = state.seed
    n = num_start_rounds(seed, start_moves)
    board, last, status = state.board, state.last_opponent_move, state.status
    going = jnp.bool_(True)
    for i in range(MAX_START_MOVES):
        words = fold_in_words(seed, jnp.uint32((_SALT_START << 18) | (i + 1)))
        free = _free_bits(board)
        x = pick_set_bit(free, words[0], NUM_CELLS)
        after_x = _place(board, x, X)
        free_o = free & ~jnp.left_shift(1, jnp.clip(x, 0, NUM_CELLS - 1))
        o = pick_set_bit(free_o, words[1], NUM_CELLS)
        after_o = _place(after_x, o, O)
        ends = (winner(after_x) != EMPTY) | (winner(after_o) != EMPTY) | (x < 0) | (o < 0) | (free_o == 0)
        ends |= jnp.all(after_o != EMPTY)  # no cell left for the model
        going = going & (i < n) & ~ends
        board = jnp.where(going, after_o, board)
        last = jnp.where(going, o, last).astype(state.last_opponent_move.dtype)
        status = jnp.where(going, STATUS_OPP_MOVED, status).astype(state.status.dtype)
    return state._replace(board=board, last_opponent_move=last, status=status)


def start_boards(seeds: np.ndarray, start_moves: int) -> np.ndarray:
    """Host helper (tests, inspection): uint32[N] seeds, m -> int8[N, 9] the boards the model starts from
    (the opponent's opening at p = 0 when it moves first)."""
    from envs.tictactoe import game

    seeds = jnp.asarray(seeds, jnp.uint32)

    def one(seed):
        return exploring_start(game.reset(seed, jnp.float32(0.0)), jnp.int32(start_moves)).board

    return np.asarray(jax.jit(jax.vmap(one))(seeds))
