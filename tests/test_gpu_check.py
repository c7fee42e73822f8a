"""experiments/gpu_check.py --smoke runs every section on the CPU with tiny sizes and writes its JSON and
Markdown (issue 16): the script the first GPU session runs once must not fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_every_section(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result  # the last line is the JSON
    sections = result["sections"]
    assert set(sections) == {"device", "matmul", "decode", "prefill", "rollout", "grpo", "correctness"}
    assert not [name for name, part in sections.items() if "error" in part]
    assert sections["device"]["backend"] == "cpu" and sections["device"]["hbm_bytes_per_s"] is None
    assert [r["batch"] for r in sections["decode"]["batches"]] == [1, 4]
    assert all(r["tokens_per_s"] > 0 for r in sections["decode"]["batches"])
    for kind in ("full", "lora"):
        r = sections["grpo"][kind]
        assert r["games_per_s"] > 0 and r["rollout_s"] > 0 and r["peak_bytes"] is None
    assert sections["grpo"]["lora"]["lora_rank"] == 8
    assert sections["correctness"]["equal"] is True
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("| section | figure | value |") and "greedy tokens device == CPU | True" in table


def test_bandwidth_table_knows_the_h200():
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_check import bandwidth

    assert bandwidth("NVIDIA H200") == 4.8e12 and bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bandwidth("cpu") is None
