"""The whole game tree of a deterministic Tic-Tac-Toe teacher ("best": 738 games, "drawn": 841), walked depth
first on the host with the game's `model_move` and `opponent_move_applied`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs.tictactoe import game as ttt
from envs.tictactoe.expert_games import ExpertGames
from envs.tictactoe.teachers import MAX_MODEL_MOVES, move_kind, move_table


@functools.lru_cache(maxsize=None)
def exhaustive_expert_games(kind: str = "best") -> ExpertGames:
    """Every game a deterministic teacher (`best`, or `drawn`) can meet, each once (NumPy ExpertGames, host).

    The teacher's moves are fixed (`move_table(kind)`), so the games it can play against ANY opponent form a
    small tree: the opponent's choices branch it (all 9 openings when O starts, every free cell at every
    reply). Its leaves are 1 000-odd complete games (a few hundred with X first), every position the teacher
    can face appears in them, and so an SFT set made of them covers every board a model that plays like the
    teacher meets in evaluation, whatever the opponent. Order: X-first games, then O-first ones, each in
    depth-first order of the opponent's cells. `random_move_prob` is -1 (no single opponent strength) and
    `seed` the game's index; statuses follow `envs.tictactoe.step`. Cached: do not modify the arrays.
    """
    table = move_table(kind)
    pow3 = 3 ** np.arange(9)
    cells = jnp.arange(9, dtype=jnp.int32)

    @jax.jit
    def expand(states: ttt.State, moves: jax.Array):
        """[R] states, int32[R] X moves -> (states after X, [R, 9] states after O on each cell)."""
        after = jax.vmap(ttt.model_move)(states, moves)
        return after, jax.vmap(jax.vmap(ttt.opponent_move_applied, in_axes=(None, 0)), in_axes=(0, None))(after, cells)

    def expand_all(states, moves, chunk: int = 256):
        """`expand` in fixed-size chunks (one compiled shape; the last chunk padded with copies of row 0)."""
        n = len(moves)
        pad = -n % chunk
        states, moves = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[:1], pad, 0)]), (states, moves))
        parts = [jax.device_get(expand(jax.tree.map(lambda x: x[i:i + chunk], states), moves[i:i + chunk]))
                 for i in range(0, n + pad, chunk)]
        return jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *parts)

    # The walk goes one model move at a time over the whole frontier (batched calls of the game's own
    # functions); each line carries its path of opponent cells, and sorting the finished games by path
    # gives the depth-first order (the paths are prefix-free: a finished game has no continuation).
    empty = np.zeros(9, np.int8)
    start = ttt.State(board=empty, to_play=np.int8(1), turns=np.int32(0), invalid_moves=np.int32(0),
                      missing_moves=np.int32(0), done=np.bool_(False), outcome=np.int8(ttt.OUTCOME_ONGOING),
                      last_opponent_move=np.int8(-1), status=np.int8(ttt.STATUS_START_MODEL_FIRST),
                      seed=np.uint32(0), random_move_prob=np.float32(0.0))
    openings = [(empty, ttt.STATUS_START_MODEL_FIRST, -1, (0,))]
    for opening in range(9):
        board = empty.copy()
        board[opening] = ttt.O
        openings.append((board, ttt.STATUS_START_OPP_FIRST, opening, (1, opening)))
    frontier = jax.tree.map(lambda *xs: np.stack(xs), *[
        start._replace(board=b, status=np.int8(st), last_opponent_move=np.int8(k)) for b, st, k, _ in openings])
    lines = [((b, st, k), [], path) for b, st, k, path in openings]  # (first message, turns, path) per row
    games: list[tuple] = []
    while lines:
        boards = np.asarray(frontier.board)
        moves = table[(boards.astype(np.int64) * pow3).sum(1)].astype(np.int32)
        after, replies = expand_all(frontier, moves)  # replies [rows, 9]: O on each cell (free ones used)
        keep_rows, keep_cells, next_lines = [], [], []
        for r, (first, turns, path) in enumerate(lines):
            if after.done[r]:
                games.append((path, first, turns + [(boards[r], int(moves[r]), after.board[r], int(after.status[r]),
                                                     int(after.last_opponent_move[r]))]))
                continue
            for c in np.flatnonzero(after.board[r] == ttt.EMPTY):
                turn = (boards[r], int(moves[r]), replies.board[r, c], int(replies.status[r, c]), int(c))
                if replies.done[r, c]:
                    games.append((path + (int(c),), first, turns + [turn]))
                else:
                    keep_rows.append(r)
                    keep_cells.append(c)
                    next_lines.append((first, turns + [turn], path + (int(c),)))
        frontier = jax.tree.map(lambda x: x[np.array(keep_rows, int), np.array(keep_cells, int)], replies)
        lines = next_lines
    games = [(first, turns) for _, first, turns in sorted(games, key=lambda g: g[0])]

    n, t_max = len(games), MAX_MODEL_MOVES
    boards = np.zeros((n, t_max, 9), np.int8)
    after_boards = np.zeros((n, t_max, 9), np.int8)
    moves = np.full((n, t_max), -1, np.int32)
    kinds = np.full((n, t_max), -1, np.int8)
    statuses = np.zeros((n, t_max), np.int8)
    last_opp = np.full((n, t_max), -1, np.int8)
    outcome = np.zeros(n, np.int8)
    num_moves = np.zeros(n, np.int32)
    for i, (_, turns) in enumerate(games):
        num_moves[i] = len(turns)
        for t, (before, move, after, status, opp) in enumerate(turns):
            boards[i, t], moves[i, t], after_boards[i, t] = before, move, after
            statuses[i, t], last_opp[i, t] = status, opp
        final = turns[-1][3]
        outcome[i] = {ttt.STATUS_WIN: ttt.OUTCOME_WIN, ttt.STATUS_LOSS: ttt.OUTCOME_LOSS}.get(final, ttt.OUTCOME_DRAW)
    valid = moves >= 0
    flat_kinds = np.asarray(jax.jit(jax.vmap(move_kind))(boards.reshape(-1, 9), np.maximum(moves, 0).reshape(-1)))
    kinds = np.where(valid, flat_kinds.reshape(n, t_max), -1).astype(np.int8)
    return ExpertGames(
        seed=np.arange(n, dtype=np.uint32), random_move_prob=np.full(n, -1.0, np.float32),
        first_board=np.stack([g[0][0] for g in games]).astype(np.int8),
        first_status=np.array([g[0][1] for g in games], np.int8),
        first_last_opp=np.array([g[0][2] for g in games], np.int8),
        boards=boards, moves=moves, kinds=kinds, explored=np.zeros((n, t_max), bool), after_boards=after_boards,
        statuses=statuses, last_opp=last_opp, num_moves=num_moves, outcome=outcome,
        teacher_random_move_prob=np.zeros(n, np.float32),
    )
