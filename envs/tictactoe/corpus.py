"""Tic-Tac-Toe's text for training the project tokenizer (`TicTacToe.tokenizer_corpus`, used by
`python -m jaxrl_llm.text.build_tokenizer`): both prompt presets' system prompts, every message form on every
reachable board, and short reasoning phrases, in a fixed order."""

from __future__ import annotations

from envs.tictactoe import game, text


def _reachable_boards() -> list[tuple[int, ...]]:
    """Every board reachable in a game (either side first), in a fixed order (the game's own rules)."""
    won, full = game.terminal_tables()
    pow3 = [3**i for i in range(9)]
    seen: dict[tuple[tuple[int, ...], int], None] = {}
    stack = [((0,) * 9, 1), ((0,) * 9, 2)]
    while stack:
        board, player = stack.pop()
        key = (board, player)
        if key in seen:
            continue
        seen[key] = None
        index = sum(v * p for v, p in zip(board, pow3))
        if won[index] or full[index]:
            continue
        for i in range(9):
            if board[i] == 0:
                nb = list(board)
                nb[i] = player
                stack.append((tuple(nb), 3 - player))
    return sorted({b for b, _ in seen})


def corpus() -> list[str]:
    """The training text, in a fixed order (`TicTacToe.tokenizer_corpus`)."""
    out: list[str] = []
    boards = _reachable_boards()
    for preset in (text.PRESETS["reference"], text.PRESETS["compact"]):
        out += [text.system_prompt(preset)] * 50
        for i, board in enumerate(boards):
            status = i % game.NUM_STATUS
            k = (i * 7) % 9
            out.append(text.render_message(preset, board, status, k))
    for k in range(9):
        out += [
            f"<think>I can win at {k}.</think>\n<move>{k}</move>",
            f"<think>I must block at {k}.</think>\n<move>{k}</move>",
            f"<think>Centre is strongest.</think>\n<move>{k}</move>",
            f"<think>Corner is strong.</think>\n<move>{k}</move>",
            f"<think>I take {k}.</think><move>{k}</move>",
            f"<move>{k}</move>",
        ] * 20
    return out
