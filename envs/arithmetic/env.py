"""Arithmetic as an environment of the protocol (`envs.core.Env`): single-turn problems with a verifiable answer.

The task is `envs.arithmetic.task` (levels, the draw, answers); its text `envs.arithmetic.text` (prompt
presets, slots); its SFT teacher `envs.arithmetic.teacher` (worked answers). This module binds them:

    example   (seed uint32, level int32): the problem is a pure function of both (`task.problem`); a
              stage's levels (digits x operators) are stratified over the prompts of a batch, so one GRPO
              batch mixes levels as Tic-Tac-Toe's mixes opponent strengths
    game      one message (the problem), one reply, done: single-turn (`rollout.max_turns = 1`), no final
              message
    reply     `<answer>N</answer>`, N a signed integer (`ReplyGrammar("answer", "integer", max_digits=8)`),
              read with Python-`re` semantics on the decoded reply (`jaxrl_llm.text.grammar`):
                - the first `<answer>...</answer>` counts; later tags are ignored (a second answer does
                  not replace the first);
                - the content is stripped of whitespace (`str.strip()`, Unicode spaces included):
                  `<answer> 42 </answer>` reads 42, but a space inside the number (`4 2`, `- 7`) is invalid;
                - one leading sign: `+7` reads 7, `-0` reads 0; `--7`, `+-7` are invalid;
                - leading zeros are allowed and count as digits: `007` reads 7;
                - at most 8 digits (the longest answer, 9999 x 9999, has 8): `000000042` (9 digits) is
                  invalid, so is anything that would not fit the range;
                - ASCII digits only: `1,000`, `1e3`, `7.0`, `٣`, `１` are invalid;
                - a tag with invalid content counts as an answer given ("invalid"), not as a correct one;
              format: the reply holds an `<answer>...</answer>` pair (any content; <think> is optional)
    rubric    exact (1 if the answer equals the result) x 1 + format (0 or 1) x 0.2: total in [0, 1.2];
              optional partial credit (`Params.digits_weight` > 0, off by default): digits, the share of
              the result's digit positions the answer gets right (`digit_credit`), so a group of wrong answers
              still has a spread where some answers get more digits right
    metrics   per game: exact, wrong (an integer, not the result), invalid (a tag without an integer),
              missing (no tag), and per level `exact_<level>` (e.g. exact_add2): the game's exact where
              its level is that one, NaN elsewhere (batch figures and summaries average over the games
              where a metric is not NaN, so `exact_add2_rate` is the accuracy on the batch's add2 problems)
    eval      one setting per level, named as the level: add1 .. add4, sub1 .. sub4, mul1 .. mul4
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.arithmetic import task, text
from envs.arithmetic.teacher import Teacher, check_levels
from envs.core import Env, Episode, EvalSetting, ParsedReply, ReplyGrammar, RubricPart
from jaxrl_base.checks import check_choice, check_float


class Example(NamedTuple):
    """One problem's example: its seed and its level (`task.level_index`)."""

    seed: jax.Array  # uint32[]
    level: jax.Array  # int32[]


class State(NamedTuple):
    """One problem and the reply to it (scalars; batched under vmap)."""

    problem: task.Problem
    seed: jax.Array  # uint32[]
    done: jax.Array  # bool[]: the reply came
    found: jax.Array  # bool[]: it held an <answer> tag
    valid: jax.Array  # bool[]: with an integer in it
    value: jax.Array  # int32[]: that integer (0 unless valid)


@dataclasses.dataclass(frozen=True)
class Stage:
    """A curriculum stage: the levels are digits x operators (each level equally often in a batch).

    digits: operand lengths in 1..MAX_DIGITS (4); operators: out of "+", "-", "x"."""

    digits: tuple[int, ...] = (1, 2, 3)
    operators: tuple[str, ...] = ("+", "-")

    def __post_init__(self) -> None:
        object.__setattr__(self, "digits", tuple(self.digits) if isinstance(self.digits, list) else self.digits)
        object.__setattr__(self, "operators",
                           tuple(self.operators) if isinstance(self.operators, list) else self.operators)
        check_levels(self, "digits", "operators")

    @property
    def levels(self) -> tuple[int, ...]:
        """The stage's level indices, digits-major."""
        return check_levels(self, "digits", "operators")


@dataclasses.dataclass(frozen=True)
class Params:
    """Static settings: the prompt preset ("tiny", "reference", "aligned"; see `text.PRESETS`) and the rubric's weights."""

    prompt: str = "reference"
    exact_weight: float = 1.0
    format_weight: float = 0.2
    digits_weight: float = 0.0  # partial credit (`digit_credit`); 0: the rubric has no digits part

    def __post_init__(self) -> None:
        check_choice(self, "prompt", tuple(text.PRESETS))
        check_float(self, "exact_weight", low=0.0)
        check_float(self, "format_weight", low=0.0)
        check_float(self, "digits_weight", low=0.0)

    @property
    def preset(self) -> text.PromptPreset:
        return text.PRESETS[self.prompt]


_GRAMMAR = ReplyGrammar(tag="answer", content="integer", max_digits=task.MAX_ANSWER_DIGITS, format_tags=("answer",),
                        example_replies=("<think>549</think><answer>945</answer>", "<answer>-17</answer>",
                                         "<think>-3</think><answer>-3</answer>", "It is 12."))

_problem_jit = jax.jit(task.problem)
LEVEL_METRICS = tuple(f"exact_{name}" for name in task.LEVEL_NAMES)


def reset(example: Example) -> State:
    """The problem of an example, no reply yet."""
    no = jnp.zeros((), bool)
    return State(problem=task.problem(example.seed, example.level), seed=jnp.asarray(example.seed, jnp.uint32),
                 done=no, found=no, valid=no, value=jnp.zeros((), jnp.int32))


def record_reply(state: State, reply: ParsedReply) -> State:
    """Records the reply; the game is then over (`Env.step` leaves a done state unchanged)."""
    return state._replace(done=jnp.ones((), bool), found=jnp.asarray(reply.found, bool),
                          valid=jnp.asarray(reply.found & reply.valid, bool),
                          value=jnp.where(reply.found & reply.valid, reply.value, 0).astype(jnp.int32))


def exact(state: State) -> jax.Array:
    """bool[]: the reply's integer is the problem's result."""
    return state.done & state.valid & (state.value == state.problem.answer)


def digit_credit(state: State) -> jax.Array:
    """float32[] in [0, 1]: the share of the result's digit positions that the reply's integer gets right.

    Positions are aligned from the units digit over the longer of the two numbers (a missing digit never
    matches), so extra or missing leading digits cost their positions; a wrong sign, an invalid reply or no
    reply gives 0, and the exact answer 1. E.g. result 945: 941 -> 2/3, 45 -> 2/3, 1945 -> 3/4, -945 -> 0."""
    width = task.MAX_ANSWER_DIGITS
    answer, value = state.problem.answer, state.value
    want, got = task.digits_of(jnp.abs(answer), width), task.digits_of(jnp.abs(value), width)
    shown = (want >= 0) | (got >= 0)
    right = jnp.sum(shown & (want == got)) / jnp.maximum(jnp.sum(shown), 1)
    same_sign = (answer < 0) == (value < 0)
    return jnp.where(state.done & state.valid & same_sign, right, 0.0).astype(jnp.float32)


class Arithmetic(Env):
    """Single-turn arithmetic: a + b, a - b or a x b with operands of 1-4 digits, answered in <answer> tags."""

    name = "arithmetic"
    Params = Params
    Stage = Stage
    Teacher = Teacher
    final_message = False
    results_columns = (("exact", "exact"), ("wrong", "wrong"), ("invalid", "invalid"), ("missing", "missing"),
                       ("format", "format"))
    outcome_metrics = ("exact", "wrong", "invalid", "missing")
    reward_params = ("exact_weight", "format_weight", "digits_weight")

    # ---- data ----
    def sample_examples(self, key, num_prompts, group_size, stage: Stage) -> Example:
        """Random seeds, the stage's levels stratified over the prompts; each prompt repeated group_size times."""
        k_seed, k_level = jax.random.split(key)
        seeds = jax.random.bits(k_seed, (num_prompts,), jnp.uint32)
        levels = task.stratified_levels(k_level, num_prompts, jnp.asarray(stage.levels, jnp.int32))
        return Example(jnp.repeat(seeds, group_size), jnp.repeat(levels, group_size))

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        """One setting per level, named as the level (add1 .. mul4)."""
        return tuple(EvalSetting(task.level_name(i), Stage(digits=(i // 3 + 1,), operators=(task.OPERATORS[i % 3],)))
                     for i in range(task.NUM_LEVELS))

    def example_metrics(self, examples: Example) -> dict[str, jax.Array]:
        """The batch's mean operand length."""
        return {"digits_mean": jnp.mean((jnp.asarray(examples.level) // 3 + 1).astype(jnp.float32))}

    # ---- dynamics ----
    def reset(self, example: Example, params: Params) -> State:
        return reset(example)

    def transition(self, state: State, reply: ParsedReply, params: Params) -> State:
        return record_reply(state, reply)

    def done(self, state: State) -> jax.Array:
        return state.done

    # ---- text ----
    def system_prompt(self, params: Params) -> str:
        return text.system_prompt(params.preset)

    def message_spec(self, params: Params):
        return text.message_spec(params.preset)

    def message_codes(self, state: State, params: Params) -> jax.Array:
        return text.message_codes(state.problem)

    def reply_grammar(self, params: Params) -> ReplyGrammar:
        return _GRAMMAR

    # ---- reward and metrics ----
    def rubric(self, params: Params) -> tuple[RubricPart, ...]:
        parts = (RubricPart("exact", params.exact_weight), RubricPart("format", params.format_weight))
        return parts + ((RubricPart("digits", params.digits_weight),) if params.digits_weight > 0 else ())

    def reward_parts(self, state: State, episode: Episode, params: Params) -> dict[str, jax.Array]:
        parts = {"exact": exact(state).astype(jnp.float32), "format": jnp.asarray(episode.format_score, jnp.float32)}
        return parts | ({"digits": digit_credit(state)} if params.digits_weight > 0 else {})

    def metrics(self, state: State, episode: Episode, params: Params) -> dict[str, jax.Array]:
        right = exact(state)
        f = lambda x: jnp.asarray(x).astype(jnp.float32)  # noqa: E731
        out = {"exact": f(right), "wrong": f(state.valid & ~right), "invalid": f(state.found & ~state.valid),
               "missing": f(state.done & ~state.found)}
        for level, name in enumerate(LEVEL_METRICS):
            out[name] = jnp.where(state.problem.level == level, f(right), jnp.float32(jnp.nan))
        return out

    # ---- SFT ----
    def demonstrations(self, teacher: Teacher, key, params: Params, max_turns: int) -> list[dict]:
        return teacher.rows(key, params.prompt)

    def has_check_rows(self, teacher: Teacher) -> bool:
        return teacher.check_problems > 0

    def check_rows(self, teacher: Teacher, params: Params) -> list[dict] | None:
        """`teacher.check_problems` fixed problems per level of the teacher (info.check_group: the level):
        teacher-forced and greedy, a row is exact iff greedy decoding writes the teacher's worked answer."""
        if teacher.check_problems == 0:
            return None
        return teacher.check_rows(params.prompt)

    def example_info(self, example: Any) -> dict[str, Any]:
        seed, level = int(np.asarray(example.seed)), int(np.asarray(example.level))
        p = jax.device_get(_problem_jit(np.uint32(seed), np.int32(level)))
        return {"seed": seed, "level": task.level_name(level), "a": int(p.a), "b": int(p.b),
                "op": task.OPERATORS[level % 3], "answer": int(p.answer)}
