"""The 8 symmetries of the Tic-Tac-Toe board (rotations and reflections) and the SFT games they give.

`SYMMETRIES[s]` is a cell permutation: cell c (row-major, 0..8) goes to `SYMMETRIES[s][c]`; s = 0 is the
identity. The rules, the minimax values and the move kinds (win, block, centre, corner, other) are invariant
under every one, so the image of a teacher's game is a game of the same teacher (up to its tie-breaks) against
the image of the opponent: 8 games for the price of one (`[sft.teacher] symmetries = true`).
"""

from __future__ import annotations

import numpy as np

from envs.tictactoe.expert_games import ExpertGames


def _perm(f) -> np.ndarray:
    return np.array([f(c // 3, c % 3)[0] * 3 + f(c // 3, c % 3)[1] for c in range(9)], np.int64)


SYMMETRIES = np.stack([
    _perm(lambda r, c: (r, c)),  # identity
    _perm(lambda r, c: (c, 2 - r)),  # rotation by 90 degrees (clockwise)
    _perm(lambda r, c: (2 - r, 2 - c)),  # 180
    _perm(lambda r, c: (2 - c, r)),  # 270
    _perm(lambda r, c: (r, 2 - c)),  # mirror left-right
    _perm(lambda r, c: (2 - r, c)),  # mirror top-bottom
    _perm(lambda r, c: (c, r)),  # main diagonal
    _perm(lambda r, c: (2 - c, 2 - r)),  # anti-diagonal
])


def transform_board(board: np.ndarray, s: int) -> np.ndarray:
    """int[..., 9] boards -> their image under symmetry s (the piece on cell c moves to SYMMETRIES[s][c])."""
    board = np.asarray(board)
    out = np.empty_like(board)
    out[..., SYMMETRIES[s]] = board
    return out


def transform_cells(cells: np.ndarray, s: int) -> np.ndarray:
    """int[...] cells (-1: none, kept) -> their images under symmetry s."""
    cells = np.asarray(cells)
    return np.where(cells >= 0, SYMMETRIES[s][np.clip(cells, 0, 8)], cells).astype(cells.dtype)


def symmetric_games(games: ExpertGames) -> ExpertGames:
    """N expert games (NumPy) -> 8N: each game's 8 images, symmetry-major (the first N are the games)."""
    games = ExpertGames(*[np.asarray(v) for v in games])
    parts = []
    for s in range(len(SYMMETRIES)):
        parts.append(games._replace(
            first_board=transform_board(games.first_board, s), first_last_opp=transform_cells(games.first_last_opp, s),
            boards=transform_board(games.boards, s), moves=transform_cells(games.moves, s),
            after_boards=transform_board(games.after_boards, s), last_opp=transform_cells(games.last_opp, s)))
    return ExpertGames(*[np.concatenate([getattr(p, f) for p in parts]) for f in ExpertGames._fields])
