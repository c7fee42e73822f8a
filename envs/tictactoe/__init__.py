"""Tic-Tac-Toe against a controlled minimax opponent (`shared/TICTACTOE_SPEC.md`).

    from envs import tictactoe as ttt
    ttt.reset(seed, p), ttt.step(state, move), ttt.winner(board), ...   # the game (envs/tictactoe/game.py)
    env = ttt.TicTacToe(ttt.Params(prompt="tiny"))                      # the protocol env (envs/tictactoe/env.py)

Parts: `game` (rules, minimax table, opponent, seeds), `text` (prompt presets, message slots), `teacher`
(minimax teachers for SFT data), `env` (the `envs.core.Env` that binds them). The reference players in the
evaluation setting are a script: `python experiments/baselines.py`.
"""

from envs.tictactoe.game import *  # noqa: F401,F403
from envs.tictactoe.game import NUM_BOARDS, NUM_CELLS, OUTCOME_NAMES, State  # noqa: F401
from envs.tictactoe.env import Example, Params, Stage, TicTacToe, move_of  # noqa: F401
from envs.tictactoe.teacher import Teacher  # noqa: F401
