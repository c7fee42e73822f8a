"""The play protocol of `jaxrl-llm play`: the hooks through which a person takes an env's scripted opponent's
place. They are host-side and not part of the env protocol (`envs.core.Env`): an env has them when its class
(or a base class) is registered here.

    from jaxrl_llm.cli.human import human_play, register_human
    hooks = human_play(env)                      # a HumanPlay, or None: the env cannot be played in the terminal
    register_human("my_pkg.env:MyEnv", "my_pkg.play:HOOKS")   # an env of your own (or the objects themselves)

Built in: Tic-Tac-Toe (`envs/tictactoe/play.py`) and Connect Four (`envs/connect_four/play.py`), both an
`envs.board_play.BoardGamePlay`.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from envs.core import Env, ParsedReply
from envs.registry import class_path

__all__ = ["HumanPlay", "human_play", "register_human"]


class HumanPlay(Protocol):
    """Hooks for `jaxrl-llm play` (host-side; any object with these members, e.g. a module or a dataclass).

    new_game() -> state: nothing played yet, the model to move; view(state) -> str: what the person sees
    before choosing; choices(state) -> [str]: the inputs accepted; apply_model(state, reply) -> state: the
    model's reply without the opponent's answer; human_to_move(state) -> bool: after `apply_model`, the
    person moves now (False: the reply was not a move, the model is asked again); apply_human(state,
    choice) -> state: the person's move (it sets what the next message shows); opening(state, choice) ->
    state: the person's first move when they start (optional: without it the model always starts).
    """

    def new_game(self) -> Any: ...
    def view(self, state: Any) -> str: ...
    def choices(self, state: Any) -> list[str]: ...
    def apply_model(self, state: Any, reply: ParsedReply) -> Any: ...
    def human_to_move(self, state: Any) -> bool: ...
    def apply_human(self, state: Any, choice: str) -> Any: ...


REQUIRED = ("new_game", "view", "choices", "apply_model", "human_to_move", "apply_human")

# env class path -> its hooks, or "module:ATTR" imported on first use (like the env registry's entries).
_HOOKS: dict[str, Any] = {
    "envs.tictactoe.env:TicTacToe": "envs.tictactoe.play:HUMAN",
    "envs.connect_four.env:ConnectFour": "envs.connect_four.play:HUMAN",
}


def register_human(env_class: type[Env] | str, hooks: Any) -> None:
    """Gives an env class (or its "module:Class" path) play hooks: a `HumanPlay` or its "module:ATTR" path.
    Subclasses inherit them."""
    key = env_class if isinstance(env_class, str) else class_path(env_class)
    _HOOKS[key] = hooks


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def human_play(env: Env) -> HumanPlay | None:
    """The play hooks of `env` (its class's, or its nearest registered base class's), None when it has none.
    Raises TypeError naming the missing members of hooks that do not follow the protocol."""
    for cls in type(env).__mro__:
        hooks = _HOOKS.get(class_path(cls))
        if hooks is None:
            continue
        if isinstance(hooks, str):
            hooks = _HOOKS[class_path(cls)] = _load(hooks)
        missing = [name for name in REQUIRED if not callable(getattr(hooks, name, None))]
        if missing:
            raise TypeError(f"the play hooks of env {env.name!r} lack {missing} (see jaxrl_llm.cli.human.HumanPlay)")
        return hooks
    return None


def opening_of(hooks: HumanPlay) -> Any:
    """The hooks' optional `opening(state, choice)`, or None (the model always starts)."""
    return getattr(hooks, "opening", None)
