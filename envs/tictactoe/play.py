"""`jaxrl-llm play` hooks for Tic-Tac-Toe (`HUMAN`, an `envs.board_play.BoardGamePlay`): a person plays O in the
minimax opponent's place.

The model is X and moves first unless the person opens; the person sees the board in the reference preset
(free cells show their index) and answers with a free cell.
"""

from __future__ import annotations

import jax
import numpy as np

from envs.board_play import BoardGamePlay
from envs.tictactoe import game, text


def new_game() -> game.State:
    """An empty board, the model (X) to move."""
    state = jax.device_get(game.reset(np.uint32(0), np.float32(0.0)))
    return state._replace(board=np.zeros(game.NUM_CELLS, np.int8), last_opponent_move=np.int8(-1),
                          status=np.int8(game.STATUS_START_MODEL_FIRST))


def view(state: game.State) -> str:
    """The board as the person sees it (X the model, O the person), free cells as their index."""
    return text.render_board(text.PRESETS["reference"], np.asarray(state.board).tolist())


def choices(state: game.State) -> list[str]:
    """The free cells, as the person types them."""
    return [str(i) for i in range(game.NUM_CELLS) if int(np.asarray(state.board)[i]) == game.EMPTY]


HUMAN = BoardGamePlay(game=game, new_game=new_game, view=view, choices=choices)
