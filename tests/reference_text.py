"""An independent host-side implementation of the Tic-Tac-Toe text spec (shared/TICTACTOE_SPEC.md).

Written from the spec alone, without importing jaxrl_llm, so tests can compare the package against it:
the exact texts of the `reference` preset, Python-`re` parsing of a reply, and a small random game player
that produces messages of every status kind (both first movers, invalid and missing moves).
"""

from __future__ import annotations

import random
import re

# status ids (docs/CONTRACTS.md)
START_MODEL_FIRST, START_OPP_FIRST, OPP_MOVED, INVALID, NO_MOVE = 0, 1, 2, 3, 4
WIN, DRAW, LOSS, OPP_DRAW = 5, 6, 7, 8
FINAL = (WIN, DRAW, LOSS, OPP_DRAW)

MOVE_RE = re.compile(r"<move>\s*(.*?)\s*</move>", re.DOTALL)
FORMAT_RE = re.compile(r"<think>.*?</think>.*?<move>.*?</move>", re.DOTALL)

WIN_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def board_text(board) -> str:
    """`a | b | c` rows separated by nine dashes; empty cells show their index."""
    marks = {1: "X", 2: "O"}
    cells = [marks.get(int(v), str(i)) for i, v in enumerate(board)]
    rows = [" | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
    return "\n---------\n".join(rows)


SYSTEM_PROMPT = f"""You are playing a game of Tic-Tac-Toe as X.
Your opponent will play as O.

Initial board:
{board_text([0] * 9)}

Your objective is to achieve three X in a row (horizontally, vertically, or diagonally) before the opponent does.
You can only choose one position each turn, and it must be an empty square.

You may include a short reasoning process inside <think>...</think> tags.
Your final answer must include the position you choose inside <move>...</move> tags.
"""


def status_text(status: int, k: int) -> str:
    """The spec's status strings."""
    return {
        START_MODEL_FIRST: "Game started. You are X.",
        START_OPP_FIRST: f"Game started. Opponent (O) played at position {k}.",
        OPP_MOVED: f"Opponent (O) played at position {k}.",
        INVALID: "Invalid move.",
        NO_MOVE: "Please provide a move inside <move>...</move> tags.",
        WIN: "You win!",
        DRAW: "It's a draw!",
        LOSS: f"Opponent (O) played at position {k}. You lose!",
        OPP_DRAW: f"Opponent (O) played at position {k}. It's a draw!",
    }[status]


def message(board, status: int, k: int) -> str:
    """The environment message for (board, status, last opponent move)."""
    head = f"{status_text(status, k)}\n\n{board_text(board)}"
    if status in FINAL:
        return head
    free = [i for i in range(9) if int(board[i]) == 0]
    return f"{head}\n\nAvailable positions: {free}\n\nYour turn."


# The project's `tiny` preset (short messages for models trained from scratch), written out here on its own.
TINY_SYSTEM = "Tic-Tac-Toe. You are X. Reply <think></think><move>cell</move>.\n012\n345\n678\n"


def tiny_message(board, status: int, k: int) -> str:
    """The `tiny` preset's message: status, the board as three 3-character rows, free cells, `Your move.`."""
    marks = {1: "X", 2: "O"}
    cells = "".join(marks.get(int(v), str(i)) for i, v in enumerate(board))
    status_line = {
        START_MODEL_FIRST: "You start.", START_OPP_FIRST: f"O played {k}.", OPP_MOVED: f"O played {k}.",
        INVALID: "Invalid move.", NO_MOVE: "No <move> tag.", WIN: "You win!", DRAW: "Draw!",
        LOSS: f"O played {k}. You lose!", OPP_DRAW: f"O played {k}. Draw!",
    }[status]
    head = f"{status_line}\n{cells[0:3]}\n{cells[3:6]}\n{cells[6:9]}"
    if status in FINAL:
        return head
    free = [i for i in range(9) if int(board[i]) == 0]
    return f"{head}\nFree: {free}\nYour move."


# The project's `tiny_lines` preset: `tiny` plus, right after the board, one line writing out the three
# columns and the two diagonals, three cells each as the rows show them (final messages end with it).
TINY_LINES_SYSTEM = TINY_SYSTEM  # the empty board of the system prompt is the rows alone

COLUMNS_AND_DIAGONALS = [(0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def tiny_lines_message(board, status: int, k: int) -> str:
    """The `tiny_lines` preset's message: the `tiny` one with `Lines: c0 c1 c2 d0 d1` after the board."""
    marks = {1: "X", 2: "O"}
    cells = [marks.get(int(v), str(i)) for i, v in enumerate(board)]
    lines_line = "Lines: " + " ".join(cells[a] + cells[b] + cells[c] for a, b, c in COLUMNS_AND_DIAGONALS)
    text = tiny_message(board, status, k)
    board_end = len(text) if status in FINAL else text.index("\nFree: ")
    return text[:board_end] + "\n" + lines_line + text[board_end:]


def parse_move(text: str) -> int:
    """-1 without a <move> tag, d for exactly str(d) (d in 0..8), 9 for any other tag content."""
    m = MOVE_RE.search(text)
    if m is None:
        return -1
    content = m.group(1).strip()
    for d in range(9):
        if content == str(d):
            return d
    return 9


def format_ok(text: str) -> bool:
    """The format reward's test (re.search, as the reference environment does)."""
    return FORMAT_RE.search(text) is not None


def parse_bytes(data: bytes) -> tuple[int, bool]:
    """Both parses of a reply given as bytes (decoded with errors='replace')."""
    text = data.decode("utf-8", errors="replace")
    return parse_move(text), format_ok(text)


def _winner(board) -> int:
    for a, b, c in WIN_LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return 0


REASONS = ["I can win at {m}.", "I must block at {m}.", "Centre is strongest.", "Corner is strong.", "I pick {m}."]


def _reply(rng: random.Random, kind: str, board) -> tuple[str, int]:
    free = [i for i in range(9) if board[i] == 0]
    taken = [i for i in range(9) if board[i] != 0]
    if kind == "valid":
        m = rng.choice(free)
        move_text = str(m)
    elif kind == "invalid":
        m = rng.choice(taken) if taken and rng.random() < 0.6 else 9
        move_text = rng.choice([str(m), "9", "10", "x", ""]) if m == 9 else str(m)
    else:
        m = -1
    reason = rng.choice(REASONS).format(m=m if m >= 0 else 4)
    if kind == "missing":
        text = rng.choice([f"<think>{reason}</think>", reason, "I play 4.", "<move 4>"])
    else:
        text = rng.choice(
            [f"<think>{reason}</think>\n<move>{move_text}</move>", f"<move>{move_text}</move>",
             f"<think>{reason}</think><move>{move_text}</move>", f"{reason} <move>{move_text}</move>"]
        )
    return text, m


def random_game(rng: random.Random, max_turns: int = 8):
    """Play a random game. Returns (messages, replies): messages[i] = (board, status, k) of the i-th user
    message, replies[i] the model's reply after it. Ends after a final message or at max_turns replies."""
    board = [0] * 9
    k = -1
    if rng.random() < 0.5:
        status = START_MODEL_FIRST
    else:
        k = rng.randrange(9)
        board[k] = 2
        status = START_OPP_FIRST
    messages, replies = [(tuple(board), status, k)], []
    for _ in range(max_turns):
        kind = rng.choices(["valid", "invalid", "missing"], [0.7, 0.15, 0.15])[0]
        text, m = _reply(rng, kind, board)
        replies.append(text)
        if parse_move(text) == -1:
            status = NO_MOVE
        elif not (0 <= m <= 8 and board[m] == 0):
            status = INVALID
        else:
            board[m] = 1
            if _winner(board) == 1:
                status = WIN
            elif all(board):
                status = DRAW
            else:
                k = rng.choice([i for i in range(9) if board[i] == 0])
                board[k] = 2
                if _winner(board) == 2:
                    status = LOSS
                elif all(board):
                    status = OPP_DRAW
                else:
                    status = OPP_MOVED
        messages.append((tuple(board), status, k))
        if status in FINAL:
            break
    return messages, replies


def conversation(messages, replies, upto: int, system: str = SYSTEM_PROMPT, render=message) -> list[dict]:
    """Chat messages: system, then user messages 0..upto with the replies between them (`render`: the
    message function, `message`, `tiny_message` or `tiny_lines_message`)."""
    conv = [{"role": "system", "content": system}]
    for i in range(upto + 1):
        if i:
            conv.append({"role": "assistant", "content": replies[i - 1]})
        board, status, k = messages[i]
        conv.append({"role": "user", "content": render(board, status, k)})
    return conv
