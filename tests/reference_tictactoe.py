"""An independent pure-Python reference of the Tic-Tac-Toe task (no import of `envs`).

Written from shared/TICTACTOE_SPEC.md alone: recursive minimax with a memo and the spec's
depth-weighted scoring, the rules of one model reply, and the reward rubric. Boards are tuples of
9 ints (0 empty, 1 X, 2 O), cells row-major.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

EMPTY, X, O = 0, 1, 2
WIN_LINES = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),  # rows
    (0, 3, 6), (1, 4, 7), (2, 5, 8),  # columns
    (0, 4, 8), (2, 4, 6),  # diagonals
)  # fmt: skip


def other(player: int) -> int:
    return O if player == X else X


def ref_winner(board: tuple[int, ...]) -> int:
    """0 none, else the player with three in a row (X reported first if both had one)."""
    for player in (X, O):
        for a, b, c in WIN_LINES:
            if board[a] == board[b] == board[c] == player:
                return player
    return EMPTY


def ref_legal(board: tuple[int, ...]) -> list[bool]:
    return [v == EMPTY for v in board]


def ref_finished(board: tuple[int, ...]) -> bool:
    return ref_winner(board) != EMPTY or EMPTY not in board


def ref_index(board: tuple[int, ...]) -> int:
    return sum(int(v) * 3**i for i, v in enumerate(board))


@functools.lru_cache(maxsize=None)
def ref_score(board: tuple[int, ...], to_move: int) -> int:
    """Depth-weighted minimax score for `to_move`: win +(1 + free), loss -(1 + free), draw 0."""
    free = board.count(EMPTY)
    w = ref_winner(board)
    if w != EMPTY:
        return (1 + free) if w == to_move else -(1 + free)
    if free == 0:
        return 0
    best = None
    for cell in range(9):
        if board[cell] == EMPTY:
            child = board[:cell] + (to_move,) + board[cell + 1 :]
            value = -ref_score(child, other(to_move))
            best = value if best is None else max(best, value)
    return best


def ref_value(board: tuple[int, ...], to_move: int) -> int:
    s = ref_score(board, to_move)
    return (s > 0) - (s < 0)


def ref_optimal(board: tuple[int, ...], to_move: int) -> list[bool]:
    """Every move with the best score; all False on a finished board."""
    if ref_finished(board):
        return [False] * 9
    scores = {}
    for cell in range(9):
        if board[cell] == EMPTY:
            child = board[:cell] + (to_move,) + board[cell + 1 :]
            scores[cell] = -ref_score(child, other(to_move))
    best = max(scores.values())
    return [scores.get(c) == best for c in range(9)]


def reachable_positions() -> list[tuple[tuple[int, ...], int]]:
    """Every (board, player to move) reachable by legal alternate play from the empty board with
    either player starting, finished boards included (sorted, no duplicates)."""
    seen: set[tuple[tuple[int, ...], int]] = set()
    stack = [((EMPTY,) * 9, X), ((EMPTY,) * 9, O)]
    while stack:
        board, to_move = stack.pop()
        if (board, to_move) in seen:
            continue
        seen.add((board, to_move))
        if ref_finished(board):
            continue
        for cell in range(9):
            if board[cell] == EMPTY:
                child = board[:cell] + (to_move,) + board[cell + 1 :]
                stack.append((child, other(to_move)))
    return sorted(seen)


# Outcome and status codes of the spec's messages (same numbering as docs/CONTRACTS.md).
ONGOING, WIN, DRAW, LOSS, UNFINISHED = 0, 1, 2, 3, 4
ST_OPP_MOVED, ST_INVALID, ST_NO_MOVE, ST_WIN, ST_DRAW, ST_LOSS, ST_OPP_DRAW = 2, 3, 4, 5, 6, 7, 8


@dataclass
class RefGame:
    """One game as the spec describes it; the opponent's replies are supplied by the caller."""

    board: list[int]
    max_turns: int
    turns: int = 0
    invalid: int = 0
    missing: int = 0
    done: bool = False
    outcome: int = ONGOING
    status: int = -1
    last_opponent_move: int = -1

    def reply(self, move: int, opponent_reply) -> None:
        """Apply one model reply; `opponent_reply(board)` returns O's cell when O is to move."""
        if self.done:
            return
        self.turns += 1
        if move == -1:
            self.missing += 1
            self.status = ST_NO_MOVE
        elif not (0 <= move <= 8) or self.board[move] != EMPTY:
            self.invalid += 1
            self.status = ST_INVALID
        else:
            self.board[move] = X
            if ref_winner(tuple(self.board)) == X:
                self.done, self.outcome, self.status = True, WIN, ST_WIN
            elif EMPTY not in self.board:
                self.done, self.outcome, self.status = True, DRAW, ST_DRAW
            else:
                cell = opponent_reply(tuple(self.board))
                assert self.board[cell] == EMPTY, "the opponent must play a free cell"
                self.board[cell] = O
                self.last_opponent_move = cell
                if ref_winner(tuple(self.board)) == O:
                    self.done, self.outcome, self.status = True, LOSS, ST_LOSS
                elif EMPTY not in self.board:
                    self.done, self.outcome, self.status = True, DRAW, ST_OPP_DRAW
                else:
                    self.status = ST_OPP_MOVED
        if not self.done and self.turns >= self.max_turns:
            self.done, self.outcome = True, UNFINISHED


def ref_total_reward(outcome: int, invalid_moves: int, format_score: float) -> float:
    """The spec's rubric with its default values and weights."""
    win_part = {WIN: 1.0, DRAW: 0.5}.get(outcome, 0.0)
    invalid_part = -0.1 if invalid_moves > 0 else 0.0
    return 1.0 * win_part + 0.2 * format_score + 1.0 * invalid_part
