"""experiments/blunders.py: the exact values it reads losing moves by, and its classes on hand-made games."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("blunders", ROOT / "experiments" / "blunders.py")
blunders = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blunders)


def record(model_moves, opponent_moves, model_first=True):
    """An evaluation record as `eval_*.jsonl` holds it: the opponent's moves in the user messages ("O played k"),
    the model's in `reply_values` (None: a reply that is not a move)."""
    parts, values = ["system\nTic-Tac-Toe."], list(model_moves)
    ops = list(opponent_moves)
    if not model_first:
        parts.append(f"user\nO played {ops.pop(0)}.\nYour move.")
    else:
        parts.append("user\nYou start.\nYour move.")
    for i, _ in enumerate(values):
        parts.append("assistant\n<move>?</move>")
        if i < len(ops):
            parts.append(f"user\nO played {ops[i]}.\nYour move.")
    return {"conversation": "".join("<|im_start|>" + p + "<|im_end|>\n" for p in parts),
            "reply_kinds": ["valid" if v is not None else "invalid" for v in values],
            "reply_values": [v if v is not None else 0 for v in values], "outcome": "loss", "setting": "optimal"}


def test_exact_values():
    empty = tuple("." * 9)
    assert blunders.value(empty, "X") == 0  # perfect play draws
    # X in a corner, O on an edge next to it: X wins with best play.
    assert blunders.value(blunders.place(blunders.place(empty, 0, "X"), 1, "O"), "X") == 1


def test_a_missed_block_a_fork_and_an_invalid_reply_are_told_apart():
    # X 0, O 4, X 1, O 2 (O threatens 2-4-6), X 8 instead of 6: a missed block at the model's third move.
    assert blunders.classify(record([0, 1, 8], [4, 2, 6])) == [(3, "missed block")]
    # X 4, O 0, X 8 (fine), O 2 (O threatens 1), X 1 blocks; no losing move in this line.
    assert blunders.classify(record([4, 8, 1], [0, 2, 7])) == []
    # The model second: O 0, X 1 (an edge next to the corner: lost against best play, no threat yet).
    assert blunders.classify(record([1], [0], model_first=False)) == [(1, "fork allowed / other")]
    # An occupied cell is an invalid move, not a placement.
    assert blunders.classify(record([0, 0], [4], model_first=True))[0] == (2, "invalid")
