"""Where a Tic-Tac-Toe model loses: each model move of the evaluation games (`eval_*.jsonl`) that turned a
position it could still hold (draw or better, by exact minimax) into a lost one, classified as
- missed win: the model had a winning move and did not take it (and then lost);
- missed block: the opponent threatened to win next move, and the model did not block;
- fork allowed / other: no immediate threat, yet the move loses against best play (a deeper mistake);
- invalid: an invalid reply or an occupied cell (the board unchanged; counted, not classified).

    python experiments/blunders.py runs/cpu_from_reward_games/eval_after_RL.jsonl [--setting optimal]

Prints a table of the losing moves by kind and by the model's move number, and one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections import Counter

import numpy as np

from envs.tictactoe import rules
from envs.tictactoe.minimax import minimax_value

MARKS = {".": rules.EMPTY, "X": rules.X, "O": rules.O}


def _cells(board: tuple) -> np.ndarray:
    return np.asarray([MARKS[v] for v in board], np.int8)


def winner(board: tuple) -> str | None:
    """The mark ("X" or "O") when it has three in a row (the env's `rules.winner`), else None."""
    return {rules.X: "X", rules.O: "O"}.get(int(rules.winner(_cells(board))))


@functools.lru_cache(maxsize=None)
def value(board: tuple, to_move: str) -> int:
    """Exact game value for X: +1 X wins, 0 draw, -1 O wins, with `to_move` to play (the env's minimax table)."""
    w = winner(board)
    if w is not None:
        return 1 if w == "X" else -1
    v = int(minimax_value(_cells(board), rules.X if to_move == "X" else rules.O))
    return v if to_move == "X" else -v


def place(board: tuple, cell: int, mark: str) -> tuple:
    return board[:cell] + (mark,) + board[cell + 1:]


def wins_now(board: tuple, mark: str) -> list[int]:
    return [i for i, v in enumerate(board) if v == "." and winner(place(board, i, mark)) == mark]


def game_moves(record: dict) -> list[tuple[str, int | None]]:
    """The moves in order from the conversation: ("O", cell) for the opponent, ("X", cell or None) for the model
    (None: an invalid or missing reply)."""
    moves, values = [], iter(zip(record["reply_kinds"], record["reply_values"]))
    for part in re.split(r"<\|im_start\|>", record["conversation"]):
        if part.startswith("user"):
            m = re.search(r"O played (\d)", part)
            if m:
                moves.append(("O", int(m.group(1))))
        elif part.startswith("assistant"):
            kind, val = next(values)
            moves.append(("X", int(val) if kind == "valid" else None))
    return moves


def classify(record: dict) -> list[tuple[int, str]]:
    """(model move number, kind) of each losing move of one game."""
    board, out, turn = tuple("." * 9), [], 0
    for who, cell in game_moves(record):
        if who == "O":
            board = place(board, cell, "O")
            continue
        turn += 1
        if cell is None or board[cell] != ".":  # no move, or an occupied cell (the board is unchanged)
            out.append((turn, "invalid"))
            continue
        before = value(board, "X")
        after_board = place(board, cell, "X")
        after = value(after_board, "O") if winner(after_board) is None else 1
        if before >= 0 and after < 0:
            if wins_now(board, "X"):
                kind = "missed win"
            elif wins_now(board, "O"):
                kind = "missed block"
            else:
                kind = "fork allowed / other"
            out.append((turn, kind))
        board = after_board
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("games", help="an evaluation's games, e.g. runs/<run>/eval_after_RL.jsonl")
    parser.add_argument("--setting", default="optimal", help="the evaluation setting to read (default: optimal)")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in open(args.games)]
    records = [r for r in records if r["setting"] == args.setting]
    if not records:
        raise SystemExit(f"no games of setting {args.setting!r} in {args.games}")
    kinds, turns, lost = Counter(), Counter(), 0
    for r in records:
        blunders = classify(r)
        lost += r["outcome"] == "loss"
        for turn, kind in blunders:
            kinds[kind] += 1
            if kind != "invalid":
                turns[turn] += 1
    print(f"{len(records)} games vs {args.setting}: {lost} lost")
    print("| losing move | count |\n|---|---|")
    for kind in ("missed win", "missed block", "fork allowed / other", "invalid"):
        print(f"| {kind} | {kinds[kind]} |")
    print("| by model move | " + " | ".join(f"{t}: {turns[t]}" for t in sorted(turns)) + " |")
    summary = {"games": len(records), "lost": lost, "kinds": dict(kinds),
               "by_move": {str(t): n for t, n in sorted(turns.items())}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
