"""Tic-Tac-Toe's minimax table: the depth-weighted score of every board for the player to move, and the
optimal moves, built once by a jitted retrograde sweep and read by O(1) gathers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from envs.tictactoe.rules import (
    EMPTY, NUM_BOARDS, NUM_CELLS, O, POW3, X, _CELL_BITS, _cells_of, board_index, is_finished, legal_moves,
    valid_board, winner,
)

# ---------------------------------------------------------------------------------------------------
# Minimax table


def _all_boards() -> tuple[jax.Array, jax.Array]:
    """-> (index int32[3^9], board int8[3^9, 9]): every board, in index order."""
    index = jnp.arange(NUM_BOARDS, dtype=jnp.int32)
    return index, ((index[:, None] // POW3) % 3).astype(jnp.int8)


def _children(index: jax.Array, free: jax.Array) -> jax.Array:
    """int32[B], bool[B, 9] -> int32[B, 2, 9]: the index after X (row 0) or O (row 1) takes a cell."""
    players = jnp.array([X, O], jnp.int32)
    return jnp.where(free[:, None, :], index[:, None, None] + players[None, :, None] * POW3, 0)


@jax.jit
def build_minimax_table() -> jax.Array:
    """-> int8[3^9, 2]: depth-weighted minimax score for the player to move (column 0 X, 1 O).

    Scores for the player to move: a win for them +(1 + free cells), a loss -(1 + free cells) at the
    end of the game, a draw 0; negamax over the free cells. Retrograde analysis vectorized over all
    boards: the child of index b after player q takes cell c is b + q * 3^c; 9 sweeps (the longest
    game) make every entry exact. Defined for every board, reachable or not.
    """
    index, boards = _all_boards()
    free = legal_moves(boards)  # [B, 9]
    magnitude = (1 + free.sum(-1, dtype=jnp.int32))[:, None]
    won_by = winner(boards)[:, None]
    players = jnp.array([X, O], jnp.int8)
    # Terminal score for the player to move (columns: X, O).
    terminal = ((won_by != EMPTY) | ~free.any(-1, keepdims=True))
    terminal_score = jnp.where(won_by == EMPTY, 0, jnp.where(won_by == players, magnitude, -magnitude))
    children, other = _children(index, free), 1 - jnp.arange(2)[None, :, None]

    def sweep(_, score):
        # score[child, other]: the opponent's score after our move; ours is its negation.
        best = jnp.where(free[:, None, :], -score[children, other], -100).max(-1)
        return jnp.where(terminal, terminal_score, best)

    score = jax.lax.fori_loop(0, NUM_CELLS, sweep, terminal_score.astype(jnp.int32))
    return score.astype(jnp.int8)


@jax.jit
def build_optimal_table(score: jax.Array) -> jax.Array:
    """int8[3^9, 2] scores -> int32[3^9, 2]: bit c set when cell c is optimal for the player to move
    (column 0 X, 1 O); no bit on a finished board."""
    index, boards = _all_boards()
    free = legal_moves(boards)
    child_score = -score[_children(index, free), 1 - jnp.arange(2)[None, :, None]].astype(jnp.int32)
    optimal = free[:, None, :] & (child_score == score[:, :, None]) & ~is_finished(boards)[:, None, None]
    return (optimal.astype(jnp.int32) * _CELL_BITS).sum(-1)


@functools.lru_cache(maxsize=None)
def _tables() -> tuple[jax.Array, jax.Array]:
    """The cached (score int8[3^9, 2], optimal int32[3^9, 2]) tables, built once on first use."""
    with jax.ensure_compile_time_eval():  # concrete even when first called inside a trace
        score = build_minimax_table()
        optimal = build_optimal_table(score)
    return score, optimal


def minimax_table() -> jax.Array:
    """-> int8[3^9, 2]: the cached score table (row board_index, column player - 1)."""
    return _tables()[0]


def _player_column(player: jax.Array) -> tuple[jax.Array, jax.Array]:
    player = jnp.asarray(player, jnp.int32)
    return jnp.clip(player - 1, 0, 1), (player == X) | (player == O)


def minimax_score(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move (1 X / 2 O) -> int8[]: the depth-weighted score for player.

    0 on a malformed board (see `valid_board`) or for a player other than 1 or 2.
    """
    column, ok = _player_column(player)
    score = minimax_table()[board_index(board), column]
    return jnp.where(ok & valid_board(board), score, jnp.int8(0))


def minimax_value(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move -> int8[]: +1 win / 0 draw / -1 loss under perfect play."""
    return jnp.sign(minimax_score(board, player)).astype(jnp.int8)


def optimal_moves(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move -> bool[9]: every move maximizing the depth-weighted score.

    All False on a finished or malformed board, or for a player other than 1 or 2.
    """
    column, ok = _player_column(player)
    bits = _tables()[1][board_index(board), column]
    return _cells_of(bits) & ok & valid_board(board)
