"""An independent, pure-Python Connect Four: the rules and the opponent's search, written from the spec.

The spec (the docstring of `envs/connect_four/game.py`): 6 rows x 7 columns, a piece lands on the lowest
free cell of its column, four in a row in any of the four directions wins, a full board is a draw. The
search is a full-width negamax of `depth` plies; from the side to move's point of view a node where the
previous mover connected four at ply L (L = 1 for the root's children) is worth L - WIN, a full board 0,
a node at ply == depth the open-line evaluation (each line of four with k >= 1 pieces of one side and
none of the other scores 4^(k-1) for that side: the side to move's total minus the other's), and an
inner node the maximum over its legal columns of minus the child's value.

Nothing here imports the JAX code: boards are lists of 6 rows (row 0 at the bottom) of 7 ints
(0 empty, 1 X, 2 O), and the lines are enumerated again from the definition.
"""

from __future__ import annotations

import random

ROWS, COLUMNS = 6, 7
WIN = 1 << 20


def new_board() -> list[list[int]]:
    return [[0] * COLUMNS for _ in range(ROWS)]


def lines() -> list[list[tuple[int, int]]]:
    """Every line of four cells inside the board (69 of them)."""
    out = []
    for r in range(ROWS):
        for c in range(COLUMNS):
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                cells = [(r + i * dr, c + i * dc) for i in range(4)]
                if all(0 <= a < ROWS and 0 <= b < COLUMNS for a, b in cells):
                    out.append(cells)
    return out


LINES = lines()


def legal(board) -> list[int]:
    """The columns whose top cell is empty."""
    return [c for c in range(COLUMNS) if board[ROWS - 1][c] == 0]


def drop(board, column: int, player: int) -> list[list[int]]:
    """A new board with `player`'s piece on the lowest free cell of `column` (ValueError if full)."""
    for r in range(ROWS):
        if board[r][column] == 0:
            out = [row[:] for row in board]
            out[r][column] = player
            return out
    raise ValueError(f"column {column} is full")


def winner(board) -> int:
    """1 or 2 if that player has four in a line, else 0."""
    for line in LINES:
        values = {board[r][c] for r, c in line}
        if len(values) == 1 and 0 not in values:
            return values.pop()
    return 0


def full(board) -> bool:
    return all(board[ROWS - 1][c] != 0 for c in range(COLUMNS))


def evaluate(board, me: int) -> int:
    """The open-line evaluation for `me` (1 or 2)."""
    other = 3 - me
    total = 0
    for line in LINES:
        mine = sum(board[r][c] == me for r, c in line)
        theirs = sum(board[r][c] == other for r, c in line)
        if mine and not theirs:
            total += 4 ** (mine - 1)
        elif theirs and not mine:
            total -= 4 ** (theirs - 1)
    return total


def _value(board, me: int, ply: int, depth: int) -> int:
    """The negamax value for `me`, to move at a node `ply` plies below the root (not a finished game)."""
    best = None
    for c in legal(board):
        child = drop(board, c, me)
        if winner(child):
            v = WIN - (ply + 1)
        elif full(child):
            v = 0
        elif ply + 1 == depth:
            v = -evaluate(child, 3 - me)
        else:
            v = -_value(child, 3 - me, ply + 1, depth)
        best = v if best is None else max(best, v)
    return best


def root_values(board, me: int, depth: int) -> dict[int, int]:
    """{column: value for `me`} over the legal columns of a live position, searched `depth` plies."""
    out = {}
    for c in legal(board):
        child = drop(board, c, me)
        if winner(child):
            out[c] = WIN - 1
        elif full(child):
            out[c] = 0
        elif depth == 1:
            out[c] = -evaluate(child, 3 - me)
        else:
            out[c] = -_value(child, 3 - me, 1, depth)
    return out


def best_columns(board, me: int, depth: int) -> set[int]:
    """The columns of maximal value."""
    values = root_values(board, me, depth)
    top = max(values.values())
    return {c for c, v in values.items() if v == top}


def random_position(rng: random.Random, plies: int) -> tuple[list[list[int]], int] | None:
    """A position after `plies` random moves with X first (None if the game ended), and the side to move."""
    board, player = new_board(), 1
    for _ in range(plies):
        board = drop(board, rng.choice(legal(board)), player)
        if winner(board) or full(board):
            return None
        player = 3 - player
    return board, player
