"""`jaxrl-llm play` hooks shared by the board games: a person plays O in the scripted opponent's place.

`BoardGamePlay` satisfies the play protocol (`jaxrl_llm.cli.human.HumanPlay`) from a game module's two halves
of a step, `model_move(state, move)` (the model's reply alone) and `opponent_move_applied(state, move)` (the
person's move), so the messages the model reads are the ones it was trained on. A game gives what differs:
`new_game`, `view` and `choices` (`envs/tictactoe/play.py`, `envs/connect_four/play.py`).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable

import jax
import numpy as np

from envs.board_game import move_code
from envs.core import ParsedReply


@dataclasses.dataclass(frozen=True)
class BoardGamePlay:
    """The play hooks of a board game whose `game` module has model_move, opponent_move_applied, NO_MOVE,
    INVALID_MOVE and the STATUS_* codes. new_game() -> an empty board, the model (X) to move; view(state) ->
    the board as the person sees it; choices(state) -> the moves the person may type."""

    game: ModuleType
    new_game: Callable[[], Any]
    view: Callable[[Any], str]
    choices: Callable[[Any], list[str]]

    def apply_model(self, state: Any, reply: ParsedReply) -> Any:
        """The model's reply alone: X's piece, or a missing / invalid move (the model is asked again)."""
        move = move_code(reply, self.game.NO_MOVE, self.game.INVALID_MOVE)
        return jax.device_get(jax.jit(self.game.model_move)(state, move))

    def human_to_move(self, state: Any) -> bool:
        """After `apply_model`: the model's move was legal and left the game open."""
        return not bool(state.done) and int(state.status) == self.game.STATUS_OPP_MOVED

    def apply_human(self, state: Any, choice: str) -> Any:
        """The person's piece (O) at `choice` (one of `choices`)."""
        return jax.device_get(jax.jit(self.game.opponent_move_applied)(state, np.int32(int(choice))))

    def opening(self, state: Any, choice: str) -> Any:
        """The person's first move when they start: the model then reads that O opened there."""
        return self.apply_human(state, choice)._replace(status=np.int8(self.game.STATUS_START_OPP_FIRST))
