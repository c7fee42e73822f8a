"""The env's values in a training step's metrics row, checked before the step's weights are kept: a reward part
that is NaN or infinite, or an infinite metric, is the env's fault (not the learning rate's), and the error says
so, naming the rubric part or the metric (`EnvError`; `jaxrl-llm check-env` finds the same on the env alone).

A NaN metric stays allowed: it is the protocol's "not this game's metric".
"""

from __future__ import annotations

import math
from typing import Any

from jaxrl_base.errors import EnvError
from jaxrl_llm.metrics import log_name, metric_kind

__all__ = ["check_env_values"]


def check_env_values(record: dict[str, Any], env: Any, what: str, step: int) -> None:
    """Raise `EnvError` when the row of step `step` (1-based; `what`: "GRPO") holds a non-finite mean of a rubric
    part (`<part>_reward`) or an infinite env metric (`<name>_rate` / `<name>_mean`)."""
    name = getattr(env, "name", "") or type(env).__name__
    parts = [p.name for p in env.rubric(env.params)]
    bad = {p: record[f"{p}_reward"] for p in parts
           if isinstance(record.get(f"{p}_reward"), float) and not math.isfinite(record[f"{p}_reward"])}
    if bad:
        shown = ", ".join(f"{p!r} = {v}" for p, v in bad.items())
        raise EnvError(f"{what} step {step}: the env {name!r} gave a non-finite reward: rubric part {shown} (the "
                       "batch mean). The loss cannot be computed, so the step's weights are dropped. Fix the env's "
                       f"reward_parts for that part; `jaxrl-llm check-env {name}` checks it without a model")
    kinds = getattr(env, "metric_kinds", {})
    infinite = {key: record[key] for key in (log_name(m, metric_kind(kinds, m)) for m in _metric_names(env, record))
                if isinstance(record.get(key), float) and math.isinf(record[key])}
    if infinite:
        shown = ", ".join(f"{k} = {v}" for k, v in infinite.items())
        raise EnvError(f"{what} step {step}: the env {name!r} gave an infinite metric ({shown}); a metric may be NaN "
                       "(not this game's metric) but never infinite. Fix the env's metrics; `jaxrl-llm check-env "
                       f"{name}` checks it")


def _metric_names(env: Any, record: dict[str, Any]) -> list[str]:
    """The env metric names whose logged form is in the row (the results table's and the outcomes, at least)."""
    names = {m for _, m in getattr(env, "results_columns", ())} | set(getattr(env, "outcome_metrics", ()))
    kinds = getattr(env, "metric_kinds", {})
    names |= {k[: -len("_rate")] for k in record if k.endswith("_rate")}
    means = {k[: -len("_mean")] for k in record if k.endswith("_mean")}
    names |= {m for m in means if metric_kind(kinds, m) == "mean"}
    return sorted(n for n in names if n not in ("format", "reward"))
