"""The experiment pipeline (`jaxrl-llm experiment`): SFT -> GRPO stages -> evaluation of the base, SFT and RL
models; the results table, the training curves, the wall-time split and a one-line JSON summary.

`run_experiment(config)` is the whole arc under one lock on the output folder (`run_lock.RunLock`), in named
stages: `_train` (SFT, then GRPO; its wall time split into rollouts and updates by `_grpo_time_split`),
`_evaluate_models`, `_exactness_checks` and `_write_outputs` (results.md, the curves' PNGs,
timings.json). It prints its progress and results as it goes; the CLI only parses the arguments.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax

from jaxrl_llm import distributed
from jaxrl_llm.metrics import (format_metric, format_results_table, log_name, metric_kind, plot_metrics,
                               read_metrics)
from jaxrl_llm.run_lock import RunLock
from jaxrl_llm.train.components import build, fresh_params, init_key
from jaxrl_llm.train.evaluate import evaluate, exactness_check
from jaxrl_llm.train.grpo_loop import time_stage_rollout, train_grpo
from jaxrl_llm.train.sft_loop import run_sft

SFT_CURVES = ("loss", "accuracy", "decision_loss", "decision_loss_floor", "illegal_prob", "check_exact",
              "learning_rate")
GRPO_CURVES = ("reward_mean", "reward_std", "{env}", "format_rate", "{examples}", "frac_zero_std_groups", "entropy",
               "decision_entropy", "illegal_choice_prob", "decision_policy_change", "learning_rate", "grad_norm",
               "step_time")


def run_experiment(config) -> dict:
    """The whole arc of an `ExperimentConfig` (see the module docstring), one trainer in its output folder.

    Returns the printed summary: {"experiment": {model: {setting: metrics}}, "check_exact": {model: f},
    and the wall times sft_s, grpo_s (grpo_rollout_s, grpo_update_s with GRPO stages), eval_s, total_s}.
    """
    with RunLock(config.run.output_dir):
        start = time.perf_counter()
        comp = build(config)
        out = Path(config.run.output_dir)
        sft_params, rl_params, times = _train(config, comp, out)
        t = time.perf_counter()
        results, rows = _evaluate_models(config, comp, out, sft_params, rl_params)
        times["eval_s"] = time.perf_counter() - t
        checks = _exactness_checks(comp, sft_params, rl_params)
        times["total_s"] = time.perf_counter() - start
        _write_outputs(comp, out, rows, times)
        summary = {"experiment": results, "check_exact": checks, **times}
        print(json.dumps(summary))
        return summary


def _train(config, comp, out: Path):
    """SFT, then the GRPO stages (the SFT model when none has steps). -> (sft params, RL params, times)."""
    times = {}
    t = time.perf_counter()
    sft_params = run_sft(config, comp)
    times["sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rl_params = train_grpo(config, comp)["params"] if any(s.steps for s in config.grpo) else sft_params
    times["grpo_s"] = time.perf_counter() - t
    if config.grpo:
        rollout_s = _grpo_time_split(config, comp, out, rl_params)
        times["grpo_rollout_s"] = rollout_s
        times["grpo_update_s"] = max(times["grpo_s"] - rollout_s, 0.0)
    return sft_params, rl_params, times


def _grpo_time_split(config, comp, out: Path, params) -> float:
    """The seconds of GRPO spent in rollouts: each stage's rollout timed alone once (`time_stage_rollout`),
    times its steps, capped by the median step time of metrics.jsonl."""
    metrics = read_metrics(out / "metrics.jsonl")
    rollout_s = 0.0
    for i, stage in enumerate(config.grpo):
        if stage.steps:
            one = time_stage_rollout(comp, i, params, jax.random.PRNGKey(config.run.seed + 13 + i))
            step_times = sorted(r["step_time"] for r in metrics if r.get("stage") == i)
            rollout_s += stage.steps * min(one, step_times[len(step_times) // 2] if step_times else one)
    return rollout_s


def _evaluate_models(config, comp, out: Path, sft_params, rl_params):
    """The base, SFT and RL models in each evaluation setting (games in <out>/eval_<model>.jsonl), printed as
    they finish. -> ({model: {setting: metrics}}, the results table's rows)."""
    base = fresh_params(comp, init_key(config))
    rows, results = [], {}
    for name, params in (("base", base), ("after SFT", sft_params), ("after RL", rl_params)):
        e = time.perf_counter()
        results[name] = evaluate(comp, params, games_path=out / f"eval_{name.replace(' ', '_')}.jsonl")
        for setting, r in results[name].items():
            rows.append({"model": f"{name} vs {setting}", **r})
            figures = ", ".join(f"{header} {format_metric(r[key], metric_kind(comp.env.metric_kinds, key))}"
                                for header, key in comp.env.results_columns if key in r)
            print(f"eval {name} vs {setting}: {figures} ({r['games']} games)", flush=True)
        print(f"eval {name}: {time.perf_counter() - e:.0f} s", flush=True)
    return results, rows


def _exactness_checks(comp, sft_params, rl_params) -> dict:
    """The teacher-forced exactness check of the SFT and RL models, when the env's teacher has one."""
    checks = {}
    for name, params in (("after SFT", sft_params), ("after RL", rl_params)):
        check = exactness_check(comp, params)
        if check is not None:
            checks[name] = check["exact"]
            print(f"{name}: {100 * checks[name]:.2f} % of the teacher's check conversations reproduced exactly "
                  "(teacher-forced, greedy)", flush=True)
    return checks


def _write_outputs(comp, out: Path, rows: list[dict], times: dict) -> None:
    """results.md (printed too), the SFT and GRPO curves' PNGs, the wall-time split and timings.json."""
    table = format_results_table(rows, comp.env.results_columns, kinds=comp.env.metric_kinds)
    distributed.write_text(out / "results.md", table + "\n")  # multi-host: process 0 writes
    print(table)
    for name in ("sft", "grpo"):
        path = out / ("sft_metrics.jsonl" if name == "sft" else "metrics.jsonl")
        if path.is_file():
            present = set().union(*(r.keys() for r in read_metrics(path)))
            chosen = [k for k in SFT_CURVES if k in present] if name == "sft" else grpo_curve_keys(comp, present)
            print(f"curves: {plot_metrics(path, out / f'{name}_curves.png', keys=chosen, title=f'{name} ({out})')}")
    split = ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in times.items())
    print(f"wall time: {split}")
    distributed.write_text(out / "timings.json", json.dumps(times, indent=1) + "\n")


def grpo_curve_keys(comp, present) -> list[str]:
    """The GRPO curves: the generic ones with the env's metrics (`<metric>_rate`) and example figures."""
    env = comp.env
    env_keys = [log_name(m, metric_kind(env.metric_kinds, m)) for _, m in env.results_columns if m != "format"]
    example_keys: list[str] = []
    if comp.config.grpo:
        stage = comp.config.grpo[0].curriculum
        examples = jax.eval_shape(lambda: env.sample_examples(jax.random.PRNGKey(0), 1, 1, stage))
        example_keys = list(jax.eval_shape(env.example_metrics, examples))
    keys = []
    for k in GRPO_CURVES:
        keys += env_keys if k == "{env}" else example_keys if k == "{examples}" else [k]
    return [k for k in dict.fromkeys(keys) if k in present]
