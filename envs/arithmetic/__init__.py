"""Arithmetic: single-turn problems (a + b, a - b, a x b with 1-4 digit operands) with a verifiable answer.

    from envs import arithmetic
    arithmetic.task.problem(seed, level)                      # the draw (envs/arithmetic/task.py)
    env = arithmetic.Arithmetic(arithmetic.Params(prompt="tiny"))   # the protocol env (envs/arithmetic/env.py)

Parts: `task` (levels, the draw, answers), `text` (prompt presets, message slots), `teacher` (worked
answers for SFT), `env` (the `envs.core.Env` that binds them).
"""

from envs.arithmetic import task, teacher, text  # noqa: F401
from envs.arithmetic.env import Arithmetic, Example, Params, Stage, State, digit_credit  # noqa: F401
from envs.arithmetic.teacher import Teacher  # noqa: F401
