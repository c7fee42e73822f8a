"""Resume checks the training config: a run goes on only with the config it was started with.

Every checkpoint step records the config it was saved with (`compat.config_meta`: the dict and the TOML). When a
run resumes, the config of the step it resumes from is compared with the config given now, key by key
(dotted keys: `grpo.0.optim.learning_rate`), over the keys that change what the run computes:

- GRPO: every key except `IGNORED` (where outputs go, logging, checkpoints, evaluation, the device mesh) and
  the `sft` table (SFT is done by then);
- SFT (in progress): the keys of `SFT_SCOPE` (model, tokenizer, env, LoRA, rollout, sft, run.seed).

A difference is refused (`ResumeConfigError`, one line naming each key as `old -> new` and the fixes) unless
`checkpoint.accept_config_change = true` (the CLI's `--accept-config-change`): the run then goes on with the
new values and the first new row of the metrics file records the change (`config_change`).

Extending the schedule needs no flag. Raising the `steps` of the stage the run is in or ended in (or of a
later stage), adding stages after the last, or raising `sft.steps` of an SFT in progress, changes no step
already taken: the run goes on from where it is, the extended stage keeps its optimizer state, and its
learning-rate schedule is recomputed over the new length (a warm-up already done stays done; a decaying
schedule continues from its new position, so the next rates are somewhat higher than the old schedule's
would have been). The change is logged and recorded in the metrics file all the same. Lowering the steps of a
stage below those already taken, or changing the steps of a stage the run has left (that moves the stage
boundaries under the steps taken), is a change like any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_base.errors import ConfigError

__all__ = ["IGNORED", "SFT_SCOPE", "ResumeConfigError", "flatten", "config_changes", "schedule_extensions",
           "check_resumed_config"]

IGNORED = ("run.output_dir", "run.log", "run.log_every", "run.sample_every", "checkpoint", "eval", "mesh")
SFT_SCOPE = ("model", "tokenizer", "env", "lora", "rollout", "sft", "run.seed")
MISSING = "(none)"


class ResumeConfigError(ConfigError):
    """A run would resume with a training config other than the one it was trained with."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config dict as {dotted key: value}; lists are indexed (`grpo.0.steps`); a list of scalars is a value."""
    if isinstance(tree, Mapping):
        items = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in tree):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return {prefix: list(tree) if isinstance(tree, tuple) else tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    if not items and prefix:
        out[prefix] = {} if isinstance(tree, Mapping) else []
    return out


def _in(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any], scope: str) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for each training-relevant key whose value differs between two config dicts
    (`config_to_dict`); scope "grpo" or "sft" (see the module docstring). A key absent on one side is `MISSING`."""
    old, new = flatten(saved), flatten(now)
    keys = list(old) + [k for k in new if k not in old]
    out = []
    for key in keys:
        outside = (scope == "grpo" and _in(key, ("sft",))) or (scope == "sft" and not _in(key, SFT_SCOPE))
        if _in(key, IGNORED) or outside:
            continue
        a, b = old.get(key, MISSING), new.get(key, MISSING)
        if a != b:
            out.append((key, a, b))
    return out


def _stage_of_last_step(stage_steps: Sequence[int], step: int) -> tuple[int, int]:
    """(the stage of the last step taken, the steps taken inside it) for stages of `stage_steps` steps."""
    if not stage_steps:
        return 0, step
    start = 0
    for i, n in enumerate(stage_steps):
        if step <= start + n:
            return i, step - start
        start += n
    return len(stage_steps) - 1, step - (start - stage_steps[-1])


def schedule_extensions(changes: list[tuple[str, Any, Any]], saved: Mapping[str, Any], step: int,
                        scope: str) -> list[tuple[str, Any, Any]]:
    """The changes among `changes` that only extend the schedule past `step` (see the module docstring)."""
    if scope == "sft":
        return [c for c in changes if c[0] == "sft.steps" and isinstance(c[2], int) and c[2] >= step]
    stages = [int(s.get("steps", 0)) for s in saved.get("grpo", ())]
    if not stages:
        return []
    current, done = _stage_of_last_step(stages, step)
    out = []
    appended = {c[0].split(".")[1] for c in changes if c[0].startswith("grpo.") and c[1] == MISSING}
    for change in changes:
        key, old, new = change
        parts = key.split(".")
        if parts[0] != "grpo" or len(parts) < 3 or not parts[1].isdigit():
            continue
        index = int(parts[1])
        if parts[1] in appended and index >= len(stages):  # a whole stage added after the last one
            out.append(change)
        elif parts[2:] == ["steps"] and isinstance(new, int) and (index > current or
                                                                  (index == current and new >= done)):
            out.append(change)
    return out


def _text(changes: list[tuple[str, Any, Any]], limit: int = 8) -> str:
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:limit])
    return shown + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")


def check_resumed_config(saved: Mapping[str, Any] | None, config: Any, step: int, scope: str, where: str,
                         log=print) -> dict[str, str]:
    """Compares the config a run was saved with at `step` (`saved`, a config dict; None: an old checkpoint
    without one, nothing to compare) with `config` (an ExperimentConfig) and returns the note for the first new
    metrics row ({"config_change": "key: old -> new; ..."}, {} when nothing changed). Raises `ResumeConfigError`
    for a change that is not a schedule extension unless `config.checkpoint.accept_config_change`."""
    from jaxrl_llm.config import config_from_dict, config_to_dict  # lazy: the schema imports the env registry

    if not saved:
        return {}
    try:  # the saved config read with today's defaults: keys added since then are not changes
        saved = config_to_dict(config_from_dict(dict(saved)))
    except Exception:  # noqa: BLE001 - a config today's schema cannot read: compare the dicts as they are
        saved = dict(saved)
    changes = config_changes(saved, config_to_dict(config), scope)
    if not changes:
        return {}
    extensions = schedule_extensions(changes, saved, step, scope)
    others = [c for c in changes if c not in extensions]
    accept = bool(getattr(config.checkpoint, "accept_config_change", False))
    if others and not accept:
        raise ResumeConfigError(
            f"{where} was trained to step {step} with another config than this one: {_text(others)}. Resuming "
            "would mix two configs in one run. Use the preset and --set values it was started with, start a new "
            "run (--set run.output_dir=...), or pass --accept-config-change (checkpoint.accept_config_change = "
            f"true) to go on from step {step} with the new values (metrics.jsonl records the change)")
    what = "accepted config change" if others else "schedule extended"
    log(f"resuming {where} at step {step}: {what}: {_text(changes)}")
    return {"config_change": _text(changes, limit=len(changes))}
