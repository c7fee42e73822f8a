"""`jaxrl-llm play` hooks for Connect Four (`envs.core.HumanPlay`): a person plays O in the search opponent's place.

The model is X and moves first unless the person opens; the person sees the board in the reference preset's
marks with its column index line and answers with a playable column. The states are the game's own
(`game.model_move` for the model's reply, `game.opponent_move_applied` for the person's), so the messages
the model reads are the ones it was trained on.
"""

from __future__ import annotations

import jax
import numpy as np

from envs import board_game
from envs.connect_four import game, text
from envs.core import HumanPlay, ParsedReply

_model_move = jax.jit(game.model_move)
_opponent_move = jax.jit(game.opponent_move_applied)


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


def apply_model(state: game.State, reply: ParsedReply) -> game.State:
    """The model's reply alone: X's piece, or a missing / invalid move (the model is asked again)."""
    return jax.device_get(_model_move(state, board_game.move_code(reply, game.NO_MOVE, game.INVALID_MOVE)))


def human_to_move(state: game.State) -> bool:
    """After `apply_model`: the model's move was legal and left the game open."""
    return not bool(state.done) and int(state.status) == game.STATUS_OPP_MOVED


def apply_human(state: game.State, choice: str) -> game.State:
    """The person's piece (O) in column `choice` (one of `choices`)."""
    return jax.device_get(_opponent_move(state, np.int32(int(choice))))


def opening(state: game.State, choice: str) -> game.State:
    """The person's first move when they start: the model then reads "O played c"."""
    return apply_human(state, choice)._replace(status=np.int8(game.STATUS_START_OPP_FIRST))


HUMAN = HumanPlay(new_game=new_game, view=view, choices=choices, apply_model=apply_model,
                  human_to_move=human_to_move, apply_human=apply_human, opening=opening)
