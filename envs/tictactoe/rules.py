"""Tic-Tac-Toe's rules: the board, the constants, the `State` and the readable rules, plus their bitboard form.

- Board: `int8[9]`, cells row-major, `EMPTY`/`X`/`O` = 0/1/2.
- The readable rules (`winner` with its table of 8 lines, `legal_moves`, `board_index`) define the game and
  build the tables (`envs.tictactoe.minimax`); `envs.tictactoe.game.step` runs the same rules on bitboards
  (an int32 mask of cells per player, the `_`-prefixed helpers here) so a step costs one reduction over the
  board and a few integer ops and table reads.
- Malformed boards have defined results: out-of-range cells count as occupied and are clipped to 0..2 in
  the index; `valid_board` says whether a board is well formed (cells in 0..2, |#X - #O| <= 1, not both
  players with a line).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# ---------------------------------------------------------------------------------------------------
# Constants (see docs/CONTRACTS.md)

EMPTY, X, O = 0, 1, 2

STATUS_START_MODEL_FIRST = 0  # "Game started. You are X."
STATUS_START_OPP_FIRST = 1  # "Game started. Opponent (O) played at position {k}."
STATUS_OPP_MOVED = 2  # "Opponent (O) played at position {k}."
STATUS_INVALID = 3  # "Invalid move."
STATUS_NO_MOVE = 4  # "Please provide a move inside <move>...</move> tags."
STATUS_WIN = 5  # "You win!"  (final)
STATUS_DRAW = 6  # "It's a draw!"  the model's move filled the board (final)
STATUS_LOSS = 7  # "Opponent (O) played at position {k}. You lose!"  (final)
STATUS_OPP_DRAW = 8  # "Opponent (O) played at position {k}. It's a draw!"  (final)
NUM_STATUS = 9

OUTCOME_ONGOING, OUTCOME_WIN, OUTCOME_DRAW, OUTCOME_LOSS = 0, 1, 2, 3
OUTCOME_NAMES = {OUTCOME_ONGOING: "ongoing", OUTCOME_WIN: "win", OUTCOME_DRAW: "draw", OUTCOME_LOSS: "loss"}

NO_MOVE = -1  # parser result: no <move> tag in the reply
INVALID_MOVE = 9  # parser result: a tag whose content is not a cell 0..8

NUM_CELLS = 9
NUM_BOARDS = 3**NUM_CELLS  # 19 683

# The 8 winning lines, row-major cells.
LINES = np.array(
    [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]],
    dtype=np.int32,
)
POW3 = (3 ** np.arange(NUM_CELLS)).astype(np.int32)  # cell 0 is the least significant digit

# ---------------------------------------------------------------------------------------------------
# State


class State(NamedTuple):
    """One game (a pytree; for a batch every field gains a leading axis)."""

    board: jax.Array  # int8[9]: 0 empty, 1 X, 2 O
    to_play: jax.Array  # int8[]: 1 model to move, 0 when done
    turns: jax.Array  # int32[]: model replies consumed (valid, invalid and missing)
    invalid_moves: jax.Array  # int32[]: replies with a tag that is not a free cell
    missing_moves: jax.Array  # int32[]: replies without a <move> tag
    done: jax.Array  # bool[]
    outcome: jax.Array  # int8[]: OUTCOME_*
    last_opponent_move: jax.Array  # int8[]: -1 before the opponent has moved
    status: jax.Array  # int8[]: STATUS_* of the next environment message
    seed: jax.Array  # uint32[]: the example's seed
    random_move_prob: jax.Array  # float32[]: p of the opponent's mixture


# ---------------------------------------------------------------------------------------------------
# Rules


def winner(board: jax.Array) -> jax.Array:
    """int8[9] board -> int8[]: 0 no line, 1 X has three in a row, 2 O has (X is checked first)."""
    lines = board[..., LINES]  # [..., 8, 3]
    x_won = (lines == X).all(-1).any(-1)
    o_won = (lines == O).all(-1).any(-1)
    return jnp.where(x_won, jnp.int8(X), jnp.where(o_won, jnp.int8(O), jnp.int8(EMPTY)))


def legal_moves(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[9]: the free cells (does not look at whether the game is over)."""
    return board == EMPTY


def board_index(board: jax.Array) -> jax.Array:
    """int8[9] board -> int32[] in [0, 3^9): base 3, cell 0 least significant (cells clipped to 0..2)."""
    digits = jnp.clip(board.astype(jnp.int32), EMPTY, O)
    return (digits * POW3).sum(-1)


# Bitboards: bit c of an int32 is cell c. They make the per-move checks of `step` a few integer ops.
_FULL = (1 << NUM_CELLS) - 1
_LINE_MASKS = tuple(sum(1 << int(c) for c in line) for line in LINES)
_CELL_BITS = 1 << np.arange(NUM_CELLS, dtype=np.int32)


def _compact(bits: jax.Array) -> jax.Array:
    """int32[] with a bit at each even position 0, 2, .., 16 -> those 9 bits side by side."""
    bits = (bits | (bits >> 1)) & 0x33333333
    bits = (bits | (bits >> 2)) & 0x0F0F0F0F
    bits = (bits | (bits >> 4)) & 0x00FF00FF
    return (bits | (bits >> 8)) & 0x0000FFFF


_EVEN = sum(1 << (2 * c) for c in range(NUM_CELLS))


def _bitboards(board: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int8[9] -> (X cells int32[], O cells int32[], every cell in 0..2 bool[]), from one reduction.

    Each cell becomes a 2-bit field (its value, 3 for anything outside 0..2: the unsigned minimum
    with 3), packed by one sum of cheap terms; X cells are the fields 1, O cells the fields 2 (exact
    on any board), and a field 3 marks a cell out of range.
    """
    fields = jnp.minimum(board.astype(jnp.uint8), jnp.uint8(3)).astype(jnp.int32)
    packed = (fields << (2 * np.arange(NUM_CELLS, dtype=np.int32))).sum(-1)
    low, high = packed & _EVEN, (packed >> 1) & _EVEN
    return _compact(low & ~high), _compact(high & ~low), (low & high) == 0


def _line_table() -> np.ndarray:
    """-> bool[512]: entry m is whether the cells of bit mask m hold one of the 8 lines."""
    masks = np.arange(1 << NUM_CELLS)[:, None]
    lines = np.array(_LINE_MASKS)[None, :]
    return ((masks & lines) == lines).any(1)


_HAS_LINE = _line_table()


def _has_line(bits: jax.Array) -> jax.Array:
    """int32[] cells of one player -> bool[]: three in a row (`winner` on a bit mask; a table read)."""
    return jnp.asarray(_HAS_LINE)[bits & _FULL]


def _consistent(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> bool[]: disjoint, |#X - #O| <= 1, and not both players with a line."""
    diff = jax.lax.population_count(xs) - jax.lax.population_count(os)
    return ((xs & os) == 0) & (jnp.abs(diff) <= 1) & ~(_has_line(xs) & _has_line(os))


def _index_of(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> int32[] board_index (elementwise, no reduction)."""
    index = jnp.zeros(jnp.shape(xs), jnp.int32)
    for cell in range(NUM_CELLS):
        digit = ((xs >> cell) & 1) + 2 * ((os >> cell) & 1)
        index = index + digit * int(POW3[cell])
    return index


def _cells_of(bits: jax.Array) -> jax.Array:
    """int32[] 9-bit mask -> bool[9]."""
    return ((bits[..., None] >> np.arange(NUM_CELLS, dtype=np.int32)) & 1) == 1


def is_finished(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[]: someone has three in a row or no cell is free."""
    return (winner(board) != EMPTY) | ~legal_moves(board).any(-1)


def valid_board(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[]: cells in 0..2, |#X - #O| <= 1 and not both players with a line."""
    xs, os, in_range = _bitboards(board)
    return in_range & _consistent(xs, os)


@functools.lru_cache(maxsize=1)
def terminal_tables() -> tuple[np.ndarray, np.ndarray]:
    """(winner int8[3^9], full bool[3^9]) of every board (row `board_index`), from the game's own `winner`
    and `legal_moves` (computed once, concretely, even when first asked for inside a trace)."""
    boards = ((np.arange(NUM_BOARDS)[:, None] // POW3) % 3).astype(np.int8)
    with jax.ensure_compile_time_eval():
        won = np.asarray(jax.vmap(winner)(jnp.asarray(boards)))
        full = ~np.asarray(jax.vmap(legal_moves)(jnp.asarray(boards))).any(1)
    return won, full
