"""Pure, jittable text environments and their registry.

    import envs
    env = envs.make("tictactoe", prompt="tiny")      # an envs.core.Env; env.params its Params
    envs.register("my_env", MyEnv)                   # any Env subclass, then envs.make("my_env", ...)
    envs.make("my_pkg.my_env:MyEnv")                 # or its class path, imported on use (also in [env] name)
    envs.check_env(env)                              # the protocol checks for env authors (`envs.check`)

Installed packages add envs through the entry-point group `jaxrl_llm.envs` (pyproject.toml:
`[project.entry-points."jaxrl_llm.envs"] my_env = "my_pkg.my_env:MyEnv"`); `registered()` lists them.

The protocol is `envs.core` (read its docstring); built-in environments: tictactoe (multi-turn game vs a minimax
opponent), arithmetic (single-turn problems with a verifiable integer answer),
connect_four (multi-turn game vs a depth-limited search opponent).
"""

from envs.core import (  # noqa: F401
    CONTENT_KINDS, Env, Episode, EvalSetting, MessageFamily, MessageSpec, ParsedReply, ReplyGrammar, METRIC_KINDS,
    RubricPart, Slot, weighted_reward, keep_finished,
)
from envs.registry import (  # noqa: F401
    ENTRY_POINT_GROUP, EnvNotFoundError, class_path, entry_point_envs, env_class, make, register, registered,
)
from envs.check import EnvCheckError, check_env  # noqa: F401,E402

DEFAULT_ENV = "tictactoe"  # the env of a config without `[env] name`

register("tictactoe", "envs.tictactoe.env:TicTacToe")
register("arithmetic", "envs.arithmetic.env:Arithmetic")
register("connect_four", "envs.connect_four.env:ConnectFour")
