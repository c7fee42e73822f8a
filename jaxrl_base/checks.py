"""Value checks shared by every config dataclass; they raise `ConfigError` (`jaxrl_base.errors`).

Each dataclass that a TOML table becomes (`SamplingConfig`, `GrpoConfig`, `OptimConfig`, an env's
`Params`, ...) checks its own fields in `__post_init__` with these helpers, once. A failed check raises
`ConfigError(reason, (field,), owner=ClassName)`; the TOML loader (`jaxrl_llm.config`) re-raises it with
the whole key path (`grpo.0.loss.beta: must be ...`), so the same check serves Python and TOML users.
The envs and models use it too, so it lives below them (`jaxrl_llm.checks` re-exports it).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_base.errors import ConfigError

__all__ = ["ConfigError", "EnvBound", "check_int", "check_float", "check_probability", "check_choice", "check_str"]


@dataclasses.dataclass(frozen=True)
class EnvBound:
    """Marker for a config field whose type belongs to the experiment's env: `Annotated[Any, EnvBound("Stage")]`
    is the env class's `Stage` (or `Params`, `Teacher`). The TOML loader builds it once it knows the env."""

    attr: str


def _owner(obj: Any) -> str:
    return type(obj).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_int(obj: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    """obj.name must be an integer (not a bool) in [low, high]; returns it as a Python int."""
    value = getattr(obj, name)
    if not _is_int(value):
        raise ConfigError(f"must be an integer, got {value!r}", (name,), _owner(obj))
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in {low}..{high}")
        raise ConfigError(f"must be {bounds} (got {value})", (name,), _owner(obj))
    return int(value)


def check_float(obj: Any, name: str, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, finite: bool = True) -> float:
    """obj.name must be a number (NaN never passes; infinities only with finite=False) in the range
    given (open ends with low_open / high_open); returns it as a Python float."""
    value = getattr(obj, name)
    if not _is_number(value):
        raise ConfigError(f"must be a number, got {value!r}", (name,), _owner(obj))
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ConfigError(f"must be a finite number (got {value})", (name,), _owner(obj))
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        left = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        right = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        if low is not None and high is not None:
            bounds = f"in {left}, {right}"
        elif low is not None:
            bounds = f"{'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"{'<' if high_open else '<='} {high:g}"
        raise ConfigError(f"must be {bounds} (got {value:g})", (name,), _owner(obj))
    return value


def check_probability(obj: Any, name: str) -> float:
    """obj.name must be a probability in [0, 1]."""
    return check_float(obj, name, 0.0, 1.0)


def check_str(obj: Any, name: str, allow_empty: bool = False) -> str:
    """obj.name must be a string (non-empty unless allow_empty)."""
    value = getattr(obj, name)
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {value!r}", (name,), _owner(obj))
    if not value and not allow_empty:
        raise ConfigError("must not be empty", (name,), _owner(obj))
    return value


def check_choice(obj: Any, name: str, choices: Sequence[Any]) -> Any:
    """obj.name must be one of `choices` (a "did you mean" for a near miss)."""
    value = getattr(obj, name)
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"must be one of {', '.join(map(repr, choices))} (got {value!r}){hint}", (name,),
                          _owner(obj))
    return value
