"""`jaxrl-llm play` hooks for Connect Four (`HUMAN`, an `envs.board_play.BoardGamePlay`): a person plays O in the
search opponent's place.

The model is X and moves first unless the person opens; the person sees the board in the reference preset's
marks with its column index line and answers with a playable column.
"""

from __future__ import annotations

import jax
import numpy as np

from envs.board_play import BoardGamePlay
from envs.connect_four import game, text


def new_game() -> game.State:
    """An empty board, the model (X) to move."""
    state = jax.device_get(game.reset(np.uint32(0), np.float32(0.0), np.int32(1), 1))
    empty = np.zeros(2, np.uint32)
    return state._replace(x=empty, o=empty, last_opponent_move=np.int8(-1),
                          status=np.int8(game.STATUS_START_MODEL_FIRST))


def view(state: game.State) -> str:
    """The board as the person sees it (X the model, O the person), columns indexed 0..6."""
    return text.render_board(text.PRESETS["reference"], np.asarray(jax.device_get(game.cells(state.x, state.o))))


def choices(state: game.State) -> list[str]:
    """The playable columns, as the person types them."""
    legal = np.asarray(jax.device_get(game.legal_columns(state.x, state.o)))
    return [str(c) for c in range(game.COLUMNS) if legal[c]]


HUMAN = BoardGamePlay(game=game, new_game=new_game, view=view, choices=choices)
