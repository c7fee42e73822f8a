"""Tic-Tac-Toe teachers' games as SFT rows (host rendering).

`games_to_rows` renders every game with a prompt preset of `envs.tictactoe.text` (`system_prompt` for the system
message, `render_message` for every environment message) and writes each reply as
`<think>{reasoning}</think>\n<move>{k}</move>`, the reasoning a short template chosen from the move kind (two
wordings per kind, picked by the game's seed and turn; see `REASONING`), or empty with reasoning "none". Lost
games are filtered out, as the reference did for `anakin87/tictactoe-filtered`, and so are unfinished ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from envs.tictactoe import game as ttt
from envs.tictactoe import text
from envs.tictactoe.expert_games import ExpertGames, _check_choice, generate_expert_games
from envs.tictactoe.teachers import (
    DETERMINISTIC_TEACHERS, MAX_MODEL_MOVES, MOVE_BLOCK, MOVE_CENTRE, MOVE_CORNER, MOVE_KIND_NAMES, MOVE_OTHER, MOVE_WIN,
    TEACHERS,
)
from envs.tictactoe.tree import exhaustive_expert_games

REASONING_STYLES = ("templates", "none")

# Reasoning templates per move kind ({k}: the cell). Each wording belongs to exactly one kind.
REASONING: dict[int, tuple[str, ...]] = {
    MOVE_WIN: ("I can win at {k}.", "Taking {k} completes my line."),
    MOVE_BLOCK: ("I must block at {k}.", "O threatens {k}, so I block it."),
    MOVE_CENTRE: ("Centre is strongest.", "I take the centre."),
    MOVE_CORNER: ("Corner is strong.", "I take corner {k}."),
    MOVE_OTHER: ("I take {k}.", "{k} keeps my options open."),
}

_OUTCOME_NAMES = {**ttt.OUTCOME_NAMES, ttt.OUTCOME_ONGOING: "unfinished"}  # a game the turn limit ended



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
                tree_copies: int = 0, tree_teacher: str | None = None, keep_losses: bool = False,
                symmetries: bool = False) -> list[dict]:
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
    if symmetries:
        from envs.tictactoe.symmetry import symmetric_games

        games = symmetric_games(games)
    rows = games_to_rows(games, preset, keep_losses=keep_losses, reasoning=reasoning)
    if tree_copies:
        rows += games_to_rows(exhaustive_expert_games(tree_teacher), preset, reasoning=reasoning) * int(tree_copies)
    return rows
