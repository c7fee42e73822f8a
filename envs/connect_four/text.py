"""Connect Four's text: prompt presets (data), host rendering, and the message as slots of piece tables.

A message (preset `tiny`) is the status line, the board as six text rows (the top row first, one digit a
cell: 0 empty, 1 the model's piece X, 2 the opponent's O), the column index line and, while the game goes
on, the playable columns and the turn line:

    O played 3.
    0000000
    0000000
    0000000
    0000000
    0001000
    0012000
    0123456
    Free: 0123456
    Your move.

Cells are digits because the project tokenizer's pre-tokenizer isolates every digit (one token a cell, no
merge across cells), so a cell is a slot of three pieces and the text bridge's pairwise check is exact.
Slots (46): `status` (code status * 7 + k, k the opponent's last column, the piece ends with "\\n"), the 42
cells `r5c0` .. `r0c6` (top row first; code = the cell's value 0 / 1 / 2; a row's last cell ends with "\\n"),
`index` (the column line, one piece), `free` (code final * 128 + mask of the playable columns: "\\nFree: "
and the digits, "" when final) and `turn` (code final: "\\nYour move." or "").
`message_spec(preset)` lists the pieces (host), `message_codes(state)` computes the codes (device),
`render_message` is the plain host rendering (a test checks them against an independent rendering).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.connect_four.game import COLUMNS, FIRST_FINAL_STATUS, NUM_STATUS, ROWS, State, cells, legal_columns
from envs.core import MessageFamily, MessageSpec, Slot


@dataclasses.dataclass(frozen=True)
class PromptPreset:
    """The strings of one prompt style (status templates: `{k}` is the opponent's last column)."""

    name: str
    system_prompt: str
    statuses: tuple[str, ...]  # per STATUS_* id
    free_prefix: str = "Free: "
    your_turn: str = "Your move."
    cell_marks: tuple[str, str, str] = ("0", "1", "2")  # empty, X, O: digits (see the module docstring)

    def status_text(self, status: int, k: int) -> str:
        if not 0 <= int(status) < NUM_STATUS:
            raise ValueError(f"status id {status} out of range 0..{NUM_STATUS - 1}")
        return self.statuses[int(status)].replace("{k}", str(int(k)))


_TINY_STATUSES = ("You start.", "O played {k}.", "O played {k}.", "Invalid move.", "No <move> tag.", "You win!",
                  "Draw!", "O played {k}. You lose!", "O played {k}. Draw!")
_REFERENCE_STATUSES = (
    "Game started. You are X (1).", "Game started. Opponent (O, 2) played in column {k}.",
    "Opponent (O, 2) played in column {k}.", "Invalid move: that column is full or not 0-6.",
    "Please provide a move inside <move>...</move> tags.", "You win!", "It's a draw!",
    "Opponent (O, 2) played in column {k}. You lose!", "Opponent (O, 2) played in column {k}. It's a draw!")

PRESETS: dict[str, PromptPreset] = {
    # `tiny`: short messages for models trained from scratch (a message is about 70 tokens).
    "tiny": PromptPreset(
        name="tiny", statuses=_TINY_STATUSES,
        system_prompt="Connect Four. You are 1, O is 2, 0 is empty. Reply <think></think><move>column</move>.\n"),
    "reference": PromptPreset(
        name="reference", statuses=_REFERENCE_STATUSES, free_prefix="Playable columns: ", your_turn="Your turn.",
        system_prompt=(
            "You are playing Connect Four as X (shown as 1); your opponent is O (shown as 2); 0 is an empty "
            "cell.\nThe board has 6 rows and 7 columns, numbered 0-6 on the line under it. A piece dropped in a "
            "column lands on its lowest empty cell. Four of your pieces in a row, column or diagonal win.\n"
            "You may include a short reasoning process inside <think>...</think> tags.\n"
            "Your final answer must include the column you choose inside <move>...</move> tags.\n")),
}

INDEX_LINE = "".join(str(c) for c in range(COLUMNS))
SLOT_NAMES = ("status", *(f"r{r}c{c}" for r in reversed(range(ROWS)) for c in range(COLUMNS)), "index", "free",
              "turn")


# ----------------------------------------------------------------------------------------------------------
# Host rendering
# ----------------------------------------------------------------------------------------------------------


def _check_board(board) -> np.ndarray:
    board = np.asarray(board)
    if board.shape != (ROWS, COLUMNS) or not np.isin(board, (0, 1, 2)).all():
        raise ValueError(f"a board is int[{ROWS}, {COLUMNS}] of 0 (empty), 1 (X), 2 (O), row 0 at the bottom; "
                         f"got shape {board.shape}")
    return board.astype(int)


def render_board(preset: PromptPreset, board) -> str:
    """int[6, 7] cells (row 0 at the bottom) -> the rows top first and the column index line."""
    board = _check_board(board)
    rows = ["".join(preset.cell_marks[v] for v in board[r]) for r in reversed(range(ROWS))]
    return "\n".join(rows + [INDEX_LINE])


def free_text(mask: int) -> str:
    """7-bit mask of the playable columns -> their digits, e.g. `0236`."""
    return "".join(str(c) for c in range(COLUMNS) if mask >> c & 1)


def render_message(preset: PromptPreset, board, status: int, last_opponent_move: int) -> str:
    """The environment message of a state (host; see the module docstring)."""
    board = _check_board(board)
    text = preset.status_text(status, max(int(last_opponent_move), 0)) + "\n" + render_board(preset, board)
    if int(status) < FIRST_FINAL_STATUS:
        mask = sum(1 << c for c in range(COLUMNS) if board[ROWS - 1, c] == 0)
        text += "\n" + preset.free_prefix + free_text(mask) + "\n" + preset.your_turn
    return text


def system_prompt(preset: PromptPreset) -> str:
    return preset.system_prompt


# ----------------------------------------------------------------------------------------------------------
# The message as slots
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def message_spec(preset: PromptPreset) -> MessageSpec:
    """The 46 slots of `preset`'s messages and the two families (game on / final)."""
    status = Slot("status", tuple(preset.status_text(s, k) + "\n" for s in range(NUM_STATUS) for k in range(COLUMNS)))
    cell_slots = []
    for name in SLOT_NAMES[1:1 + ROWS * COLUMNS]:
        end = "\n" if name.endswith(f"c{COLUMNS - 1}") else ""
        cell_slots.append(Slot(name, tuple(mark + end for mark in preset.cell_marks)))
    free = Slot("free", tuple("" if f else "\n" + preset.free_prefix + free_text(m) for f in range(2)
                              for m in range(1 << COLUMNS)))
    turn = Slot("turn", ("\n" + preset.your_turn, ""))
    slots = (status, *cell_slots, Slot("index", (INDEX_LINE,)), free, turn)

    def family(final: int) -> MessageFamily:
        statuses = range(FIRST_FINAL_STATUS, NUM_STATUS) if final else range(FIRST_FINAL_STATUS)
        masks = range(1, 1 << COLUMNS) if not final else range(1 << COLUMNS)
        return MessageFamily((tuple(s * COLUMNS + k for s in statuses for k in range(COLUMNS)),
                              *((None,) * (ROWS * COLUMNS)), None, tuple(final * 128 + m for m in masks), (final,)),
                             final=bool(final))

    return MessageSpec(slots, (family(0), family(1)))


def message_codes(state: State) -> jax.Array:
    """State (one game) -> int32[46]: the piece code of each slot of the message the state shows."""
    status = jnp.clip(jnp.asarray(state.status).astype(jnp.int32), 0, NUM_STATUS - 1)
    k = jnp.clip(jnp.asarray(state.last_opponent_move).astype(jnp.int32), 0, COLUMNS - 1)
    final = (status >= FIRST_FINAL_STATUS).astype(jnp.int32)
    board = cells(state.x, state.o).astype(jnp.int32)[::-1].reshape(-1)  # top row first
    mask = (legal_columns(state.x, state.o).astype(jnp.int32) << jnp.arange(COLUMNS, dtype=jnp.int32)).sum()
    head = jnp.stack([status * COLUMNS + k])
    tail = jnp.stack([jnp.int32(0), final * 128 + mask, final])
    return jnp.concatenate([head, board, tail]).astype(jnp.int32)


def board_of_codes(codes: Sequence[int]) -> np.ndarray:
    """The cells of a message's codes (host; for tests and records): int[6, 7], row 0 at the bottom."""
    cells_top_first = np.asarray(codes)[1:1 + ROWS * COLUMNS].reshape(ROWS, COLUMNS)
    return cells_top_first[::-1].copy()
