"""The arithmetic teacher for SFT: problems drawn on device with the task's own draw, worked answers on the host.

A row is one problem in the conversational prompt/completion layout (`jaxrl_llm.data.sft_data`): the
system prompt and the problem message of a prompt preset (`envs.arithmetic.text`), then one assistant
reply, the worked answer (`worked_answer`):

    work "reversed"   <think>{the result's digits, least significant first}</think><answer>{result}</answer>
                      e.g. 347+598= -> <think>549</think><answer>945</answer>, 41-44= -> <think>-3</think>
                      <answer>-3</answer>: a minus sign first when the result is negative, then the digits
                      of |result| from the ones up. Written in that order every digit depends only on the
                      operands' digits at its own position and the carry (or borrow) from the one before,
                      which a small model learns far more easily than the usual order; the answer then
                      copies the digits back.
    work "none"       <answer>{result}</answer>

`info` holds {seed, level, a, b, op, answer, check_group}: check_group is the level's name on the check
rows (the SFT check reports its exact rate per group) and "" on training rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs.arithmetic import task, text
from jaxrl_base.checks import ConfigError, check_choice, check_int

WORK_STYLES = ("reversed", "none")
CHECK_SEED = 20_240_601  # the check problems' key: fixed, so every run checks on the same problems


def worked_answer(answer: int, work: str = "reversed") -> str:
    """The teacher's reply for a problem whose result is `answer` (see the module docstring)."""
    if work not in WORK_STYLES:
        raise ValueError(f"work must be one of {WORK_STYLES}, got {work!r}")
    answer = int(answer)
    if work == "none":
        return f"<answer>{answer}</answer>"
    scratch = ("-" if answer < 0 else "") + str(abs(answer))[::-1]
    return f"<think>{scratch}</think><answer>{answer}</answer>"


def check_levels(owner: object, digits_field: str, operators_field: str) -> tuple[int, ...]:
    """Validate a (digits, operators) pair of fields of `owner` (ConfigError naming the field) -> the level
    indices of their product, digits-major (("add1", "sub1", "add2", ...) order)."""
    name = type(owner).__name__
    digits, operators = getattr(owner, digits_field), getattr(owner, operators_field)
    if not isinstance(digits, (tuple, list)) or not digits:
        raise ConfigError(f"must be a non-empty list of digit counts in 1..{task.MAX_DIGITS}, got {digits!r}",
                          (digits_field,), name)
    for d in digits:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 1 <= d <= task.MAX_DIGITS:
            raise ConfigError(f"digit counts must be integers in 1..{task.MAX_DIGITS} (got {d!r} in {list(digits)})",
                              (digits_field,), name)
    if len(set(digits)) != len(digits):
        raise ConfigError(f"lists a digit count twice: {list(digits)}", (digits_field,), name)
    if not isinstance(operators, (tuple, list)) or not operators:
        raise ConfigError(f"must be a non-empty list of operators out of {list(task.OPERATORS)}, got {operators!r}",
                          (operators_field,), name)
    for op in operators:
        if op not in task.OPERATORS:
            raise ConfigError(f"operators must be out of {list(task.OPERATORS)} (got {op!r}; multiplication is "
                              "'x')", (operators_field,), name)
    if len(set(operators)) != len(operators):
        raise ConfigError(f"lists an operator twice: {list(operators)}", (operators_field,), name)
    return tuple(task.level_index(int(d), op) for d in sorted(digits) for op in task.OPERATORS if op in operators)


@functools.partial(jax.jit, static_argnames=("num",))
def _draw_problems(key: jax.Array, num: int, levels: jax.Array) -> task.Problem:
    """`num` problems: random seeds, levels stratified over `levels` (device)."""
    k_seed, k_level = jax.random.split(key)
    seeds = jax.random.bits(k_seed, (num,), jnp.uint32)
    chosen = task.stratified_levels(k_level, num, levels)
    return jax.vmap(task.problem)(seeds, chosen), seeds


def problem_rows(key: jax.Array, num: int, levels: tuple[int, ...], preset: str, work: str,
                 check_group: bool = False) -> list[dict]:
    """`num` teacher rows (see the module docstring) with levels stratified over `levels` (host)."""
    p = text.PRESETS[preset]
    probs, seeds = jax.device_get(_draw_problems(key, int(num), jnp.asarray(levels, jnp.int32)))
    system = text.system_prompt(p)
    rows = []
    for i in range(int(num)):
        a, b, op, level, answer = (int(probs.a[i]), int(probs.b[i]), int(probs.op[i]), int(probs.level[i]),
                                   int(probs.answer[i]))
        rows.append({
            "prompt": [{"role": "system", "content": system},
                       {"role": "user", "content": text.render_problem(p, a, b, op)}],
            "completion": [{"role": "assistant", "content": worked_answer(answer, work)}],
            "info": {"seed": int(seeds[i]), "level": task.level_name(level), "a": a, "b": b,
                     "op": task.OPERATORS[op], "answer": answer,
                     "check_group": task.level_name(level) if check_group else ""},
        })
    return rows


@dataclasses.dataclass(frozen=True)
class Teacher:
    """Arithmetic SFT data (the `[sft.teacher]` table): `num_problems` problems with worked answers.

    digits x operators: the levels of the data (their product, each level equally often); work: the
    reply's style, "reversed" (the result's digits least significant first in <think>, then the answer)
    or "none" (the answer alone); check_problems: problems per level of the teacher-forced SFT check
    (0: no check), drawn from a fixed key, so the check's exact rate is the greedy accuracy per level on
    the same problems in every run.
    """

    num_problems: int = 20_000
    digits: tuple[int, ...] = (1, 2, 3)
    operators: tuple[str, ...] = ("+", "-")
    work: str = "reversed"
    check_problems: int = 0

    def __post_init__(self) -> None:
        check_int(self, "num_problems", 1)
        object.__setattr__(self, "digits", tuple(self.digits) if isinstance(self.digits, list) else self.digits)
        object.__setattr__(self, "operators",
                           tuple(self.operators) if isinstance(self.operators, list) else self.operators)
        check_levels(self, "digits", "operators")
        check_choice(self, "work", WORK_STYLES)
        check_int(self, "check_problems", 0)

    @property
    def levels(self) -> tuple[int, ...]:
        """The level indices of the data."""
        return check_levels(self, "digits", "operators")

    def rows(self, key: jax.Array, preset: str) -> list[dict]:
        """The SFT rows (prompt / completion / info)."""
        return problem_rows(key, self.num_problems, self.levels, preset, self.work)

    def check_rows(self, preset: str) -> list[dict]:
        """`check_problems` rows per level, from the fixed key `CHECK_SEED`, with info.check_group the level."""
        rows = []
        for level in self.levels:
            rows += problem_rows(jax.random.fold_in(jax.random.PRNGKey(CHECK_SEED), level), self.check_problems,
                                 (level,), preset, self.work, check_group=True)
        return rows
