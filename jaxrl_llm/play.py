"""`jaxrl-llm play`: a person plays O against the model (X) in the terminal.

The conversation is the one the model was trained on: the preset's system prompt, the environment's
messages rendered by `text.render_message`, the model's replies decoded greedily with the sampler. The
person's moves take the opponent's place; the model's replies go through the on-device parser.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs import tictactoe as ttt
from jaxrl_llm import sampling, text


def _ask_cell(board: list[int], input_fn: Callable[[str], str], print_fn) -> int:
    while True:
        answer = input_fn(f"your move (O), one of {[i for i in range(9) if board[i] == 0]}: ").strip()
        if answer.isdigit() and 0 <= int(answer) <= 8 and board[int(answer)] == 0:
            return int(answer)
        print_fn(f"  {answer!r} is not a free cell")


def _game_over(board: list[int], player: int, win: tuple[int, str], draw_status: int, preset, k: int, print_fn) -> bool:
    """After `player`'s move: prints the final message and returns True if the game is over."""
    if int(ttt.winner(jnp.asarray(board, jnp.int8))) == player:
        print_fn(text.render_message(preset, board, win[0], k) + f"\n({win[1]})")
        return True
    if 0 not in board:
        print_fn(text.render_message(preset, board, draw_status, k))
        return True
    return False


def play_terminal(config, checkpoint: str | None = None, input_fn: Callable[[str], str] = input,
                  print_fn: Callable[[str], None] = print) -> int:
    """Plays one game; returns 0. `input_fn` / `print_fn` let tests drive it."""
    from jaxrl_llm.train import build, policy_params

    comp = build(config)
    params = policy_params(config, comp, checkpoint)
    tok, preset, tables = comp.tokenizer, comp.preset, comp.tables
    scfg = sampling.SamplingConfig(greedy=True, max_new_tokens=config.sampling.max_new_tokens,
                                   stop_token_ids=(tables.eos_id,), pad_id=tables.pad_id)
    sampler = sampling.make_sampler(comp.model_fn, scfg)
    width = config.rollout.context_length - scfg.max_new_tokens
    parse = jax.jit(lambda t, n: text.parse_reply(tables, t, n))

    board = [0] * 9
    k = -1
    if input_fn("do you want to move first? [y/N] ").strip().lower().startswith("y"):
        print_fn(text.render_board(preset, board))
        k = _ask_cell(board, input_fn, print_fn)
        board[k] = ttt.O
        status = text.STATUS_START_OPP_FIRST
    else:
        status = text.STATUS_START_MODEL_FIRST
    conversation = [{"role": "system", "content": text.system_prompt(preset)}]
    for _ in range(config.eval.max_turns):
        conversation.append({"role": "user", "content": text.render_message(preset, board, status, k)})
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > width:
            print_fn("the conversation no longer fits the context: game over")
            return 0
        prompt = np.full((1, width), tables.pad_id, np.int32)
        prompt[0, : len(ids)] = ids
        out = sampler(params, jnp.asarray(prompt), jnp.asarray([len(ids)]), comp.init_cache(1, width + scfg.max_new_tokens),
                      jax.random.PRNGKey(0))
        n = int(out.lengths[0]) - int(out.done[0])
        reply = tok.decode(np.asarray(out.tokens[0, :n]).tolist())
        print_fn(f"model: {reply}")
        conversation.append({"role": "assistant", "content": reply})
        move = int(parse(out.tokens[0], jnp.int32(n))[0])
        if move == ttt.NO_MOVE:
            status = text.STATUS_NO_MOVE
        elif not 0 <= move <= 8 or board[move] != 0:
            status = text.STATUS_INVALID
        else:
            board[move] = ttt.X
            if _game_over(board, ttt.X, (text.STATUS_WIN, "the model wins"), text.STATUS_DRAW, preset, k, print_fn):
                return 0
            print_fn(text.render_board(preset, board))
            k = _ask_cell(board, input_fn, print_fn)
            board[k] = ttt.O
            if _game_over(board, ttt.O, (text.STATUS_LOSS, "you win"), text.STATUS_OPP_DRAW, preset, k, print_fn):
                return 0
            status = text.STATUS_OPP_MOVED
        if status != text.STATUS_OPP_MOVED:
            print_fn(f"({text.render_message(preset, board, status, k).splitlines()[0]})")
    print_fn("turn limit reached: unfinished")
    return 0
