"""Pure, jittable text environments and their registry.

    import envs
    env = envs.make("tictactoe", prompt="tiny")      # an envs.core.Env; env.params its Params
    envs.register("my_env", MyEnv)                   # any Env subclass, then envs.make("my_env", ...)

The protocol is `envs.core` (read its docstring); built-in environments: tictactoe (multi-turn game vs a minimax
opponent), arithmetic (single-turn problems with a verifiable integer answer),
connect_four (multi-turn game vs a depth-limited search opponent).
"""

from envs.core import (  # noqa: F401
    CONTENT_KINDS, Env, Episode, EvalSetting, HumanPlay, MessageFamily, MessageSpec, ParsedReply, ReplyGrammar,
    RubricPart, Slot, env_class, make, register, registered, weighted_reward,
)

DEFAULT_ENV = "tictactoe"  # the env of a config without `[env] name`

register("tictactoe", "envs.tictactoe.env:TicTacToe")
register("arithmetic", "envs.arithmetic.env:Arithmetic")
register("connect_four", "envs.connect_four.env:ConnectFour")
