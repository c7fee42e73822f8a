"""Tic-Tac-Toe teachers for SFT: minimax players' games on device, their whole game tree, and the rows.

Generation (on device). `expert_games_device` plays many games at once (`jit` + `vmap` over games, `lax.scan`
over the model's turns) with the game's own `reset` / `step`: X, the model's side, is a teacher that with
probability `explore` takes a uniformly random free cell and otherwise (kind "uniform") a uniform draw among ALL
of `optimal_moves(board, X)` or (kind "best") the deterministic move of `best_move_table()`: the value-keeping
move that wins most often against the random opponent, or (kind "drawn") that of `drawn_move_table()`, one
uniform draw among the value-keeping moves per board, made once; O is the game's own opponent with a per-game
`random_move_prob` drawn uniformly in the teacher's opponent range. Per model turn it records the board before
the move, the move, whether the teacher explored, the move's kind (`move_kind`, also on device) and the state
that the next environment message renders. Move kinds, first that applies: win (the move completes three X in
a line), block (O would complete a line on that cell), centre (cell 4), corner (0, 2, 6, 8), other.

The tree (host). The "best" teacher is deterministic, so the games it can meet against ANY opponent form a
tree (738 games); `exhaustive_expert_games` walks it depth first with the game's `model_move` and
`opponent_move_applied`, and `best_move_table` runs its dynamic programme over the game's own `winner` and
minimax tables: the rules live only in `envs.tictactoe.game`.

Rendering (host). `games_to_rows` renders every game with a prompt preset of `envs.tictactoe.text`
(`system_prompt` for the system message, `render_message` for every environment message) and writes each reply
as `<think>{reasoning}</think>\n<move>{k}</move>`, the reasoning a short template chosen from the move kind
(two wordings per kind, picked by the game's seed and turn; see `REASONING`), or empty with reasoning "none".
Lost games are filtered out, as the reference did for `anakin87/tictactoe-filtered`, and so are unfinished ones.
A row is one whole game in the conversational prompt/completion layout of `anakin87/tictactoe` (see
`jaxrl_llm.data.sft_data`), with `info` {example_seed, random_move_prob, initial_board, teacher_random_move_prob,
moves, move_kinds, explored, outcome, preset}.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.tictactoe import game as ttt
from envs.tictactoe import text
from jaxrl_llm.checks import ConfigError, check_choice, check_int, check_probability


# Move kinds (first that applies).
MOVE_WIN, MOVE_BLOCK, MOVE_CENTRE, MOVE_CORNER, MOVE_OTHER = 0, 1, 2, 3, 4
MOVE_KIND_NAMES = ("win", "block", "centre", "corner", "other")
MAX_MODEL_MOVES = 5  # X makes at most 5 moves in a game
CORNERS = (0, 2, 6, 8)

# Reasoning templates per move kind ({k}: the cell). Each wording belongs to exactly one kind.
REASONING: dict[int, tuple[str, ...]] = {
    MOVE_WIN: ("I can win at {k}.", "Taking {k} completes my line."),
    MOVE_BLOCK: ("I must block at {k}.", "O threatens {k}, so I block it."),
    MOVE_CENTRE: ("Centre is strongest.", "I take the centre."),
    MOVE_CORNER: ("Corner is strong.", "I take corner {k}."),
    MOVE_OTHER: ("I take {k}.", "{k} keeps my options open."),
}

_OUTCOME_NAMES = {**ttt.OUTCOME_NAMES, ttt.OUTCOME_ONGOING: "unfinished"}  # a game the turn limit ended


# ---------------------------------------------------------------------------------------------------------
# On-device expert games
# ---------------------------------------------------------------------------------------------------------


class ExpertGames(NamedTuple):
    """A batch of N expert games (device or NumPy arrays; T = MAX_MODEL_MOVES model turns).

    Turn t's entries are meaningful where `t < num_moves`; later ones are -1 / 0 / False.
    """

    seed: Any  # uint32[N]       the game's seed (first mover, opponent's draws)
    random_move_prob: Any  # float32[N]  the opponent's p
    first_board: Any  # int8[N, 9]      board of the first user message (O's opening if O started)
    first_status: Any  # int8[N]        its status (STATUS_START_*)
    first_last_opp: Any  # int8[N]      its last opponent move (-1: none)
    boards: Any  # int8[N, T, 9]        board before X's t-th move
    moves: Any  # int32[N, T]           X's t-th move (-1 after the game ended)
    kinds: Any  # int8[N, T]            MOVE_* of that move (-1 after the end)
    explored: Any  # bool[N, T]         the teacher took a random move instead of an optimal one
    after_boards: Any  # int8[N, T, 9]  board of the env message after move t (O's reply included)
    statuses: Any  # int8[N, T]         its status
    last_opp: Any  # int8[N, T]         its last opponent move
    num_moves: Any  # int32[N]          X's moves in the game
    outcome: Any  # int8[N]             OUTCOME_*
    teacher_random_move_prob: Any  # float32[N]  the teacher's exploration probability


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
REASONING_STYLES = ("templates", "none")
LAYOUTS = ("games", "positions")  # a row: a whole game, or one reply to one position


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


def _play_one(state: ttt.State, uniform: jax.Array, bits: jax.Array, teacher_p: jax.Array, max_turns: int,
              teacher: str = "uniform"):
    """One game from its reset state: scan over the model's turns (a finished game stays unchanged; turns
    from `max_turns` on are not played). uniform f32[T], bits uint32[T]: the teacher's random numbers."""

    def turn(state, inputs):
        rand_u, rand_b, t = inputs
        live = ~state.done & (t < max_turns)
        move, explored = teacher_move(state.board, rand_u, rand_b, teacher_p, teacher)
        kind = move_kind(state.board, move)
        new = jax.tree.map(lambda a, b: jnp.where(live, a, b), ttt.step(state, move), state)
        record = (
            state.board,
            jnp.where(live, move, -1),
            jnp.where(live, kind, -1).astype(jnp.int8),
            live & explored,
            new.board,
            new.status,
            new.last_opponent_move,
        )
        return new, record

    steps = jnp.arange(uniform.shape[0], dtype=jnp.int32)
    final, rec = jax.lax.scan(turn, state, (uniform, bits, steps))
    num_moves = (rec[1] >= 0).sum().astype(jnp.int32)
    return final, rec, num_moves


@functools.partial(jax.jit, static_argnames=("num_games", "max_turns", "teacher"))
def expert_games_device(key: jax.Array, num_games: int, teacher_random_move_prob: jax.Array, p_min: jax.Array,
                        p_max: jax.Array, max_turns: int = 8, teacher: str = "uniform") -> ExpertGames:
    """Play `num_games` teacher-vs-opponent games on device -> ExpertGames of device arrays.

    key: PRNG key; teacher_random_move_prob, p_min, p_max: f32[] (traced: no recompile when they change);
    the opponent's p of each game is uniform in [p_min, p_max]. Static num_games, max_turns (the teacher's
    replies at most; a game still going then is unfinished) and teacher ("uniform" or "best", see
    `teacher_move`)."""
    k_seed, k_p, k_uniform, k_bits = jax.random.split(key, 4)
    seeds = jax.random.bits(k_seed, (num_games,), jnp.uint32)
    p = jax.random.uniform(k_p, (num_games,), jnp.float32, minval=p_min, maxval=p_max)
    p = jnp.clip(p, p_min, p_max)
    uniform = jax.random.uniform(k_uniform, (num_games, MAX_MODEL_MOVES), jnp.float32)
    bits = jax.random.bits(k_bits, (num_games, MAX_MODEL_MOVES), jnp.uint32)
    start = jax.vmap(ttt.reset)(seeds, p)
    teacher_p = jnp.asarray(teacher_random_move_prob, jnp.float32)
    final, rec, num_moves = jax.vmap(_play_one, in_axes=(0, 0, 0, None, None, None))(
        start, uniform, bits, teacher_p, max_turns, teacher)
    boards, moves, kinds, explored, after_boards, statuses, last_opp = rec
    return ExpertGames(
        seed=seeds, random_move_prob=start.random_move_prob, first_board=start.board,
        first_status=start.status, first_last_opp=start.last_opponent_move, boards=boards, moves=moves,
        kinds=kinds, explored=explored, after_boards=after_boards, statuses=statuses, last_opp=last_opp,
        num_moves=num_moves, outcome=final.outcome,
        teacher_random_move_prob=jnp.broadcast_to(teacher_p, (num_games,)),
    )


def _check_prob(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


def check_p_range(opponent_p_range: Sequence[float]) -> tuple[float, float]:
    """Validate an opponent p range (p_min, p_max) with 0 <= p_min <= p_max <= 1; raises ValueError."""
    try:
        p_min, p_max = opponent_p_range
    except (TypeError, ValueError):
        raise ValueError(f"opponent_p_range must be a pair (p_min, p_max), got {opponent_p_range!r}") from None
    p_min, p_max = _check_prob("opponent p_min", p_min), _check_prob("opponent p_max", p_max)
    if p_min > p_max:
        raise ValueError(f"opponent_p_range needs p_min <= p_max, got ({p_min}, {p_max})")
    return p_min, p_max


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def generate_expert_games(key: jax.Array, num_games: int, *, teacher_random_move_prob: float = 0.0,
                          opponent_p_range: Sequence[float] = (0.0, 1.0), max_turns: int = 8,
                          teacher: str = "uniform") -> ExpertGames:
    """Host wrapper: validate the arguments, play on device, return ExpertGames of NumPy arrays (all games)."""
    _check_choice("teacher", teacher, TEACHERS)
    if isinstance(num_games, bool) or not isinstance(num_games, (int, np.integer)) or num_games < 1:
        raise ValueError(f"num_games must be an int >= 1, got {num_games!r}")
    teacher_p = _check_prob("teacher_random_move_prob", teacher_random_move_prob)
    p_min, p_max = check_p_range(opponent_p_range)
    games = expert_games_device(key, int(num_games), jnp.float32(teacher_p), jnp.float32(p_min),
                                jnp.float32(p_max), int(max_turns), teacher)
    return ExpertGames(*(np.asarray(x) for x in jax.device_get(games)))


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


# ---------------------------------------------------------------------------------------------------------
# Host rendering
# ---------------------------------------------------------------------------------------------------------


def reasoning_text(kind: int, move: int, variant: int = 0) -> str:
    """The short reasoning for a move of kind `kind` (MOVE_*) at cell `move`; `variant` picks the wording."""
    options = REASONING[int(kind)]
    return options[int(variant) % len(options)].replace("{k}", str(int(move)))


def reply_text(kind: int, move: int, variant: int = 0, reasoning: str = "templates") -> str:
    """The assistant reply: `<think>{reasoning}</think>\\n<move>{move}</move>`; reasoning "none" leaves the
    think block empty (`<think></think>`, still in the spec's format)."""
    _check_choice("reasoning", reasoning, REASONING_STYLES)
    thought = reasoning_text(kind, move, variant) if reasoning == "templates" else ""
    return f"<think>{thought}</think>\n<move>{int(move)}</move>"


def kind_of_reasoning(reasoning: str) -> int:
    """Inverse of `reasoning_text`: the MOVE_* kind whose template produced `reasoning` (ValueError if none)."""
    import re

    for kind, options in REASONING.items():
        for option in options:
            pattern = "^" + re.escape(option).replace(re.escape("{k}"), "[0-8]") + "$"
            if re.match(pattern, reasoning):
                return kind
    raise ValueError(f"not a reasoning template: {reasoning!r}")


def _preset(preset: str | text.PromptPreset) -> text.PromptPreset:
    if isinstance(preset, text.PromptPreset):
        return preset
    if preset not in text.PRESETS:
        raise ValueError(f"unknown prompt preset {preset!r}; choose one of {sorted(text.PRESETS)}")
    return text.PRESETS[preset]


def render_game(games: ExpertGames, i: int, preset: str | text.PromptPreset = "reference",
                reasoning: str = "templates") -> dict:
    """Game i of `games` (NumPy) -> one dataset row {prompt, completion, info} (see the module docstring);
    `reasoning` "templates" or "none" (see `reply_text`)."""
    preset = _preset(preset)
    seed = int(games.seed[i])
    n = int(games.num_moves[i])
    prompt = [
        {"role": "system", "content": text.system_prompt(preset)},
        {"role": "user", "content": text.render_message(preset, games.first_board[i], int(games.first_status[i]),
                                                        int(games.first_last_opp[i]))},
    ]
    completion = []
    for t in range(n):
        move, kind = int(games.moves[i, t]), int(games.kinds[i, t])
        completion.append({"role": "assistant", "content": reply_text(kind, move, seed + t, reasoning)})
        status = int(games.statuses[i, t])
        if int(games.outcome[i]) == ttt.OUTCOME_ONGOING and t == n - 1:
            break  # an unfinished game gets no further message
        completion.append({"role": "user", "content": text.render_message(
            preset, games.after_boards[i, t], status, int(games.last_opp[i, t]))})
    first = games.first_board[i]
    info = {
        "example_seed": seed,
        "random_move_prob": float(games.random_move_prob[i]),
        "initial_board": [None if v == ttt.EMPTY else ("X" if v == ttt.X else "O") for v in first.tolist()],
        "teacher_random_move_prob": float(games.teacher_random_move_prob[i]),
        "moves": [int(m) for m in games.moves[i, :n]],
        "move_kinds": [MOVE_KIND_NAMES[int(k)] for k in games.kinds[i, :n]],
        "explored": [bool(e) for e in games.explored[i, :n]],
        "outcome": _OUTCOME_NAMES[int(games.outcome[i])],
        "preset": preset.name,
        "legal_choices": [legal_cells(games.boards[i, t]) for t in range(n)],
    }
    return {"prompt": prompt, "completion": completion, "info": info}


def legal_cells(board: Any) -> list[int]:
    """The free cells of a board (host): the legal choices of X's reply to it (the env's `legal_choices`)."""
    return [int(c) for c in np.flatnonzero(np.asarray(board).reshape(-1) == ttt.EMPTY)]


def render_position(games: ExpertGames, i: int, t: int, preset: str | text.PromptPreset = "reference",
                    reasoning: str = "templates") -> dict:
    """Turn t of game i of `games` (NumPy) as a one-reply row: the system prompt, the message X saw before its
    t-th move (the game's first message for t = 0) and the teacher's reply to it; `info` as `render_game`'s
    (moves, kinds, legal_choices of that one reply) plus `turn`."""
    preset = _preset(preset)
    if t == 0:
        board, status, last = games.first_board[i], int(games.first_status[i]), int(games.first_last_opp[i])
    else:
        board, status, last = games.after_boards[i, t - 1], int(games.statuses[i, t - 1]), int(games.last_opp[i, t - 1])
    move, kind, seed = int(games.moves[i, t]), int(games.kinds[i, t]), int(games.seed[i])
    prompt = [{"role": "system", "content": text.system_prompt(preset)},
              {"role": "user", "content": text.render_message(preset, board, status, last)}]
    completion = [{"role": "assistant", "content": reply_text(kind, move, seed + t, reasoning)}]
    info = {"example_seed": seed, "random_move_prob": float(games.random_move_prob[i]), "turn": int(t),
            "board": [int(v) for v in np.asarray(games.boards[i, t])],
            "teacher_random_move_prob": float(games.teacher_random_move_prob[i]), "moves": [move],
            "move_kinds": [MOVE_KIND_NAMES[kind]], "explored": [bool(games.explored[i, t])], "preset": preset.name,
            "legal_choices": [legal_cells(games.boards[i, t])]}
    return {"prompt": prompt, "completion": completion, "info": info}


def position_rows(key: jax.Array, num_positions: int, *, teacher_random_move_prob: float = 1.0,
                  opponent_p_range: Sequence[float] = (1.0, 1.0), preset: str = "reference", max_turns: int = 8,
                  teacher: str = "uniform", reasoning: str = "templates", last_turn_share: float = 0.0) -> list[dict]:
    """`num_positions` one-reply rows, one per game: a game of the teacher against the opponent is played on
    device and ONE of its X turns, uniform among the turns it played, is kept (`render_position`); for a
    share `last_turn_share` of the rows (drawn per row) the game's LAST X turn instead, the position with the
    fewest free cells (1 to 7 in random games: a reply nearly fixed by the board, a strong legality signal). With
    teacher_random_move_prob = 1 and the random opponent (p = 1) the position is a uniformly random reachable
    one of the random game and the reply a uniformly random legal move: legality and format, no strategy."""
    games = generate_expert_games(key, num_positions, teacher_random_move_prob=teacher_random_move_prob,
                                  opponent_p_range=opponent_p_range, max_turns=max_turns, teacher=teacher)
    picks = np.asarray(jax.random.uniform(jax.random.fold_in(key, 7), (num_positions,)))
    turns = np.minimum((picks * games.num_moves).astype(np.int64), np.maximum(games.num_moves - 1, 0))
    last = np.asarray(jax.random.uniform(jax.random.fold_in(key, 8), (num_positions,))) < last_turn_share
    turns = np.where(last, np.maximum(games.num_moves - 1, 0), turns)
    return [render_position(games, i, int(turns[i]), preset, reasoning) for i in range(num_positions)
            if games.num_moves[i] > 0]


def games_to_rows(games: ExpertGames, preset: str | text.PromptPreset = "reference", *,
                  keep_losses: bool = False, reasoning: str = "templates") -> list[dict]:
    """Render the won and drawn games (lost ones too if keep_losses; never unfinished ones) as rows."""
    _check_choice("reasoning", reasoning, REASONING_STYLES)
    keep = (games.outcome == ttt.OUTCOME_WIN) | (games.outcome == ttt.OUTCOME_DRAW)
    if keep_losses:
        keep |= games.outcome == ttt.OUTCOME_LOSS
    return [render_game(games, int(i), preset, reasoning) for i in np.flatnonzero(keep)]


def expert_rows(key: jax.Array, num_games: int, *, teacher_random_move_prob: float = 0.1,
                opponent_p_range: Sequence[float] = (0.0, 1.0), preset: str = "reference",
                max_turns: int = 8, teacher: str = "uniform", reasoning: str = "templates",
                tree_copies: int = 0, tree_teacher: str | None = None, keep_losses: bool = False) -> list[dict]:
    """Play `num_games` expert games on device and return the kept ones as rows (one row a game).

    Unfinished games are dropped, and so are lost ones unless keep_losses, so there may be fewer than `num_games` rows. tree_copies > 0
    (a deterministic teacher without exploration only) appends that many copies of `exhaustive_expert_games(teacher)`, the
    whole tree of games the teacher can meet, so every position it can face is in the data. tree_teacher:
    the deterministic teacher whose tree that is (None: `teacher`), so that sampled games of one teacher
    (e.g. "uniform") can be mixed with the tree of another (e.g. "drawn")."""
    _preset(preset)
    if isinstance(tree_copies, bool) or not isinstance(tree_copies, (int, np.integer)) or tree_copies < 0:
        raise ValueError(f"tree_copies must be an int >= 0, got {tree_copies!r}")
    tree_teacher = teacher if tree_teacher is None else tree_teacher
    _check_choice("tree_teacher", tree_teacher, TEACHERS)
    if tree_copies and (tree_teacher not in DETERMINISTIC_TEACHERS or teacher_random_move_prob > 0):
        raise ValueError(f"tree_copies needs a deterministic teacher: teacher in {DETERMINISTIC_TEACHERS} and "
                         f"teacher_random_move_prob=0 (got {tree_teacher!r}, {teacher_random_move_prob})")
    if tree_copies and max_turns < MAX_MODEL_MOVES:
        raise ValueError(f"tree_copies needs max_turns >= {MAX_MODEL_MOVES} (a tree game has up to "
                         f"{MAX_MODEL_MOVES} model moves), got {max_turns}")
    games = generate_expert_games(key, num_games, teacher_random_move_prob=teacher_random_move_prob,
                                  opponent_p_range=opponent_p_range, max_turns=max_turns, teacher=teacher)
    rows = games_to_rows(games, preset, keep_losses=keep_losses, reasoning=reasoning)
    if tree_copies:
        rows += games_to_rows(exhaustive_expert_games(tree_teacher), preset, reasoning=reasoning) * int(tree_copies)
    return rows


# ---------------------------------------------------------------------------------------------------------
# The teacher as config (the env's `Teacher`: the `[sft.teacher]` table)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Teacher:
    """Tic-Tac-Toe SFT data: `num_games` games of a minimax teacher against the game's opponent.

    kind: "uniform" (a uniform draw among the optimal moves at every move), "best" (the optimal move that
    wins most often against the random opponent, deterministic) or "drawn" (one uniform draw among the
    optimal moves per board, made once and fixed: `drawn_move_table`, deterministic); reasoning: "templates" (a short templated thought in
    <think>) or "none" (an empty <think></think>); explore_prob: how often the teacher plays a uniformly
    random legal move instead (its replies stay well formatted); the opponent plays at p uniform in
    [opponent_p_min, opponent_p_max] (None: = opponent_p_min); tree_copies: copies of every game a
    deterministic teacher can meet (its whole tree: 738 games for "best") added to the sampled ones;
    sample_kind: the teacher of the `num_games` sampled games (None: `kind`). E.g. kind "drawn" with
    sample_kind "uniform": the drawn teacher's tree plus games whose every move is a fresh uniform draw
    among the value-keeping moves, so the model also puts some mass on the other value-keeping moves.
    keep_losses: keep the sampled games X lost (default: dropped, as the reference's filtered data set). With
    explore_prob = 1 and opponent_p_min = 1 the data are then the random legal mover's games against the
    random opponent, unfiltered: they teach the format and the legal moves and no strategy.
    layout: "games" (one row a whole game, as above) or "positions" (one row a single reply: of each of the
    `num_games` games one X turn, uniform among its turns, as system + that message + the teacher's reply;
    `position_rows`; outcome filter and tree do not apply); last_turn_share: the share of those rows that take
    the game's last X turn (fewest free cells) instead. Every row's info lists the legal choices of each
    reply (`legal_choices`), for the SFT decision metrics.
    """

    num_games: int = 1000
    kind: str = "uniform"
    reasoning: str = "templates"
    explore_prob: float = 0.0
    opponent_p_min: float = 0.5
    opponent_p_max: float | None = None
    tree_copies: int = 0
    sample_kind: str | None = None
    keep_losses: bool = False
    layout: str = "games"
    last_turn_share: float = 0.0

    def __post_init__(self) -> None:
        check_probability(self, "last_turn_share")
        if self.last_turn_share and self.layout != "positions":
            raise ConfigError('applies to layout = "positions" only', ("last_turn_share",), "Teacher")
        check_int(self, "num_games", 1)
        check_choice(self, "layout", LAYOUTS)
        if self.layout == "positions" and self.tree_copies:
            raise ConfigError('a whole-game tree does not apply to layout = "positions"; set tree_copies = 0',
                              ("tree_copies",), "Teacher")
        check_choice(self, "kind", TEACHERS)
        if self.sample_kind is not None:
            check_choice(self, "sample_kind", TEACHERS)
        check_choice(self, "reasoning", REASONING_STYLES)
        check_probability(self, "explore_prob")
        check_probability(self, "opponent_p_min")
        if self.opponent_p_max is not None:
            check_probability(self, "opponent_p_max")
            if self.opponent_p_max < self.opponent_p_min:
                raise ConfigError(f"must be >= opponent_p_min ({self.opponent_p_min}), got {self.opponent_p_max}",
                                  ("opponent_p_max",), "Teacher")
        check_int(self, "tree_copies", 0)
        if not isinstance(self.keep_losses, bool):
            raise ConfigError(f"must be true or false, got {self.keep_losses!r}", ("keep_losses",), "Teacher")
        if self.tree_copies and (self.kind not in DETERMINISTIC_TEACHERS or self.explore_prob > 0):
            raise ConfigError('needs a deterministic teacher: kind = "best" or "drawn", and explore_prob = 0',
                              ("tree_copies",), "Teacher")

    @property
    def opponent_p_range(self) -> tuple[float, float]:
        """(p_min, p_max) of the teacher's opponent."""
        return self.opponent_p_min, self.opponent_p_min if self.opponent_p_max is None else self.opponent_p_max

    @property
    def deterministic(self) -> bool:
        """A fixed-table teacher without exploration: its whole game tree is a complete exactness check."""
        return self.kind in DETERMINISTIC_TEACHERS and self.explore_prob == 0

    def rows(self, key: jax.Array, preset: str, max_turns: int) -> list[dict]:
        """The SFT rows of this teacher (see `expert_rows`, or `position_rows` for layout "positions")."""
        if self.layout == "positions":
            return position_rows(key, self.num_games, teacher_random_move_prob=self.explore_prob,
                                 opponent_p_range=self.opponent_p_range, preset=preset, max_turns=max_turns,
                                 teacher=self.sample_kind or self.kind, reasoning=self.reasoning,
                                 last_turn_share=self.last_turn_share)
        return expert_rows(key, self.num_games, teacher_random_move_prob=self.explore_prob,
                           opponent_p_range=self.opponent_p_range, preset=preset, max_turns=max_turns,
                           teacher=self.sample_kind or self.kind, reasoning=self.reasoning,
                           tree_copies=self.tree_copies, tree_teacher=self.kind, keep_losses=self.keep_losses)
