"""An independent pure-Python arithmetic env, written from the documented definitions only (no JAX, no env code).

- the draw (`envs/arithmetic/task.py` docstring): the two words of fold_in(PRNGKey(seed), level), i.e.
  Threefry-2x32 (20 rounds, Salmon et al. 2011) of the block (0, level) under the key (0, seed); then
  a = lo + w0 % span, b = lo + w1 % span with (lo, span) = (0, 10) for one digit, else
  (10**(d-1), 9 * 10**(d-1));
- level index (digits - 1) * 3 + op, names add/sub/mul + digits;
- the messages of the two prompt presets, as the env's docstrings print them;
- the reply's reading, with Python's `re` exactly as the env docstring states it;
- the rubric: exact x 1 + format x 0.2; the teacher's worked answers.
"""

from __future__ import annotations

import re

MASK = 0xFFFFFFFF
OPS = "+-x"
OP_NAMES = ("add", "sub", "mul")


# ---------------------------------------------------------------------------------------------------------
# Threefry-2x32, from the paper's description: 20 rounds in 5 groups of 4, rotation constants
# R = (13, 15, 26, 6, 17, 29, 16, 24) used round-robin, a key injection after every group of 4 rounds.
# ---------------------------------------------------------------------------------------------------------

R = (13, 15, 26, 6, 17, 29, 16, 24)
C240 = 0x1BD11BDA


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & MASK


def threefry(key: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    k = [key[0] & MASK, key[1] & MASK]
    k.append(k[0] ^ k[1] ^ C240)
    x = [(block[0] + k[0]) & MASK, (block[1] + k[1]) & MASK]
    for rnd in range(20):
        x[0] = (x[0] + x[1]) & MASK
        x[1] = rotl(x[1], R[rnd % 8]) ^ x[0]
        if rnd % 4 == 3:
            s = rnd // 4 + 1  # injection number 1..5
            x[0] = (x[0] + k[s % 3]) & MASK
            x[1] = (x[1] + k[(s + 1) % 3] + s) & MASK
    return x[0], x[1]


def fold_in_words(seed: int, data: int) -> tuple[int, int]:
    """The two words of jax.random.fold_in(jax.random.PRNGKey(seed), data) for 32-bit seed and data."""
    return threefry((0, seed & MASK), (0, data & MASK))


# ---------------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------------


def level(digits: int, op: str) -> int:
    return (digits - 1) * 3 + OPS.index(op)


def level_name(index: int) -> str:
    return f"{OP_NAMES[index % 3]}{index // 3 + 1}"


def problem(seed: int, index: int) -> dict:
    """The problem of (seed, level index): a, b, op ("+", "-", "x"), digits, answer."""
    digits, op = index // 3 + 1, OPS[index % 3]
    w0, w1 = fold_in_words(seed, index)
    lo, span = (0, 10) if digits == 1 else (10 ** (digits - 1), 9 * 10 ** (digits - 1))
    a, b = lo + w0 % span, lo + w1 % span
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return {"a": a, "b": b, "op": op, "digits": digits, "level": index, "answer": answer}


def message(preset: str, a: int, b: int, op: str) -> str:
    """The user message: tiny `347+598=`, reference `What is 347 + 598?`, aligned `0347+0598=`."""
    if preset == "tiny":
        return f"{a}{op}{b}="
    if preset == "aligned":
        return f"{str(a).rjust(4, '0')}{op}{str(b).rjust(4, '0')}="
    if preset == "reference":
        return f"What is {a} {op} {b}?"
    raise ValueError(preset)


def worked(answer: int, work: str = "reversed") -> str:
    if work == "none":
        return f"<answer>{answer}</answer>"
    sign = "-" if answer < 0 else ""
    return f"<think>{sign}{''.join(reversed(str(abs(answer))))}</think><answer>{answer}</answer>"


# ---------------------------------------------------------------------------------------------------------
# Replies and the rubric
# ---------------------------------------------------------------------------------------------------------

MAX_DIGITS = 8


def parse(reply: str) -> dict:
    """found / valid / value / format_ok of a reply, by Python's `re` (the env docstring's rules)."""
    m = re.search(r"<answer>\s*(.*?)\s*</answer>", reply, re.DOTALL)
    found = m is not None
    content = m.group(1).strip() if found else ""
    number = re.fullmatch(r"([+-]?)([0-9]+)", content) if found else None
    valid = number is not None and len(number.group(2)) <= MAX_DIGITS
    value = int(content) if valid else 0
    format_ok = re.search(r"<answer>.*?</answer>", reply, re.DOTALL) is not None
    return {"found": found, "valid": valid, "value": value, "format_ok": format_ok}


def score(reply: str, answer: int) -> dict:
    """The rubric's parts, the reward and the outcome metrics of a reply to a problem whose result is `answer`."""
    p = parse(reply)
    exact = float(p["valid"] and p["value"] == answer)
    fmt = float(p["format_ok"])
    outcome = "exact" if exact else "wrong" if p["valid"] else "invalid" if p["found"] else "missing"
    return {"exact": exact, "format": fmt, "reward": 1.0 * exact + 0.2 * fmt, "outcome": outcome}


def digit_credit(reply: str, answer: int) -> float:
    """The partial credit of a reply (string arithmetic, independent of the env's digit arrays): the share of
    digit positions, aligned from the units over the longer number, where the reply's integer and the result
    agree; 0 for an invalid reply or a wrong sign."""
    p = parse(reply)
    if not p["valid"] or (p["value"] < 0) != (answer < 0):
        return 0.0
    got, want = str(abs(p["value"]))[::-1], str(abs(answer))[::-1]
    width = max(len(got), len(want))
    return sum(i < len(got) and i < len(want) and got[i] == want[i] for i in range(width)) / width
