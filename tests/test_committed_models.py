"""The committed models of the CPU experiments reproduce the after-RL rows of their committed results tables.

Each entry is (folder under experiments/checkpoints, its preset, its results table under experiments/results:
the experiment's `results.md`, or a folder holding it): the model is evaluated as the experiment evaluates it
(the preset's `[eval]`: its settings in order, its number of games, its seed, greedy), and every
"after RL vs <setting>" row of that table must come out the same, to the 0.1 % the table shows. The Tic-Tac-Toe CPU model has its own, stricter test (tests/test_golden.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = [
    ("cpu_exploit", "cpu_exploit.toml", "cpu_exploit"),
    ("cpu_from_reward", "cpu_from_reward.toml", "cpu_from_reward"),
    ("seed_recipe", "seed_recipe.toml", "seed_recipe"),
    ("main", "main.toml", "main"),
    ("qwen3_cpu", "qwen3_cpu.toml", "qwen3_cpu"),  # the second model family
    ("arithmetic_rl", "arithmetic_rl.toml", "arithmetic_rl_run6/experiment_results.md"),
]


def table_rows(markdown: str, prefix: str) -> dict[str, str]:
    """The rows of a results table whose model cell starts with `prefix` -> {model cell: the whole line}."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith(prefix):
            rows[cells[0]] = line.strip()
    return rows


@pytest.mark.parametrize("name,preset,results", COMMITTED)
def test_committed_model_reproduces_its_after_rl_rows(name, preset, results):
    from jaxrl_llm.config import load_config
    from jaxrl_llm.metrics import format_results_table
    from jaxrl_llm.train import build, evaluate, policy_params

    config = load_config(ROOT / "experiments" / "presets" / preset)
    comp = build(config)
    params = policy_params(config, comp, str(ROOT / "experiments" / "checkpoints" / name))
    summaries = evaluate(comp, params)
    rows = [{"model": f"after RL vs {setting}", **summary} for setting, summary in summaries.items()]
    got = table_rows(format_results_table(rows, comp.env.results_columns), "after RL")
    table = ROOT / "experiments" / "results" / results
    want = table_rows((table if table.suffix == ".md" else table / "results.md").read_text(), "after RL")
    assert set(want) == {f"after RL vs {s}" for s in config.eval.settings}
    assert got == want
