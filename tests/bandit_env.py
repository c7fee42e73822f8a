"""A one-turn bandit: pick one of a few cells, rewarded only for the target cell (the learnability test's env).

The reply is `<move>k</move>`; reward = 1 for the target cell, 0 for anything else (the format is a metric, weight
0), so the best reward is 1 and a uniform pick earns 1 / num_cells. The teacher's rows pick uniformly among the
cells: a format-only SFT start that knows the syntax and nothing about the target.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import envs
from jaxrl_llm.checks import check_int

SYSTEM_PROMPT = "Pick a cell. Reply <move>k</move>.\n"
# The tests' shared TOML head: a one-layer tiny model on the bandit, one turn (each test appends its stages).
MODEL_AND_ENV_TOML = """
[model]
preset = "tiny"
vocab_size = 576
hidden_size = 64
num_hidden_layers = 1
layer_types = ["full_attention"]

[env]
name = "bandit"

[sampling]
max_new_tokens = 8

[rollout]
context_length = 64
max_turns = 1
"""
MESSAGE = "Cells: 0 1 2 3"


class State(NamedTuple):
    choice: jax.Array  # int32[]: the cell played, -1 none or invalid
    format_ok: jax.Array  # bool[]
    done: jax.Array  # bool[]


@dataclasses.dataclass(frozen=True)
class Stage:
    """The bandit has one stage."""


@dataclasses.dataclass(frozen=True)
class Params:
    target: int = 2
    num_cells: int = 4

    def __post_init__(self) -> None:
        check_int(self, "num_cells", 2, 10)
        check_int(self, "target", 0, self.num_cells - 1)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """Format-only demonstrations: `num_games` replies with a uniformly random cell."""

    num_games: int = 64

    def __post_init__(self) -> None:
        check_int(self, "num_games", 1)


class Bandit(envs.Env):
    """One reply; reward 1 iff it is `<move>target</move>`."""

    name, Params, Stage, Teacher = "bandit", Params, Stage, Teacher
    final_message = False
    results_columns = (("hit", "hit"), ("format", "format"))

    def sample_examples(self, key, num_prompts, group_size, stage):
        return jnp.repeat(jax.random.bits(key, (num_prompts,), jnp.uint32), group_size)

    def eval_settings(self):
        return (envs.EvalSetting("bandit", Stage()),)

    def reset(self, example, params):
        return State(jnp.int32(-1), jnp.bool_(False), jnp.bool_(False))

    def step(self, state, reply, params):
        new = State(jnp.where(reply.found & reply.valid, reply.value, -1).astype(jnp.int32), reply.format_ok,
                    jnp.bool_(True))
        return jax.tree.map(lambda old, upd: jnp.where(state.done, old, upd), state, new)

    def done(self, state):
        return state.done

    def system_prompt(self, params):
        return SYSTEM_PROMPT

    def message_spec(self, params):
        return envs.MessageSpec((envs.Slot("cells", (MESSAGE,)),))

    def message_codes(self, state, params):
        return jnp.zeros((1,), jnp.int32)

    def reply_grammar(self, params):
        return envs.ReplyGrammar(tag="move", content="cell", num_cells=params.num_cells)

    def legal_choices(self, state, params):
        return jnp.ones((params.num_cells,), bool) & ~state.done

    def rubric(self, params):
        return (envs.RubricPart("hit", 1.0), envs.RubricPart("format", 0.0))

    def reward_parts(self, state, episode, params):
        return {"hit": (state.choice == params.target).astype(jnp.float32), "format": episode.format_score}

    def metrics(self, state, episode, params):
        return {"hit": (state.choice == params.target).astype(jnp.float32)}

    def demonstrations(self, teacher, key, params, max_turns):
        cells = np.asarray(jax.random.randint(key, (teacher.num_games,), 0, params.num_cells))
        return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": MESSAGE}],
                 "completion": [{"role": "assistant", "content": f"<move>{int(c)}</move>"}],
                 "info": {"cell": int(c)}} for c in cells]
