"""Tic-Tac-Toe's minimax teachers (the policies): "uniform" (a uniform draw among ALL optimal moves), "best" (the
value-keeping move that wins most often against the random opponent, `best_move_table`) and "drawn" (one uniform
draw among the value-keeping moves per board, made once, `drawn_move_table`); `teacher_move` plays them on device
with exploration, and `move_kind` names a move (win, block, centre, corner, other; first that applies).
The tables run their dynamic programme over the game's own `winner` and minimax tables: the rules live only in
`envs.tictactoe.game`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs.tictactoe import game as ttt


# Move kinds (first that applies).
MOVE_WIN, MOVE_BLOCK, MOVE_CENTRE, MOVE_CORNER, MOVE_OTHER = 0, 1, 2, 3, 4
MOVE_KIND_NAMES = ("win", "block", "centre", "corner", "other")
MAX_MODEL_MOVES = 5  # X makes at most 5 moves in a game
CORNERS = (0, 2, 6, 8)


def move_kind(board: jax.Array, move: jax.Array) -> jax.Array:
    """int8[9] board (X to move), int32[] free cell -> int8[]: MOVE_WIN / BLOCK / CENTRE / CORNER / OTHER.

    Win: some line through `move` already holds two X; block: some line through it holds two O.
    Jittable and vmappable."""
    board = jnp.asarray(board)
    move = jnp.asarray(move, jnp.int32)
    lines = jnp.asarray(ttt.LINES)  # [8, 3]
    through = (lines == move).any(-1)  # lines containing the cell
    values = board[lines]  # [8, 3]; the move's own cell is empty
    wins = (through & ((values == ttt.X).sum(-1) == 2)).any()
    blocks = (through & ((values == ttt.O).sum(-1) == 2)).any()
    corner = (move == 0) | (move == 2) | (move == 6) | (move == 8)
    kind = jnp.where(wins, MOVE_WIN, jnp.where(blocks, MOVE_BLOCK, jnp.where(
        move == 4, MOVE_CENTRE, jnp.where(corner, MOVE_CORNER, MOVE_OTHER))))
    return kind.astype(jnp.int8)


TEACHERS = ("uniform", "best", "drawn")
DETERMINISTIC_TEACHERS = ("best", "drawn")  # a fixed move per board: their whole game tree is finite
DRAWN_SEED = 0  # the seed of the "drawn" teacher's one-off draw (`drawn_move_table`)


@functools.lru_cache(maxsize=None)
def best_move_table() -> np.ndarray:
    """-> int8[3^9]: the `best` teacher's move for X to move on each board (row `board_index`), -1 where none.

    Among the moves that keep the game-theoretic value (win / draw / loss under perfect play, so the teacher
    never loses a drawn position to any opponent), the one with the highest probability of winning against
    the uniformly random opponent (p = 1) when X keeps following this policy; ties go to the lowest cell.
    Exact dynamic programming over every board on the host (about 6 000 positions, well under a second).
    Against the random opponent it wins 95.6 % of games (first mover drawn at random; see
    `teacher_win_rate_vs_random`), against the optimal one it draws all; the uniform teacher wins 87.3 %.
    """
    score = np.asarray(ttt.minimax_table()).astype(np.int32)  # [3^9, 2]: column 0 X to move, 1 O to move
    value = np.sign(score)
    pow3 = 3 ** np.arange(9)
    won, full = ttt.terminal_tables()
    best = np.full(3 ** 9, -1, np.int8)
    memo: dict[tuple[int, int], float] = {}

    def cells(index: int) -> np.ndarray:
        return (index // pow3) % 3

    def x_win_prob(index: int, x_to_move: bool) -> float:
        key = (index, int(x_to_move))
        if key in memo:
            return memo[key]
        board = cells(index)
        if won[index] == ttt.X:
            result = 1.0
        elif won[index] == ttt.O or full[index]:
            result = 0.0
        else:
            free = np.flatnonzero(board == ttt.EMPTY)
            if x_to_move:
                keep = [c for c in free if -value[index + ttt.X * pow3[c], 1] == value[index, 0]]
                probs = [x_win_prob(index + ttt.X * pow3[c], False) for c in keep]
                choice = int(np.argmax(probs))  # first maximum: the lowest cell
                best[index] = keep[choice]
                result = probs[choice]
            else:
                result = float(np.mean([x_win_prob(index + ttt.O * pow3[c], True) for c in free]))
        memo[key] = result
        return result

    # Every board X can face: the empty board (X first) and each O opening (O first).
    x_win_prob(0, True)
    for c in range(9):
        x_win_prob(ttt.O * int(pow3[c]), True)
    # Boards X never meets under its own policy still get a move (the rollout may reach them by sampling).
    for index in range(3 ** 9):
        board = cells(index)
        n_x, n_o = (board == ttt.X).sum(), (board == ttt.O).sum()
        if best[index] < 0 and n_o - 1 <= n_x <= n_o:
            x_win_prob(index, True)
    return best


@functools.lru_cache(maxsize=None)
def drawn_move_table(seed: int = DRAWN_SEED) -> np.ndarray:
    """-> int8[3^9]: the `drawn` teacher's move for X to move on each board (row `board_index`), -1 where none.

    The uniform teacher made deterministic: on each board, one uniform draw among the moves that keep the
    game-theoretic value (the same moves as `best_move_table` chooses from), made once with
    `np.random.default_rng(seed)` over the boards in index order and then fixed. Unlike `best` it knows
    nothing of which of those moves win more often; like `best` it never loses a drawn position, and its
    games against every opponent form a small tree (`exhaustive_expert_games("drawn")`). Its exact win rate
    against the random opponent is `teacher_win_rate_vs_random("drawn")`.
    """
    score = np.asarray(ttt.minimax_table()).astype(np.int32)
    value = np.sign(score)
    pow3 = 3 ** np.arange(9)
    won, full = ttt.terminal_tables()
    rng = np.random.default_rng(seed)
    table = np.full(3 ** 9, -1, np.int8)
    for index in range(3 ** 9):
        board = (index // pow3) % 3
        n_x, n_o = (board == ttt.X).sum(), (board == ttt.O).sum()
        if won[index] or full[index] or not n_o - 1 <= n_x <= n_o:
            continue
        keep = [c for c in np.flatnonzero(board == ttt.EMPTY) if -value[index + ttt.X * pow3[c], 1] == value[index, 0]]
        table[index] = keep[int(rng.integers(len(keep)))]
    return table


def move_table(kind: str) -> np.ndarray:
    """The fixed move table of a deterministic teacher kind ("best" or "drawn")."""
    if kind == "best":
        return best_move_table()
    if kind == "drawn":
        return drawn_move_table()
    raise ValueError(f"teacher kind {kind!r} has no fixed move table; use one of {DETERMINISTIC_TEACHERS}")


def teacher_win_rate_vs_random(kind: str = "best") -> float:
    """A deterministic teacher's exact win probability against the random opponent, first mover 50 / 50."""
    table = move_table(kind)
    pow3 = 3 ** np.arange(9)
    won, full = ttt.terminal_tables()

    def prob(index: int, x_to_move: bool) -> float:
        board = (index // pow3) % 3
        if won[index] == ttt.X:
            return 1.0
        if won[index] == ttt.O or full[index]:
            return 0.0
        if x_to_move:
            return prob(index + ttt.X * int(pow3[table[index]]), False)
        free = np.flatnonzero(board == ttt.EMPTY)
        return float(np.mean([prob(index + ttt.O * int(pow3[c]), True) for c in free]))

    return 0.5 * prob(0, True) + 0.5 * prob(0, False)


def teacher_move(board: jax.Array, uniform: jax.Array, bits: jax.Array,
                 random_move_prob: jax.Array, teacher: str = "uniform") -> tuple[jax.Array, jax.Array]:
    """int8[9] board (X to move), f32[] uniform in [0, 1), uint32[] random bits, f32[] p ->
    (int32[] cell, bool[] explored).

    Explores (a uniformly random free cell) when uniform < p; otherwise `teacher` "uniform" draws uniformly among
    all optimal X moves (`ttt.optimal_moves`), "best" plays `best_move_table()` and "drawn" `drawn_move_table()`
    (both deterministic).
    The random numbers come in as arguments (drawn for all games and turns at once by the caller): one vectorized
    draw compiles far faster on CPU than a key split per game and turn."""
    if teacher not in TEACHERS:
        raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    free = ttt.legal_moves(board)
    best = ttt.optimal_moves(board, ttt.X)
    explored = uniform < random_move_prob
    allowed = jnp.where(explored | ~best.any(), free, best)
    count = allowed.sum(dtype=jnp.uint32)
    target = (bits % jnp.maximum(count, 1)).astype(jnp.int32)  # the target-th allowed cell (0-based)
    move = jnp.argmax(jnp.cumsum(allowed.astype(jnp.int32)) > target)
    if teacher in DETERMINISTIC_TEACHERS:
        chosen = jnp.asarray(move_table(teacher))[ttt.board_index(board)].astype(move.dtype)
        move = jnp.where(explored | (chosen < 0), move, chosen)
    return move.astype(jnp.int32), explored
