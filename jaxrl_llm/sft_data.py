"""SFT data: expert Tic-Tac-Toe games played on device, rendered as chat conversations, saved and loaded.

Generation (on device). `expert_games_device` plays many games at once (`jit` + `vmap` over games, `lax.scan`
over the model's turns) with `envs.tictactoe`: X, the model's side, is a teacher that with probability
`teacher_random_move_prob` takes a uniformly random free cell and otherwise (teacher "uniform") a uniform draw
among ALL of `optimal_moves(board, X)` or (teacher "best") the deterministic move of `best_move_table()`: the
value-keeping move that wins most often against the random opponent; O is the environment's own opponent with a
per-game `random_move_prob` drawn uniformly in `opponent_p_range`. Per model turn it records the board before the move, the move, whether the
teacher explored, the move's kind (`move_kind`, also on device) and the state that the next environment message
renders. Move kinds, first that applies: win (the move completes three X in a line), block (O would complete a
line on that cell), centre (cell 4), corner (0, 2, 6, 8), other.

Rendering (host). `games_to_rows` renders every game with a prompt preset of `jaxrl_llm.text` (`system_prompt`
for the system message, `render_message` for every environment message) and writes each reply as
`<think>{reasoning}</think>\\n<move>{k}</move>`, the reasoning a short template chosen from the move kind (two
wordings per kind, picked by the game's seed and turn; see `REASONING`), or empty with reasoning "none". Lost games are
filtered out, as the reference did for `anakin87/tictactoe-filtered`, and so are unfinished ones.

Dataset format (the conversational prompt/completion layout of `anakin87/tictactoe` and
`anakin87/tictactoe-filtered`): ONE ROW PER WHOLE GAME. The public dataset cards list features `prompt` and
`completion`, each a list of `{content: string, role: string}`, plus `info` {example_seed, initial_board,
random_move_prob} and reward columns; 200 rows are 200 games, and the filtered set's 174 rows are the "174
synthetic games" the SFT checkpoint's card says it trained on. Here:

    prompt:     [{"role": "system", "content": system prompt}, {"role": "user", "content": first env message}]
    completion: [{"role": "assistant", "content": reply 1}, {"role": "user", "content": env message 1}, ...,
                 {"role": "assistant", "content": last reply}, {"role": "user", "content": final message}]
    info:       {"example_seed": int, "random_move_prob": float (the opponent's p), "initial_board":
                 [None | "O"] * 9, "teacher_random_move_prob": float, "moves": [int], "move_kinds": [str],
                 "explored": [bool], "outcome": "win" | "draw", "preset": str}

The final message (`{status}\\n\\n{board}`) closes the completion; it is a user turn, so it carries no loss.
`load_sft_dataset` reads the same layout from a `save_to_disk` folder (a `DatasetDict` gives its `train` split),
a JSON Lines / JSON / Parquet file, a folder of Parquet or JSON files (a downloaded Hub snapshot of the public
dataset), or a TFDS folder written by `export_tfds`; only `prompt` and `completion` are required, other columns
are kept as they are.

TFDS (optional, extra `tfds`): `export_tfds` writes the rows with a `tfds.core.GeneratorBasedBuilder` as
`array_record` files; that path needs no TensorFlow (checked with tensorflow-datasets 4.9 and array-record 0.8).
Messages are stored as sequences of {role, content} text features and `info` as JSON text; `load_tfds` reads them
back through `as_data_source()` in the original order.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs import tictactoe as ttt
from jaxrl_llm import text

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

_OUTCOME_NAMES = {ttt.OUTCOME_WIN: "win", ttt.OUTCOME_DRAW: "draw", ttt.OUTCOME_LOSS: "loss",
                  ttt.OUTCOME_UNFINISHED: "unfinished", ttt.OUTCOME_ONGOING: "ongoing"}

TFDS_EXTRA_HINT = "pip install 'jaxrl_llm[tfds]'  (tensorflow-datasets and array-record; TensorFlow is not needed)"


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


TEACHERS = ("uniform", "best")
REASONING_STYLES = ("templates", "none")


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
    lines = np.asarray(ttt.LINES)
    best = np.full(3 ** 9, -1, np.int8)
    memo: dict[tuple[int, int], float] = {}

    def cells(index: int) -> np.ndarray:
        return (index // pow3) % 3

    def x_win_prob(index: int, x_to_move: bool) -> float:
        key = (index, int(x_to_move))
        if key in memo:
            return memo[key]
        board = cells(index)
        marks = board[lines]
        if (marks == ttt.X).all(1).any():
            result = 1.0
        elif (marks == ttt.O).all(1).any() or not (board == ttt.EMPTY).any():
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


def teacher_win_rate_vs_random() -> float:
    """The `best` teacher's exact win probability against the random opponent, first mover 50 / 50."""
    table = best_move_table()
    pow3 = 3 ** np.arange(9)
    lines = np.asarray(ttt.LINES)

    def prob(index: int, x_to_move: bool) -> float:
        board = (index // pow3) % 3
        marks = board[lines]
        if (marks == ttt.X).all(1).any():
            return 1.0
        if (marks == ttt.O).all(1).any() or not (board == ttt.EMPTY).any():
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
    all optimal X moves (`ttt.optimal_moves`), "best" plays `best_move_table()` (deterministic).
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
    if teacher == "best":
        chosen = jnp.asarray(best_move_table())[ttt.board_index(board)].astype(move.dtype)
        move = jnp.where(explored | (chosen < 0), move, chosen)
    return move.astype(jnp.int32), explored


def _play_one(state: ttt.State, uniform: jax.Array, bits: jax.Array, teacher_p: jax.Array, params: ttt.EnvParams,
              teacher: str = "uniform"):
    """One game from its reset state: scan over the model's turns (a finished game stays unchanged).

    uniform f32[T], bits uint32[T]: the teacher's random numbers per turn."""

    def turn(state, rand):
        live = ~state.done
        move, explored = teacher_move(state.board, rand[0], rand[1], teacher_p, teacher)
        kind = move_kind(state.board, move)
        new = ttt.step(state, move, params)  # a done state comes back unchanged
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

    final, rec = jax.lax.scan(turn, state, (uniform, bits))
    num_moves = (rec[1] >= 0).sum().astype(jnp.int32)
    return final, rec, num_moves


@functools.partial(jax.jit, static_argnames=("num_games", "params", "teacher"))
def expert_games_device(key: jax.Array, num_games: int, teacher_random_move_prob: jax.Array, p_min: jax.Array,
                        p_max: jax.Array, params: ttt.EnvParams = ttt.EnvParams(),
                        teacher: str = "uniform") -> ExpertGames:
    """Play `num_games` teacher-vs-opponent games on device -> ExpertGames of device arrays.

    key: PRNG key; teacher_random_move_prob, p_min, p_max: f32[] (traced: no recompile when they change);
    the opponent's p of each game is uniform in [p_min, p_max]. Static num_games, EnvParams and teacher
    ("uniform" or "best", see `teacher_move`)."""
    k_seed, k_p, k_uniform, k_bits = jax.random.split(key, 4)
    seeds = jax.random.bits(k_seed, (num_games,), jnp.uint32)
    p = jax.random.uniform(k_p, (num_games,), jnp.float32, minval=p_min, maxval=p_max)
    p = jnp.clip(p, p_min, p_max)
    uniform = jax.random.uniform(k_uniform, (num_games, MAX_MODEL_MOVES), jnp.float32)
    bits = jax.random.bits(k_bits, (num_games, MAX_MODEL_MOVES), jnp.uint32)
    start = jax.vmap(ttt.reset, in_axes=(0, 0, None))(seeds, p, params)
    teacher_p = jnp.asarray(teacher_random_move_prob, jnp.float32)
    final, rec, num_moves = jax.vmap(_play_one, in_axes=(0, 0, 0, None, None, None))(
        start, uniform, bits, teacher_p, params, teacher)
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
    params = ttt.EnvParams(max_turns=max_turns)
    games = expert_games_device(key, int(num_games), jnp.float32(teacher_p), jnp.float32(p_min),
                                jnp.float32(p_max), params, teacher)
    return ExpertGames(*(np.asarray(x) for x in jax.device_get(games)))


def exhaustive_expert_games() -> ExpertGames:
    """Every game the deterministic `best` teacher can meet, each once (NumPy ExpertGames, host).

    The teacher's moves are fixed (`best_move_table`), so the games it can play against ANY opponent form a
    small tree: the opponent's choices branch it (all 9 openings when O starts, every free cell at every
    reply). Its leaves are 1 000-odd complete games (a few hundred with X first), every position the teacher
    can face appears in them, and so an SFT set made of them covers every board a model that plays like the
    teacher meets in evaluation, whatever the opponent. Order: X-first games, then O-first ones, each in
    depth-first order of the opponent's cells. `random_move_prob` is -1 (no single opponent strength) and
    `seed` the game's index; statuses follow `envs.tictactoe.step`.
    """
    table = best_move_table()
    pow3 = 3 ** np.arange(9)
    lines = np.asarray(ttt.LINES)

    def won(board, player):
        return bool((board[lines] == player).all(1).any())

    games: list[tuple] = []

    def play(board, first, turns, last):
        """X to move on `board` (`last`: the opponent's latest move, -1 none); turns: [(board before, move,
        after board, status, last opp)] so far."""
        move = int(table[int((board * pow3).sum())])
        after = board.copy()
        after[move] = ttt.X
        if won(after, ttt.X) or not (after == ttt.EMPTY).any():
            status = ttt.STATUS_WIN if won(after, ttt.X) else ttt.STATUS_DRAW
            games.append((first, turns + [(board, move, after, status, last)]))
            return
        for reply in np.flatnonzero(after == ttt.EMPTY):
            nxt = after.copy()
            nxt[reply] = ttt.O
            if won(nxt, ttt.O) or not (nxt == ttt.EMPTY).any():
                status = ttt.STATUS_LOSS if won(nxt, ttt.O) else ttt.STATUS_OPP_DRAW
                games.append((first, turns + [(board, move, nxt, status, int(reply))]))
            else:
                play(nxt, first, turns + [(board, move, nxt, ttt.STATUS_OPP_MOVED, int(reply))], int(reply))

    empty = np.zeros(9, np.int8)
    play(empty, (empty, ttt.STATUS_START_MODEL_FIRST, -1), [], -1)
    for opening in range(9):
        board = empty.copy()
        board[opening] = ttt.O
        play(board, (board, ttt.STATUS_START_OPP_FIRST, opening), [], opening)

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
        outcome[i] = ttt.OUTCOME_WIN if final == ttt.STATUS_WIN else (
            ttt.OUTCOME_LOSS if final == ttt.STATUS_LOSS else ttt.OUTCOME_DRAW)
    valid = moves >= 0
    flat_kinds = np.asarray(jax.vmap(move_kind)(jnp.asarray(boards.reshape(-1, 9)),
                                                jnp.asarray(np.maximum(moves, 0).reshape(-1))))
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
        if int(games.outcome[i]) == ttt.OUTCOME_UNFINISHED and t == n - 1:
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
    }
    return {"prompt": prompt, "completion": completion, "info": info}


def games_to_rows(games: ExpertGames, preset: str | text.PromptPreset = "reference", *,
                  keep_losses: bool = False, reasoning: str = "templates") -> list[dict]:
    """Render the won and drawn games (lost ones too if keep_losses; never unfinished ones) as rows."""
    _check_choice("reasoning", reasoning, REASONING_STYLES)
    keep = (games.outcome == ttt.OUTCOME_WIN) | (games.outcome == ttt.OUTCOME_DRAW)
    if keep_losses:
        keep |= games.outcome == ttt.OUTCOME_LOSS
    return [render_game(games, int(i), preset, reasoning) for i in np.flatnonzero(keep)]


def make_expert_dataset(key: jax.Array, num_games: int, *, teacher_random_move_prob: float = 0.1,
                        opponent_p_range: Sequence[float] = (0.0, 1.0), preset: str = "reference",
                        max_turns: int = 8, teacher: str = "uniform", reasoning: str = "templates",
                        tree_copies: int = 0):
    """Play `num_games` expert games on device and return the kept ones as a `datasets.Dataset` (one row a game).

    Lost and unfinished games are dropped, so the dataset may hold fewer than `num_games` rows. tree_copies > 0
    (teacher "best" without exploration only) appends that many copies of `exhaustive_expert_games()`, the
    whole tree of games the teacher can meet, so every position it can face is in the data."""
    _preset(preset)
    if isinstance(tree_copies, bool) or not isinstance(tree_copies, (int, np.integer)) or tree_copies < 0:
        raise ValueError(f"tree_copies must be an int >= 0, got {tree_copies!r}")
    if tree_copies and (teacher != "best" or teacher_random_move_prob > 0):
        raise ValueError("tree_copies needs the deterministic teacher: teacher='best' and "
                         f"teacher_random_move_prob=0 (got {teacher!r}, {teacher_random_move_prob})")
    if tree_copies and max_turns < MAX_MODEL_MOVES:
        raise ValueError(f"tree_copies needs max_turns >= {MAX_MODEL_MOVES} (a tree game has up to "
                         f"{MAX_MODEL_MOVES} model moves), got {max_turns}")
    games = generate_expert_games(key, num_games, teacher_random_move_prob=teacher_random_move_prob,
                                  opponent_p_range=opponent_p_range, max_turns=max_turns, teacher=teacher)
    rows = games_to_rows(games, preset, reasoning=reasoning)
    if tree_copies:
        rows += games_to_rows(exhaustive_expert_games(), preset, reasoning=reasoning) * int(tree_copies)
    return rows_to_dataset(rows)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face datasets I/O
# ---------------------------------------------------------------------------------------------------------


def sft_features():
    """The `datasets.Features` of the rows this module writes (messages as lists of {content, role})."""
    import datasets

    message = [{"content": datasets.Value("string"), "role": datasets.Value("string")}]
    return datasets.Features({
        "prompt": message,
        "completion": message,
        "info": {
            "example_seed": datasets.Value("int64"),
            "random_move_prob": datasets.Value("float64"),
            "initial_board": [datasets.Value("string")],
            "teacher_random_move_prob": datasets.Value("float64"),
            "moves": [datasets.Value("int32")],
            "move_kinds": [datasets.Value("string")],
            "explored": [datasets.Value("bool")],
            "outcome": datasets.Value("string"),
            "preset": datasets.Value("string"),
        },
    })


def rows_to_dataset(rows: Sequence[dict]):
    """List of {prompt, completion, ...} rows -> `datasets.Dataset` (checks the format first).

    Rows in this module's layout get the fixed `sft_features()`; others (e.g. the public dataset's) are inferred."""
    import datasets

    rows = list(rows)
    for i, row in enumerate(rows):
        check_row(row, i)
    features = sft_features()
    ours = all(set(row) == set(features) and set(row["info"]) == set(features["info"]) for row in rows)
    if ours:
        return datasets.Dataset.from_list(rows, features=features)
    return datasets.Dataset.from_list(rows)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} must be a list of {{role, content}} messages, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{j}] must be a dict with string 'role' and 'content', got {m!r}")


def check_row(row: dict, index: int = 0) -> None:
    """Raise ValueError unless `row` has `prompt` and `completion` message lists."""
    for field in ("prompt", "completion"):
        if field not in row:
            raise ValueError(f"row {index} has no {field!r} field (columns: {sorted(row)}); expected the "
                             "conversational prompt/completion format")
        _check_messages(row[field], f"row {index} {field}")


def conversation(row: dict) -> list[dict]:
    """A row's whole conversation: prompt + completion messages ({role, content} only)."""
    return [{"role": m["role"], "content": m["content"]} for m in list(row["prompt"]) + list(row["completion"])]


def save_sft_dataset(dataset, path: str | Path) -> None:
    """Save a dataset (or a list of rows) with `datasets`' save_to_disk."""
    if not hasattr(dataset, "save_to_disk"):
        dataset = rows_to_dataset(dataset)
    dataset.save_to_disk(str(path))


def export_jsonl(dataset, path: str | Path) -> None:
    """Write a dataset (or a list of rows) as JSON Lines, one game a line."""
    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    with open(path, "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _is_tfds_dir(folder: Path) -> bool:
    return (folder / "features.json").is_file() and (folder / "dataset_info.json").is_file()


def _find_tfds_dir(folder: Path) -> Path | None:
    if _is_tfds_dir(folder):
        return folder
    found = sorted(p.parent for p in folder.glob("*/*/features.json") if _is_tfds_dir(p.parent))
    return found[0] if len(found) == 1 else None


def load_sft_dataset(path: str | Path, split: str = "train"):
    """Load prompt/completion rows as a `datasets.Dataset` from any supported layout (see the module docstring).

    path: a save_to_disk folder, a .jsonl/.json/.parquet file, a folder of Parquet/JSON files (a Hub snapshot),
    or a TFDS folder from `export_tfds`. `split` picks the split of a DatasetDict / TFDS dataset."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path}")
    if path.is_file():
        ds = _load_files([path])
    elif (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
    elif (tfds_dir := _find_tfds_dir(path)) is not None:
        ds = rows_to_dataset(load_tfds(tfds_dir, split))
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json")
                       and p.name not in ("dataset_info.json", "state.json", "dataset_dict.json", "features.json"))
        with_split = [p for p in files if p.name.startswith(split) or p.parent.name == split]
        files = with_split or files
        if not files:
            raise ValueError(f"{path}: no save_to_disk dataset, TFDS folder, or Parquet/JSON files found")
        ds = _load_files(files)
    for field in ("prompt", "completion"):
        if field not in ds.column_names:
            raise ValueError(f"{path}: no {field!r} column (columns: {ds.column_names}); expected the "
                             "conversational prompt/completion format of anakin87/tictactoe-filtered")
    if len(ds):
        check_row(ds[0], 0)
    return ds


def _load_files(files: list[Path]):
    import datasets

    kinds = {p.suffix for p in files}
    if kinds == {".parquet"}:
        return datasets.Dataset.from_parquet([str(p) for p in files])
    if kinds <= {".jsonl", ".json"}:
        # Parsed with Python's json: exact floats (Arrow's JSON reader rounds some doubles in the last digits).
        rows = []
        for p in files:
            content = p.read_text(encoding="utf-8")
            if content.lstrip().startswith("["):
                rows.extend(json.loads(content))
            else:
                rows.extend(json.loads(line) for line in content.splitlines() if line.strip())
        return rows_to_dataset(rows)
    raise ValueError(f"cannot load a mix of file types {sorted(kinds)}: {files}")


# ---------------------------------------------------------------------------------------------------------
# Optional TFDS export (array_record, no TensorFlow)
# ---------------------------------------------------------------------------------------------------------


def _require_tfds():
    try:
        import array_record  # noqa: F401
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(f"the TFDS export needs the optional 'tfds' extra: {TFDS_EXTRA_HINT} ({e})") from e
    return tfds


TFDS_NAME = "tic_tac_toe_sft"  # the builder's dataset name (folder under data_dir)


@functools.lru_cache(maxsize=1)
def _builder_class():
    tfds = _require_tfds()
    from etils import epath

    class TicTacToeSft(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Tic-Tac-Toe SFT games: one example a game, messages as sequences of {role, content}."""

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "Expert games in the prompt/completion format."}
        # TFDS derives this from the defining package and, for a package installed as a plain folder, then needs
        # the `importlib_resources` backport (not always installed with tensorflow-datasets 4.9): set it directly.
        code_path = epath.Path(__file__)

        def __init__(self, rows: Sequence[dict] = (), split: str = "train", **kwargs):
            self._rows = list(rows)
            self._split = split
            super().__init__(**kwargs)

        def _info(self):
            message = tfds.features.Sequence({"role": tfds.features.Text(), "content": tfds.features.Text()})
            features = tfds.features.FeaturesDict({
                "index": tfds.features.Scalar(dtype=np.int64),
                "prompt": message,
                "completion": message,
                "info": tfds.features.Text(),  # JSON
            })
            return tfds.core.DatasetInfo(builder=self, features=features, description=__doc__)

        def _split_generators(self, dl_manager):
            del dl_manager
            return {self._split: self._generate_examples()}

        def _generate_examples(self):
            for i, row in enumerate(self._rows):
                yield i, {
                    "index": i,
                    "prompt": _columns(row["prompt"]),
                    "completion": _columns(row["completion"]),
                    "info": json.dumps(row.get("info", {}), ensure_ascii=False),
                }

    return TicTacToeSft


def _columns(messages: Sequence[dict]) -> dict:
    return {"role": [m["role"] for m in messages], "content": [m["content"] for m in messages]}


def export_tfds(rows: Iterable[dict], data_dir: str | Path, *, split: str = "train", overwrite: bool = False) -> Path:
    """Write rows (a list or a `datasets.Dataset`) as a TFDS dataset of array_record files, without TensorFlow.

    Returns the dataset's folder `data_dir/tic_tac_toe_sft/1.0.0` (readable with `load_tfds`,
    `tfds.builder_from_directory` or `load_sft_dataset`). ImportError naming the `tfds` extra if it is missing;
    FileExistsError if the folder exists and not overwrite."""
    tfds = _require_tfds()
    rows = list(rows)
    for i, row in enumerate(rows):
        check_row(row, i)
    target = Path(data_dir) / TFDS_NAME / "1.0.0"
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
        shutil.rmtree(target)
    builder = _builder_class()(rows, split, data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return Path(builder.data_dir)


def load_tfds(path: str | Path, split: str = "train") -> list[dict]:
    """Read a TFDS folder written by `export_tfds` back into rows {prompt, completion, info}, in order."""
    tfds = _require_tfds()
    source = tfds.builder_from_directory(str(path)).as_data_source()[split]
    records = sorted((source[i] for i in range(len(source))), key=lambda r: int(r["index"]))

    def messages(cols):
        return [{"role": _str(r), "content": _str(c)} for r, c in zip(cols["role"], cols["content"])]

    return [{"prompt": messages(r["prompt"]), "completion": messages(r["completion"]),
             "info": json.loads(_str(r["info"]))} for r in records]


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
