"""The arithmetic results (experiments/arithmetic_results.py and the committed experiments/results/arithmetic/).

- The script's pieces against independent computations: the Wilson interval against the root of the score
  test's equation (scipy), the per-level table and the paired GRPO-minus-SFT row against plain counts on
  synthetic per-game records scored by the pure-Python reference (`tests/reference_arithmetic.py`).
- The committed table: every level has its 1 000 problems, the outcomes sum to 1, the GRPO row agrees with
  the two model rows, and the issue's targets are reported as they are (the run meets them; see
  experiments/README.md): the test pins the measured figures' relation to the targets.

No trained model is committed for this preset (the run's checkpoint was not kept), so there is no test that
re-evaluates one; see experiments/README.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
from pathlib import Path

import pytest
from scipy.optimize import brentq

sys.path.insert(0, os.path.dirname(__file__))
import reference_arithmetic as ref  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "arithmetic"
LEVELS = ("add1", "sub1", "add2", "sub2", "add3", "sub3")


def _script():
    spec = importlib.util.spec_from_file_location("arithmetic_results", ROOT / "experiments" / "arithmetic_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ar = _script()


@pytest.mark.parametrize("successes,n", [(0, 10), (3, 10), (10, 10), (114, 1000), (999, 1000), (1, 1000)])
def test_wilson_interval_is_the_score_tests_acceptance_region(successes, n):
    z = 1.96
    p_hat = successes / n
    f = lambda p: abs(p_hat - p) - z * math.sqrt(p * (1 - p) / n)  # noqa: E731  <= 0 inside the interval
    inner = min(max(p_hat, 1e-12), 1 - 1e-12)  # f < 0 there: the bracket's inner end
    lo = 0.0 if successes == 0 else brentq(f, 1e-12, inner, xtol=1e-14)
    hi = 1.0 if successes == n else brentq(f, inner, 1 - 1e-12, xtol=1e-14)
    assert ar.wilson(successes, n, z) == pytest.approx((lo, hi), abs=1e-9)


def _records(seed: int, n: int, p_exact: float) -> list[dict]:
    """Synthetic eval records per level: the reference's problem of each seed, a reply right with p_exact."""
    rng = random.Random(seed)
    out = []
    for level in LEVELS:
        index = ref.level(int(level[3:]), "+" if level.startswith("add") else "-")
        for i in range(n):
            s = rng.getrandbits(32)
            p = ref.problem(s, index)
            roll = rng.random()
            value = p["answer"] if roll < p_exact else p["answer"] + 1
            reply = ("It is 12." if roll > 0.97 else f"<answer>{value}</answer>")
            score = ref.score(reply, p["answer"])
            out.append({"setting": level, "index": i, "seed": s, "answer": p["answer"], "outcome": score["outcome"],
                        "reward_parts": {"exact": score["exact"], "format": score["format"]}})
    return out


def test_level_table_and_grpo_row_count_outcomes_as_plain_python():
    sft = _records(0, 50, 0.5)
    rl = [dict(r) for r in sft]
    rng = random.Random(1)
    for r in rl:  # flip some outcomes: the paired counts must see them
        if rng.random() < 0.3:
            r["outcome"] = "wrong" if r["outcome"] == "exact" else "exact"
    table, delta = ar.level_table(rl), ar.grpo_delta(sft, rl)
    for level in LEVELS:
        games = [r for r in rl if r["setting"] == level]
        for outcome in ("exact", "wrong", "invalid", "missing"):
            assert table[level][outcome] == sum(r["outcome"] == outcome for r in games) / 50
        before = {r["index"]: r["outcome"] == "exact" for r in sft if r["setting"] == level}
        fixed = sum(r["outcome"] == "exact" and not before[r["index"]] for r in games)
        broken = sum(r["outcome"] != "exact" and before[r["index"]] for r in games)
        assert (delta[level]["fixed"], delta[level]["broken"]) == (fixed, broken)
        assert delta[level]["points"] == pytest.approx(100 * (table[level]["exact"] - ar.level_table(sft)[level]["exact"]))


def test_grpo_row_refuses_records_of_different_problems():
    sft = _records(0, 5, 0.5)
    rl = _records(1, 5, 0.5)
    with pytest.raises(ValueError, match="different problems"):
        ar.grpo_delta(sft, rl)


def test_committed_table_is_consistent_and_reports_the_targets_as_measured():
    summary = json.loads((RESULTS / "results.json").read_text())
    models = summary["models"]
    assert set(models) == {"base", "after SFT", "after RL"}
    for rows in models.values():
        assert tuple(rows) == LEVELS
        for r in rows.values():
            assert r["games"] == 1000
            assert sum(r[k] for k in ("exact", "wrong", "invalid", "missing")) == pytest.approx(1.0)
            lo, hi = r["exact_ci95"]
            assert lo <= r["exact"] <= hi
    for level, d in summary["grpo_minus_sft"].items():
        change = models["after RL"][level]["exact"] - models["after SFT"][level]["exact"]
        assert d["points"] == pytest.approx(100 * change) and d["fixed"] - d["broken"] == round(1000 * change)
    rl = models["after RL"]
    # The targets (add2 >= 98 %, add3 and sub3 >= 85 %) are met by the committed run (aligned prompt,
    # 2 000 SFT steps); the 1-digit levels are saturated.
    assert rl["add1"]["exact"] >= 0.99 and rl["sub1"]["exact"] >= 0.99
    assert all(rl[level]["exact"] >= target for level, target in (("add2", 0.98), ("add3", 0.85), ("sub3", 0.85)))
    assert summary["timings"]["total_s"] < 20 * 60
    for png in ("sft_check_curves.png", "grpo_level_curves.png"):
        assert (RESULTS / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
