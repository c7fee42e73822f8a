"""The arithmetic experiment's results folder from a finished run of `presets/arithmetic_cpu.toml`.

    jaxrl-llm experiment experiments/presets/arithmetic_cpu.toml           # writes runs/arithmetic_cpu/
    python experiments/arithmetic_results.py runs/arithmetic_cpu --out experiments/results/arithmetic

Reads the run's per-game evaluation records (`eval_<model>.jsonl`), its SFT and GRPO metrics and its timings;
writes into `--out`:

    results.md / results.json   exact / wrong / invalid / missing / format per model and level (1 000 problems
                                each, greedy), a 95 % Wilson interval on exact, and the row of what GRPO adds
                                over SFT: the exact-rate change in points, with the problems GRPO fixed and
                                broke (the evaluation problems are the same for every model: paired counts)
    sft_check_curves.png        check_exact_<level> against the SFT step (200 fixed problems per level,
                                teacher-forced and greedy: the greedy accuracy on those problems)
    grpo_level_curves.png       exact_<level>_rate against the GRPO step (the sampled rollouts of each step)
    timings.json                the run's wall-time split

The last stdout line is one JSON object (the table).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

MODELS = ("base", "after SFT", "after RL")
OUTCOMES = ("exact", "wrong", "invalid", "missing")


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate (successes of n) at z (1.96: 95 %)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def level_table(records: list[dict]) -> dict[str, dict]:
    """Per-game records of one model -> {level: {games, exact, wrong, invalid, missing, format, exact_ci95}}."""
    table: dict[str, dict] = {}
    for setting in dict.fromkeys(r["setting"] for r in records):
        games = [r for r in records if r["setting"] == setting]
        n = len(games)
        row = {"games": n}
        for outcome in OUTCOMES:
            row[outcome] = sum(r["outcome"] == outcome for r in games) / n
        row["format"] = sum(r["reward_parts"]["format"] for r in games) / n
        row["exact_ci95"] = wilson(sum(r["outcome"] == "exact" for r in games), n)
        table[setting] = row
    return table


def grpo_delta(sft: list[dict], rl: list[dict]) -> dict[str, dict]:
    """Paired per-level change from the SFT to the RL model on the same problems: points, fixed, broken."""
    out = {}
    by_key = {(r["setting"], r["index"]): r for r in sft}
    for setting in dict.fromkeys(r["setting"] for r in rl):
        games = [r for r in rl if r["setting"] == setting]
        fixed = broken = 0
        for r in games:
            before = by_key[(setting, r["index"])]
            if (before["seed"], before["answer"]) != (r["seed"], r["answer"]):
                raise ValueError(f"the SFT and RL evaluations met different problems at {setting} #{r['index']}")
            was, now = before["outcome"] == "exact", r["outcome"] == "exact"
            fixed += now and not was
            broken += was and not now
        out[setting] = {"games": len(games), "points": 100 * (fixed - broken) / len(games), "fixed": fixed,
                        "broken": broken}
    return out


def markdown(tables: dict[str, dict], delta: dict[str, dict]) -> str:
    lines = ["| model | level | exact | 95 % CI | wrong | invalid | missing | format |", "|---|---|---|---|---|---|---|---|"]
    for model, table in tables.items():
        for level, r in table.items():
            lo, hi = r["exact_ci95"]
            lines.append(f"| {model} | {level} | {100 * r['exact']:.1f} | {100 * lo:.1f}-{100 * hi:.1f} | "
                         f"{100 * r['wrong']:.1f} | {100 * r['invalid']:.1f} | {100 * r['missing']:.1f} | "
                         f"{100 * r['format']:.1f} |")
    lines += ["", "What GRPO adds over SFT (the same problems; exact-rate change in points, problems fixed / broken):",
              "", "| level | " + " | ".join(delta) + " |", "|---|" + "---|" * len(delta),
              "| GRPO - SFT | " + " | ".join(f"{d['points']:+.1f} ({d['fixed']}/{d['broken']})" for d in delta.values())
              + " |"]
    return "\n".join(lines) + "\n"


def plot_curves(rows: list[dict], keys: list[tuple[str, str]], x_label: str, title: str, out: Path) -> Path:
    """One line per (metric key, label) of rows (x = step) in one axes; NaN / missing points skipped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for key, label in keys:
        pts = [(r["step"], 100 * r[key]) for r in rows
               if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
    ax.set_xlabel(x_label)
    ax.set_ylabel("exact (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.savefig(out)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="the run's output folder, e.g. runs/arithmetic_cpu")
    ap.add_argument("--out", default="experiments/results/arithmetic")
    args = ap.parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = {m: read_jsonl(run / f"eval_{m.replace(' ', '_')}.jsonl") for m in MODELS}
    tables = {m: level_table(r) for m, r in records.items()}
    delta = grpo_delta(records["after SFT"], records["after RL"])
    (out / "results.md").write_text(markdown(tables, delta))
    summary = {"models": tables, "grpo_minus_sft": delta}
    if (run / "timings.json").is_file():
        timings = json.loads((run / "timings.json").read_text())
        summary["timings"] = timings
        shutil.copyfile(run / "timings.json", out / "timings.json")
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    levels = list(tables["after SFT"])
    sft_rows = [r for r in read_jsonl(run / "sft_metrics.jsonl") if "check_exact" in r]
    plot_curves(sft_rows, [(f"check_exact_{lv}", lv) for lv in levels], "SFT step",
                "SFT: greedy exact on 200 fixed problems per level", out / "sft_check_curves.png")
    if (run / "metrics.jsonl").is_file():
        grpo_rows = read_jsonl(run / "metrics.jsonl")
        plot_curves(grpo_rows, [(f"exact_{lv}_rate", lv) for lv in levels if any(
            isinstance(r.get(f"exact_{lv}_rate"), float) and not math.isnan(r[f"exact_{lv}_rate"]) for r in grpo_rows)],
            "GRPO step", "GRPO: exact of the sampled rollouts per level (T = 1)", out / "grpo_level_curves.png")
    print((out / "results.md").read_text())
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
