"""The arithmetic task alone: levels, problems drawn from a seed, answers (pure JAX, no text, no model).

A level is a number of digits d in 1..MAX_DIGITS and an operator: addition "+", subtraction "-" or
multiplication "x". Its index is `(d - 1) * 3 + op` (op 0 "+", 1 "-", 2 "x") and its name the operator's
name and d: "add2", "sub3", "mul1" (`level_name`, `level_index`).

A problem of level (d, op) is two operands a, b of exactly d digits (a leading digit 1..9; 0..9 when
d = 1), drawn from the example's seed:

    (w0, w1) = the two uint32 words of jax.random.fold_in(jax.random.PRNGKey(seed), level)
               (one Threefry-2x32 block: key (0, seed), counter (0, level); `envs.prng.fold_in_words`)
    lo, span = (0, 10) if d == 1 else (10**(d-1), 9 * 10**(d-1))
    a = lo + w0 % span,  b = lo + w1 % span          (uint32 arithmetic; the modulo bias is < 2e-5)
    answer = a + b, a - b (negative when b > a) or a * b

so every game with the same (seed, level) meets the same problem, and the same seed at another level an
unrelated one. The largest answer, 9999 * 9999, has 8 digits: it fits int32 and the reply grammar's
`MAX_ANSWER_DIGITS`. `tests/reference_arithmetic.py` re-implements the draw in pure Python.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.prng import fold_in_words

MAX_DIGITS = 4
OPERATORS = ("+", "-", "x")
OPERATOR_NAMES = ("add", "sub", "mul")
ADD, SUB, MUL = 0, 1, 2
NUM_LEVELS = MAX_DIGITS * len(OPERATORS)
MAX_ANSWER_DIGITS = 2 * MAX_DIGITS  # 9999 * 9999 = 99 980 001
LEVEL_NAMES = tuple(f"{OPERATOR_NAMES[i % 3]}{i // 3 + 1}" for i in range(NUM_LEVELS))


def level_index(digits: int, operator: str) -> int:
    """(digits 1..MAX_DIGITS, operator "+", "-" or "x") -> the level index (host; ValueError otherwise)."""
    if isinstance(digits, bool) or not isinstance(digits, (int, np.integer)) or not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be an integer in 1..{MAX_DIGITS}, got {digits!r}")
    if operator not in OPERATORS:
        raise ValueError(f"operator must be one of {OPERATORS}, got {operator!r}")
    return (int(digits) - 1) * len(OPERATORS) + OPERATORS.index(operator)


def level_name(level: int) -> str:
    """Level index -> its name ("add2", "sub3", "mul1", ...) (host)."""
    if not 0 <= int(level) < NUM_LEVELS:
        raise ValueError(f"level must be in 0..{NUM_LEVELS - 1}, got {level!r}")
    return LEVEL_NAMES[int(level)]


def level_of_name(name: str) -> int:
    """Level name ("add2", ...) -> its index (host; ValueError naming the valid names otherwise)."""
    if name not in LEVEL_NAMES:
        raise ValueError(f"unknown level {name!r}; levels are {', '.join(LEVEL_NAMES)}")
    return LEVEL_NAMES.index(name)


# ----------------------------------------------------------------------------------------------------------
# The draw
# ----------------------------------------------------------------------------------------------------------


def draw_words(seed: jax.Array, level: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32[] seed, int32[] level -> the two uint32[] words of fold_in(PRNGKey(seed), level) (`envs.prng`)."""
    return fold_in_words(seed, level)


_POW10 = np.array([10**i for i in range(MAX_DIGITS + 1)], np.int64)
_LOW = np.array([0] + [10 ** (d - 1) for d in range(2, MAX_DIGITS + 1)], np.uint32)  # by digits - 1
_SPAN = np.array([10] + [9 * 10 ** (d - 1) for d in range(2, MAX_DIGITS + 1)], np.uint32)


class Problem(NamedTuple):
    """One problem (int32 scalars; batched under vmap): operands, operator, digits, level, answer."""

    a: jax.Array
    b: jax.Array
    op: jax.Array  # ADD, SUB or MUL
    digits: jax.Array  # 1..MAX_DIGITS
    level: jax.Array
    answer: jax.Array


def answer_of(a: jax.Array, b: jax.Array, op: jax.Array) -> jax.Array:
    """int32 operands and operator code -> int32 a + b, a - b or a * b."""
    return jnp.select([op == ADD, op == SUB], [a + b, a - b], a * b).astype(jnp.int32)


def problem(seed: jax.Array, level: jax.Array) -> Problem:
    """uint32[] seed, int32[] level in 0..NUM_LEVELS-1 (clipped) -> the Problem (see the module docstring)."""
    level = jnp.clip(jnp.asarray(level, jnp.int32), 0, NUM_LEVELS - 1)
    digits = level // len(OPERATORS) + 1
    op = level % len(OPERATORS)
    w0, w1 = draw_words(seed, level)
    low, span = jnp.asarray(_LOW)[digits - 1], jnp.asarray(_SPAN)[digits - 1]
    a = (low + w0 % span).astype(jnp.int32)
    b = (low + w1 % span).astype(jnp.int32)
    return Problem(a, b, op.astype(jnp.int32), digits.astype(jnp.int32), level, answer_of(a, b, op))


def digits_of(value: jax.Array, width: int) -> jax.Array:
    """int32[] value >= 0 -> int32[width] its decimal digits, most significant first, -1 for the positions
    before its first digit (0 shows as one digit 0). Values of more than `width` digits keep the low ones."""
    value = jnp.asarray(value, jnp.int32)
    powers = jnp.asarray(_POW10[:width][::-1].astype(np.int32))
    digit = (value // powers) % 10
    shown = (value >= powers) | (powers == 1)
    return jnp.where(shown, digit, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Levels of a curriculum stage
# ----------------------------------------------------------------------------------------------------------


def stratified_levels(key: jax.Array, num_prompts: int, levels: jax.Array) -> jax.Array:
    """PRNG key, static num_prompts, int32[L] levels -> int32[num_prompts]: prompt i gets levels[(i + o) % L]
    for one random offset o, so each level appears floor or ceil of num_prompts / L times (every level
    exactly as often when L divides num_prompts) and none is always the short one."""
    levels = jnp.asarray(levels, jnp.int32)
    count = levels.shape[0]
    offset = jax.random.randint(key, (), 0, count)
    return levels[(jnp.arange(num_prompts, dtype=jnp.int32) + offset) % count]
