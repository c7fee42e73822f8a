"""Evaluation: greedy games in each of the env's evaluation settings, summarised by the env's own metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from jaxrl_llm import distributed
from jaxrl_llm.algos import sft
from jaxrl_llm.rollout import Trajectory, game_record, make_rollout
from jaxrl_llm.train.components import Components
from jaxrl_llm.train.keys import stream

GENERIC_SUMMARY = ("games", "format", "reward", "turns")  # what every summary holds besides the env's metrics


def _metric_means(metrics: dict) -> dict[str, float]:
    """Mean of each per-game metric over the games where it is not NaN; a metric NaN for every game (it applies
    to none of them, e.g. another level's accuracy) is left out."""
    out = {}
    for name, v in metrics.items():
        v = np.asarray(v, np.float64)
        kept = v[~np.isnan(v)]
        if kept.size:
            out[name] = float(kept.mean())
    return out


def summarize(traj: Trajectory) -> dict[str, float]:
    """Means of the env's per-game metrics (over the games where each is not NaN; one NaN for all is left
    out), the format rate (of replies), the mean reward and turns (host)."""
    traj = jax.device_get(traj)
    clash = set(traj.metrics) & set(GENERIC_SUMMARY)
    if clash:
        raise ValueError(f"env metric names {sorted(clash)} are reserved for the generic summary; rename them")
    replies = max(int(np.sum(traj.turns)), 1)
    return {
        "games": int(traj.tokens.shape[0]),
        **_metric_means(traj.metrics),
        "format": float(np.sum(traj.reply_format) / replies),
        "reward": float(np.mean(traj.reward)),
        "turns": float(np.mean(np.asarray(traj.turns, np.float64))),
    }


def eval_rollout(comp: Components):
    """The jitted evaluation rollout (eval's rollout and sampling), compiled once per Components."""
    if "eval_rollout" not in comp.compiled:
        ev = comp.config.eval
        comp.compiled["eval_rollout"] = make_rollout(comp.env, comp.model_fn, comp.init_cache, comp.tables,
                                                     ev.rollout, comp.sampling_config(ev.sampling))
    return comp.compiled["eval_rollout"]


def play_in_batches(run, params, examples, key, batch_size: int) -> Trajectory:
    """`run(params, examples, key)` over the games in batches of `batch_size` (0, or at least the number of
    games: one batch) -> the Trajectory of every game, in order (on the host when batched; multi-host: every
    game, on every host). A last, short batch is padded with copies of the first games (the same shape: one
    program) and the copies dropped. Batch c > 0 plays with key fold_in(key, c)."""
    num_games = jax.tree_util.tree_leaves(examples)[0].shape[0]
    if not batch_size or batch_size >= num_games:
        return distributed.gather(run(params, examples, key))
    batches = -(-num_games // batch_size)
    order = np.arange(batches * batch_size) % num_games
    parts = []
    for c in range(batches):
        rows = order[c * batch_size:(c + 1) * batch_size]
        chunk = jax.tree_util.tree_map(lambda a: a[rows], examples)
        batch_key = key if c == 0 else jax.random.fold_in(key, c)
        parts.append(distributed.gather(run(params, chunk, batch_key)))  # dispatched; no host sync per batch
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs)[:num_games], *jax.device_get(parts))


def evaluate(comp: Components, params, settings: Sequence[str] | None = None, num_games: int | None = None,
             key=None, games_path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Plays `num_games` games in each evaluation setting (names; default: eval.settings, or all the env's)
    -> {setting: summary}; writes every game to `games_path` (JSONL) if given."""
    config = comp.config
    available = {s.name: s for s in comp.env.eval_settings()}
    chosen = config.eval_settings() if settings is None else []
    for name in settings or ():
        if name not in available:
            raise ValueError(f"env {comp.env.name!r} has no evaluation setting {name!r}; it has {sorted(available)}")
        chosen.append(available[name])
    num_games = num_games or config.eval.num_games
    key = stream(config.run.seed, "eval") if key is None else key
    run = eval_rollout(comp)
    results, records = {}, []
    for i, setting in enumerate(chosen):
        k_examples, k_play = jax.random.split(jax.random.fold_in(key, i))
        examples = comp.env.eval_examples(k_examples, num_games, setting.stage)
        traj = play_in_batches(run, params, examples, k_play, config.eval.batch_size)
        results[setting.name] = summarize(traj)
        if games_path is not None:
            records.append((setting.name, traj))
    if games_path is not None and distributed.is_writer():
        path = Path(games_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for name, traj in records:
                for b in range(traj.tokens.shape[0]):
                    f.write(json.dumps({"setting": name, **game_record(comp.env, comp.tokenizer, traj, b)}) + "\n")
    return results


def exactness_check(comp: Components, params) -> dict[str, Any] | None:
    """`sft.teacher_forced_check` on the env's check rows for the config's teacher (for a deterministic
    teacher, every game it can meet: exact = 1.0 means greedy play equals the teacher's against any
    opponent), or None when the env has none."""
    teacher = comp.config.sft.teacher
    if not comp.env.has_check_rows(teacher):
        return None
    rows = comp.env.check_rows(teacher, comp.env.params)
    data = sft.tokenize_sft(comp.tokenizer, rows, 8192)
    longest = int(data["lengths"].max())
    data = {k: v[:, :longest] if v.ndim == 2 else v for k, v in data.items()}
    return sft.teacher_forced_check(comp.module, params, data)
