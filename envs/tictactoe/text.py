"""Tic-Tac-Toe's text: prompt presets (data), host rendering, and the message as slots of piece tables.

Prompt presets `reference` (the spec's exact text, `shared/TICTACTOE_SPEC.md`), `compact` and `tiny` are
`PromptPreset` records of strings. A message is

    {status}{status_board_sep}{board}[{board_free_sep}{free_prefix}{free}{free_turn_sep}{turn}]

(the bracket only while the game goes on) and, for the text bridge, six slots cut as lines (each piece
ends with the run of newlines that follows it, so every cut lies where byte-level pre-tokenizers split):

    status  the status line with its `{k}` + the status/board separator      code = status * 9 + k
    row0    "a | b | c" + "\n---------\n"                                    code = final * 27 + row code
    row1    "d | e | f" + "\n---------\n"                                    code = final * 27 + row code
    row2    "g | h | i" + the newlines that follow the board (none if final) code = final * 27 + row code
    free    "Available positions: [..]" + the newlines after it ("" if final) code = final * 512 + free mask
    turn    "Your turn." ("" if final)                                          code = final

(a row code is base 3 with cell c of the row weighing 3**c; the free mask has bit i for a free cell i).

A preset with `lines_prefix` (`tiny_lines`) also writes the board's columns and diagonals on one line after
the board, `{board}{lines_sep}{lines_prefix}{col0} {col1} {col2} {diag0} {diag1}`, each line three cells as
a row shows them (e.g. `Lines: X36 1O7 25X XOX 2O6`), also in a final message (then its last line). Its
message has eleven slots: row2's piece then ends with the newlines of `lines_sep` (final or not), and five
more slots sit between row2 and free (`LINE_SLOT_NAMES`; a line's code is final * 27 + line code, cell j of
the line weighing 3**j):

    col0    lines_prefix + cells 0, 3, 6 (e.g. "Lines: X36")
    col1    " " + cells 1, 4, 7;   col2   " " + cells 2, 5, 8;   diag0   " " + cells 0, 4, 8
    diag1   " " + cells 2, 4, 6 + the newlines that follow the board's part (none if final)

(a space goes with the line after it: pre-tokenizers join a space to the letters that follow).
`message_spec(preset)` lists the pieces (host) and `message_codes(state, preset)` computes the codes
(device; without a preset, or for a preset without lines, the six codes above).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import MessageFamily, MessageSpec, Slot
from envs.tictactoe.game import NUM_STATUS, STATUS_WIN, State

FIRST_FINAL_STATUS = STATUS_WIN  # statuses >= this end the game: message without free cells / "Your turn."

# ----------------------------------------------------------------------------------------------------------
# Prompt presets (data)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptPreset:
    """The strings of one prompt style. `{board}` in the system prompt is the empty board; `{k}` a cell."""

    name: str
    system_prompt: str
    status_start_model_first: str = "Game started. You are X."
    status_start_opp_first: str = "Game started. Opponent (O) played at position {k}."
    status_opp_moved: str = "Opponent (O) played at position {k}."
    status_invalid: str = "Invalid move."
    status_no_move: str = "Please provide a move inside <move>...</move> tags."
    status_win: str = "You win!"
    status_draw: str = "It's a draw!"
    status_loss: str = "Opponent (O) played at position {k}. You lose!"
    status_opp_draw: str = "Opponent (O) played at position {k}. It's a draw!"
    # Message layout: {status}{status_board_sep}{board}[{board_free_sep}{free_prefix}{free}{free_turn_sep}{turn}]
    status_board_sep: str = "\n\n"
    board_free_sep: str = "\n\n"
    free_prefix: str = "Available positions: "
    free_turn_sep: str = "\n\n"
    your_turn: str = "Your turn."
    # Board: a cell shows X, O or its index; cells joined by cell_sep, rows by row_sep.
    cell_sep: str = " | "
    row_sep: str = "\n---------\n"
    x_mark: str = "X"
    o_mark: str = "O"
    # The board's columns and diagonals on one more line after it (None: no such line, the presets' default):
    # {board}{lines_sep}{lines_prefix}{col0} {col1} {col2} {diag0} {diag1}, each line's cells as a row shows
    # them. The system prompt's `{board}` stays the rows alone.
    lines_prefix: str | None = None
    lines_sep: str = "\n"

    def status_text(self, status: int, k: int) -> str:
        """The status line for status id `status` and opponent move `k`."""
        templates = (
            self.status_start_model_first,
            self.status_start_opp_first,
            self.status_opp_moved,
            self.status_invalid,
            self.status_no_move,
            self.status_win,
            self.status_draw,
            self.status_loss,
            self.status_opp_draw,
        )
        if not 0 <= int(status) < NUM_STATUS:
            raise ValueError(f"status id {status} out of range 0..{NUM_STATUS - 1}")
        return templates[int(status)].replace("{k}", str(int(k)))


_REFERENCE_SYSTEM = (
    "You are playing a game of Tic-Tac-Toe as X.\n"
    "Your opponent will play as O.\n"
    "\n"
    "Initial board:\n"
    "{board}\n"
    "\n"
    "Your objective is to achieve three X in a row (horizontally, vertically, or diagonally) before the "
    "opponent does.\n"
    "You can only choose one position each turn, and it must be an empty square.\n"
    "\n"
    "You may include a short reasoning process inside <think>...</think> tags.\n"
    "Your final answer must include the position you choose inside <move>...</move> tags.\n"
)

_COMPACT_SYSTEM = (
    "Tic-Tac-Toe. You are X, the opponent is O. Cells:\n"
    "{board}\n"
    "Reply with <think>...</think> then <move>cell</move>.\n"
)

_TINY_SYSTEM = "Tic-Tac-Toe. You are X. Reply <think></think><move>cell</move>.\n{board}\n"

# `tiny`: the shortest messages, for models trained from scratch (a game is about half the tokens of
# `compact`). A board is three 3-character rows (`XO2`, one token a cell with the project tokenizer).
_TINY = PromptPreset(
    name="tiny", system_prompt=_TINY_SYSTEM,
    status_start_model_first="You start.",
    status_start_opp_first="O played {k}.",
    status_opp_moved="O played {k}.",
    status_invalid="Invalid move.",
    status_no_move="No <move> tag.",
    status_win="You win!",
    status_draw="Draw!",
    status_loss="O played {k}. You lose!",
    status_opp_draw="O played {k}. Draw!",
    status_board_sep="\n", board_free_sep="\n", free_prefix="Free: ", free_turn_sep="\n",
    your_turn="Your move.", cell_sep="", row_sep="\n",
)

# `tiny_lines`: `tiny` plus one line after the board with its three columns and two diagonals, so that every
# line of three is three adjacent characters (`Lines: X36 1O7 25X XOX 2O6`), in every message, final ones
# included (ending with it). The system prompt is tiny's: its empty board is the rows alone, no lines line.
_TINY_LINES = dataclasses.replace(_TINY, name="tiny_lines", lines_prefix="Lines: ")

PRESETS: dict[str, PromptPreset] = {
    "reference": PromptPreset(name="reference", system_prompt=_REFERENCE_SYSTEM),
    "compact": PromptPreset(name="compact", system_prompt=_COMPACT_SYSTEM),
    "tiny": _TINY,
    "tiny_lines": _TINY_LINES,
}


# ----------------------------------------------------------------------------------------------------------
# Host rendering
# ----------------------------------------------------------------------------------------------------------


def _cell_text(preset: PromptPreset, index: int, value: int) -> str:
    return str(index) if value == 0 else (preset.x_mark if value == 1 else preset.o_mark)


def _row_text(preset: PromptPreset, row: int, values: Sequence[int]) -> str:
    return preset.cell_sep.join(_cell_text(preset, 3 * row + c, int(values[c])) for c in range(3))


# The columns and diagonals of a lines preset's extra line, in order: the cells of each, in the order shown.
LINE_CELLS = ((0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def _line_text(preset: PromptPreset, line: int, values: Sequence[int]) -> str:
    return preset.cell_sep.join(_cell_text(preset, i, int(values[j])) for j, i in enumerate(LINE_CELLS[line]))


def _row_values(code: int) -> tuple[int, int, int]:
    """Base-3 row code (cell c has weight 3**c) -> the three cell values."""
    return (code % 3, (code // 3) % 3, (code // 9) % 3)


def _free_text(mask: int) -> str:
    """Free-cell bitmask (bit i: cell i empty) -> the Python-list text, e.g. `[0, 1, 3]`."""
    return "[" + ", ".join(str(i) for i in range(9) if mask >> i & 1) + "]"


def _split_leading_ws(s: str) -> tuple[str, str]:
    n = len(s) - len(s.lstrip())
    return s[:n], s[n:]


def _status_piece_text(preset: PromptPreset, status: int, k: int) -> str:
    return preset.status_text(status, k) + preset.status_board_sep


def _row_piece_text(preset: PromptPreset, row: int, code: int, final: bool) -> str:
    text = _row_text(preset, row, _row_values(code))
    if row < 2:
        return text + preset.row_sep
    if preset.lines_prefix is not None:
        return text + _split_leading_ws(preset.lines_sep + preset.lines_prefix)[0]
    return text + _board_end(preset, final)


def _board_end(preset: PromptPreset, final: bool) -> str:
    """The newlines that end the board's part of a message (the leading whitespace of the free part)."""
    return "" if final else _split_leading_ws(preset.board_free_sep + preset.free_prefix)[0]


def _line_piece_text(preset: PromptPreset, line: int, code: int, final: bool) -> str:
    """Slot col0..diag1 of a lines preset: the first carries the line's prefix, the others a space before
    them, the last the newlines after the board's part."""
    text = _line_text(preset, line, _row_values(code))
    if line == 0:
        text = _split_leading_ws(preset.lines_sep + preset.lines_prefix)[1] + text
    else:
        text = " " + text
    return text + _board_end(preset, final) if line == len(LINE_CELLS) - 1 else text


def _free_piece_text(preset: PromptPreset, mask: int, final: bool) -> str:
    if final:
        return ""
    _, rest = _split_leading_ws(preset.board_free_sep + preset.free_prefix)
    lead, _ = _split_leading_ws(preset.free_turn_sep + preset.your_turn)
    return rest + _free_text(mask) + lead


def _turn_piece_text(preset: PromptPreset, final: bool) -> str:
    return "" if final else _split_leading_ws(preset.free_turn_sep + preset.your_turn)[1]


def _board_cells(board: Sequence[int]) -> list[int]:
    cells = [int(v) for v in np.asarray(board).reshape(-1)]
    if len(cells) != 9 or any(v not in (0, 1, 2) for v in cells):
        raise ValueError(f"board must be 9 cells of 0 (empty), 1 (X), 2 (O); got {cells}")
    return cells


def _board_codes(board: Sequence[int]) -> tuple[list[int], int]:
    cells = _board_cells(board)
    rows = [cells[3 * r] + 3 * cells[3 * r + 1] + 9 * cells[3 * r + 2] for r in range(3)]
    mask = sum(1 << i for i in range(9) if cells[i] == 0)
    return rows, mask


def _line_codes(board: Sequence[int]) -> list[int]:
    cells = _board_cells(board)
    return [sum(cells[i] * 3**j for j, i in enumerate(line)) for line in LINE_CELLS]


def _message_pieces(preset: PromptPreset, board: Sequence[int], status: int, k: int) -> list[str]:
    """The text pieces (status, row0, row1, row2, [col0 .. diag1,] free, turn) of one environment message."""
    rows, mask = _board_codes(board)
    final = int(status) >= FIRST_FINAL_STATUS
    lines = ([] if preset.lines_prefix is None else
             [_line_piece_text(preset, j, c, final) for j, c in enumerate(_line_codes(board))])
    return [
        _status_piece_text(preset, status, max(int(k), 0)),
        *(_row_piece_text(preset, r, rows[r], final) for r in range(3)),
        *lines,
        _free_piece_text(preset, mask, final),
        _turn_piece_text(preset, final),
    ]


def render_board(preset: PromptPreset, board: Sequence[int]) -> str:
    """The board as text: rows `a | b | c` separated by `---------` (empty cells show their index)."""
    rows, _ = _board_codes(board)
    return preset.row_sep.join(_row_text(preset, r, _row_values(rows[r])) for r in range(3))


def render_message(preset: PromptPreset, board: Sequence[int], status: int, last_opponent_move: int) -> str:
    """The environment message for a state: `{status}\\n\\n{board}` (+ the lines line of a lines preset; + free
    cells and `Your turn.` unless final)."""
    return "".join(_message_pieces(preset, board, status, last_opponent_move))


def system_prompt(preset: PromptPreset) -> str:
    """The system prompt with the empty board filled in."""
    return preset.system_prompt.replace("{board}", render_board(preset, [0] * 9))


# ----------------------------------------------------------------------------------------------------------
# The message as slots (the text bridge's view)
# ----------------------------------------------------------------------------------------------------------

SLOT_NAMES = ("status", "row0", "row1", "row2", "free", "turn")
LINE_SLOT_NAMES = ("col0", "col1", "col2", "diag0", "diag1")  # a lines preset's, between row2 and free


def slot_names(preset: PromptPreset) -> tuple[str, ...]:
    """The slots of `preset`'s messages, in order."""
    return SLOT_NAMES if preset.lines_prefix is None else SLOT_NAMES[:4] + LINE_SLOT_NAMES + SLOT_NAMES[4:]


@functools.lru_cache(maxsize=None)
def message_spec(preset: PromptPreset) -> MessageSpec:
    """The slots and pieces of `preset`'s messages, and the two families (game on / final) that occur."""
    status = [_status_piece_text(preset, s, k) for s in range(NUM_STATUS) for k in range(9)]
    rows = [[_row_piece_text(preset, r, c, bool(f)) for f in range(2) for c in range(27)] for r in range(3)]
    free = [_free_piece_text(preset, m, bool(f)) for f in range(2) for m in range(512)]
    turn = [_turn_piece_text(preset, bool(f)) for f in range(2)]
    has_lines = preset.lines_prefix is not None
    lines = [[_line_piece_text(preset, j, c, bool(f)) for f in range(2) for c in range(27)]
             for j in range(len(LINE_CELLS))] if has_lines else []
    slots = (Slot("status", tuple(status)), *(Slot(f"row{r}", tuple(rows[r])) for r in range(3)),
             *(Slot(name, tuple(pieces)) for name, pieces in zip(LINE_SLOT_NAMES, lines)),
             Slot("free", tuple(free)), Slot("turn", tuple(turn)))

    def family(final: int) -> MessageFamily:
        statuses = range(FIRST_FINAL_STATUS, NUM_STATUS) if final else range(FIRST_FINAL_STATUS)
        row = tuple(final * 27 + c for c in range(27))
        return MessageFamily((tuple(s * 9 + k for s in statuses for k in range(9)), row, row, row,
                              *((row,) * len(lines)), tuple(final * 512 + m for m in range(512)), (final,)),
                             final=bool(final))

    return MessageSpec(slots, (family(0), family(1)))


_ROW_WEIGHTS = np.array([1, 3, 9], np.int32)
_LINE_CELLS = np.array(LINE_CELLS, np.int32)


def message_codes(state: State, preset: PromptPreset | None = None) -> jax.Array:
    """State (one game) -> int32[len(slot_names(preset))]: the piece code of each slot of the message the
    state shows (int32[6] without a preset or for a preset without lines; int32[11] with lines). The preset
    is static (only its slot layout matters)."""
    board = jnp.asarray(state.board).astype(jnp.int32).reshape(9)
    status = jnp.clip(jnp.asarray(state.status).astype(jnp.int32), 0, NUM_STATUS - 1)
    k = jnp.clip(jnp.asarray(state.last_opponent_move).astype(jnp.int32), 0, 8)
    final = (status >= FIRST_FINAL_STATUS).astype(jnp.int32)
    rows = (board.reshape(3, 3) * _ROW_WEIGHTS).sum(axis=1)
    mask = jnp.sum(jnp.where(board == 0, 1 << jnp.arange(9, dtype=jnp.int32), 0))
    lines = []
    if preset is not None and preset.lines_prefix is not None:
        line_codes = (board[_LINE_CELLS] * _ROW_WEIGHTS).sum(axis=1)
        lines = [final * 27 + line_codes[j] for j in range(len(LINE_CELLS))]
    return jnp.stack([status * 9 + k, final * 27 + rows[0], final * 27 + rows[1], final * 27 + rows[2],
                      *lines, final * 512 + mask, final]).astype(jnp.int32)
