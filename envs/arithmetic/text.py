"""The arithmetic task's text: prompt presets (data), host rendering, and the message as slots of piece tables.

A problem message is `{start}{a}{op}{b}{end}`: with the `tiny` preset `347+598=`, with `reference`
`What is 347 + 598?`, with `aligned` `0347+0598=` (operands zero-padded to MAX_DIGITS digits). For the text bridge it is 1 + MAX_DIGITS + 1 + MAX_DIGITS + 1 slots, each operand
one slot per digit position (the project tokenizer writes every digit as its own token):

    start            the preset's opening text (one piece)                          code 0
    a3 a2 a1 a0      operand a, most significant position first: "" where a has     code 0 ("") or digit + 1
                     no digit there ("0" with `aligned`), else the digit "0".."9"
    op               the operator text: "+", "-", "x" (`reference`: " + ", ...)       code = operator 0..2
    b3 b2 b1 b0      operand b, as a
    end              the preset's closing text (one piece)                          code 0

`message_spec(preset)` lists the pieces (host), `message_codes(problem)` computes the codes (device),
`render_problem` is the plain host rendering (a test checks the three agree). The game is single-turn and
sends no final message, so there is one family of codes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from envs.arithmetic.task import MAX_DIGITS, OPERATORS, Problem, digits_of
from envs.core import MessageSpec, Slot


@dataclasses.dataclass(frozen=True)
class PromptPreset:
    """The strings of one prompt style: the system prompt and the problem's opening, operators and end."""

    name: str
    system_prompt: str
    start: str
    operators: tuple[str, str, str]  # the texts of "+", "-", "x"
    end: str
    pad_digits: bool = False  # operands written with leading zeros to MAX_DIGITS digits (`0347+0598=`)


PRESETS: dict[str, PromptPreset] = {
    # `tiny`: the shortest messages, for models trained from scratch (a problem is 2 * digits + 2 tokens).
    "tiny": PromptPreset(name="tiny", system_prompt="Arithmetic. Reply <think>...</think><answer>N</answer>.\n",
                         start="", operators=("+", "-", "x"), end="="),
    "reference": PromptPreset(
        name="reference",
        system_prompt=("Solve the arithmetic problem. You may reason inside <think>...</think> tags. Give the "
                       "result as an integer inside <answer>...</answer> tags, for example <answer>-17</answer>.\n"),
        start="What is ", operators=(" + ", " - ", " x "), end="?"),
    # `aligned`: `tiny` with both operands zero-padded to MAX_DIGITS digits (`0347+0598=`), so that every
    # digit position sits at the same distance from the reply whatever the operands' lengths (a problem is
    # 2 * MAX_DIGITS + 2 tokens). A small model then finds an operand's units digit at a fixed offset.
    "aligned": PromptPreset(name="aligned", system_prompt="Arithmetic. Reply <think>...</think><answer>N</answer>.\n",
                            start="", operators=("+", "-", "x"), end="=", pad_digits=True),
}

SLOT_NAMES = ("start", *(f"a{i}" for i in reversed(range(MAX_DIGITS))), "op",
              *(f"b{i}" for i in reversed(range(MAX_DIGITS))), "end")
DIGIT_PIECES = ("", *(str(d) for d in range(10)))
PADDED_DIGIT_PIECES = ("0", *DIGIT_PIECES[1:])  # code 0 (no digit there) shows a leading zero


def render_problem(preset: PromptPreset, a: int, b: int, op: int) -> str:
    """The message of a problem (host): e.g. `347+598=` (`tiny`)."""
    if not 0 <= int(op) < len(OPERATORS):
        raise ValueError(f"operator code must be in 0..{len(OPERATORS) - 1}, got {op!r}")
    for name, value in (("a", a), ("b", b)):
        if not 0 <= int(value) < 10**MAX_DIGITS:
            raise ValueError(f"operand {name} must be in 0..{10**MAX_DIGITS - 1}, got {value!r}")
    width = MAX_DIGITS if preset.pad_digits else 0
    return f"{preset.start}{int(a):0{width}d}{preset.operators[int(op)]}{int(b):0{width}d}{preset.end}"


def system_prompt(preset: PromptPreset) -> str:
    """The system message."""
    return preset.system_prompt


@functools.lru_cache(maxsize=None)
def message_spec(preset: PromptPreset) -> MessageSpec:
    """The slots and pieces of `preset`'s problem messages (one family: every code of every slot)."""
    pieces = PADDED_DIGIT_PIECES if preset.pad_digits else DIGIT_PIECES
    digits = [Slot(name, pieces) for name in SLOT_NAMES[1:1 + MAX_DIGITS]]
    digits_b = [Slot(name, pieces) for name in SLOT_NAMES[2 + MAX_DIGITS:2 + 2 * MAX_DIGITS]]
    return MessageSpec((Slot("start", (preset.start,)), *digits, Slot("op", tuple(preset.operators)), *digits_b,
                        Slot("end", (preset.end,))))


def message_codes(prob: Problem) -> jax.Array:
    """Problem (one game) -> int32[2 * MAX_DIGITS + 3]: the piece code of each slot (see the module docstring)."""
    zero = jnp.zeros((1,), jnp.int32)
    a = digits_of(prob.a, MAX_DIGITS) + 1  # -1 (no digit) -> code 0, digit k -> k + 1
    b = digits_of(prob.b, MAX_DIGITS) + 1
    op = jnp.asarray(prob.op, jnp.int32).reshape(1)
    return jnp.concatenate([zero, a, op, b, zero]).astype(jnp.int32)
