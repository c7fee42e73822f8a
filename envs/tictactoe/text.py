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
`message_spec(preset)` lists the pieces (host) and `message_codes(state)` computes the codes (device).
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

PRESETS: dict[str, PromptPreset] = {
    "reference": PromptPreset(name="reference", system_prompt=_REFERENCE_SYSTEM),
    "compact": PromptPreset(name="compact", system_prompt=_COMPACT_SYSTEM),
    "tiny": _TINY,
}


# ----------------------------------------------------------------------------------------------------------
# Host rendering
# ----------------------------------------------------------------------------------------------------------


def _cell_text(preset: PromptPreset, index: int, value: int) -> str:
    return str(index) if value == 0 else (preset.x_mark if value == 1 else preset.o_mark)


def _row_text(preset: PromptPreset, row: int, values: Sequence[int]) -> str:
    return preset.cell_sep.join(_cell_text(preset, 3 * row + c, int(values[c])) for c in range(3))


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
    if final:
        return text
    lead, _ = _split_leading_ws(preset.board_free_sep + preset.free_prefix)
    return text + lead


def _free_piece_text(preset: PromptPreset, mask: int, final: bool) -> str:
    if final:
        return ""
    _, rest = _split_leading_ws(preset.board_free_sep + preset.free_prefix)
    lead, _ = _split_leading_ws(preset.free_turn_sep + preset.your_turn)
    return rest + _free_text(mask) + lead


def _turn_piece_text(preset: PromptPreset, final: bool) -> str:
    return "" if final else _split_leading_ws(preset.free_turn_sep + preset.your_turn)[1]


def _board_codes(board: Sequence[int]) -> tuple[list[int], int]:
    cells = [int(v) for v in np.asarray(board).reshape(-1)]
    if len(cells) != 9 or any(v not in (0, 1, 2) for v in cells):
        raise ValueError(f"board must be 9 cells of 0 (empty), 1 (X), 2 (O); got {cells}")
    rows = [cells[3 * r] + 3 * cells[3 * r + 1] + 9 * cells[3 * r + 2] for r in range(3)]
    mask = sum(1 << i for i in range(9) if cells[i] == 0)
    return rows, mask


def _message_pieces(preset: PromptPreset, board: Sequence[int], status: int, k: int) -> list[str]:
    """The text pieces (status, row0, row1, row2, free, turn) of one environment message."""
    rows, mask = _board_codes(board)
    final = int(status) >= FIRST_FINAL_STATUS
    return [
        _status_piece_text(preset, status, max(int(k), 0)),
        *(_row_piece_text(preset, r, rows[r], final) for r in range(3)),
        _free_piece_text(preset, mask, final),
        _turn_piece_text(preset, final),
    ]


def render_board(preset: PromptPreset, board: Sequence[int]) -> str:
    """The board as text: rows `a | b | c` separated by `---------` (empty cells show their index)."""
    rows, _ = _board_codes(board)
    return preset.row_sep.join(_row_text(preset, r, _row_values(rows[r])) for r in range(3))


def render_message(preset: PromptPreset, board: Sequence[int], status: int, last_opponent_move: int) -> str:
    """The environment message for a state: `{status}\\n\\n{board}` (+ free cells and `Your turn.` unless final)."""
    return "".join(_message_pieces(preset, board, status, last_opponent_move))


def system_prompt(preset: PromptPreset) -> str:
    """The system prompt with the empty board filled in."""
    return preset.system_prompt.replace("{board}", render_board(preset, [0] * 9))


# ----------------------------------------------------------------------------------------------------------
# The message as slots (the text bridge's view)
# ----------------------------------------------------------------------------------------------------------

SLOT_NAMES = ("status", "row0", "row1", "row2", "free", "turn")


@functools.lru_cache(maxsize=None)
def message_spec(preset: PromptPreset) -> MessageSpec:
    """The slots and pieces of `preset`'s messages, and the two families (game on / final) that occur."""
    status = [_status_piece_text(preset, s, k) for s in range(NUM_STATUS) for k in range(9)]
    rows = [[_row_piece_text(preset, r, c, bool(f)) for f in range(2) for c in range(27)] for r in range(3)]
    free = [_free_piece_text(preset, m, bool(f)) for f in range(2) for m in range(512)]
    turn = [_turn_piece_text(preset, bool(f)) for f in range(2)]
    slots = (Slot("status", tuple(status)), *(Slot(f"row{r}", tuple(rows[r])) for r in range(3)),
             Slot("free", tuple(free)), Slot("turn", tuple(turn)))

    def family(final: int) -> MessageFamily:
        statuses = range(FIRST_FINAL_STATUS, NUM_STATUS) if final else range(FIRST_FINAL_STATUS)
        row = tuple(final * 27 + c for c in range(27))
        return MessageFamily((tuple(s * 9 + k for s in statuses for k in range(9)), row, row, row,
                              tuple(final * 512 + m for m in range(512)), (final,)), final=bool(final))

    return MessageSpec(slots, (family(0), family(1)))


_ROW_WEIGHTS = np.array([1, 3, 9], np.int32)


def message_codes(state: State) -> jax.Array:
    """State (one game) -> int32[6]: the piece code of each slot of the message the state shows."""
    board = jnp.asarray(state.board).astype(jnp.int32).reshape(9)
    status = jnp.clip(jnp.asarray(state.status).astype(jnp.int32), 0, NUM_STATUS - 1)
    k = jnp.clip(jnp.asarray(state.last_opponent_move).astype(jnp.int32), 0, 8)
    final = (status >= FIRST_FINAL_STATUS).astype(jnp.int32)
    rows = (board.reshape(3, 3) * _ROW_WEIGHTS).sum(axis=1)
    mask = jnp.sum(jnp.where(board == 0, 1 << jnp.arange(9, dtype=jnp.int32), 0))
    return jnp.stack([status * 9 + k, final * 27 + rows[0], final * 27 + rows[1], final * 27 + rows[2],
                      final * 512 + mask, final]).astype(jnp.int32)
