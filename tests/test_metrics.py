"""Metrics: JSONL writer with resume, progress display, plots, results table."""

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.metrics import MetricsWriter, Progress, format_results_table, plot_metrics, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_writer_converts_and_flushes(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    writer = MetricsWriter(path)
    row = writer.write(np.int64(1), {"reward_mean": jnp.float32(0.25), "win_rate": np.float64(0.5),
                                     "hist": jnp.arange(3), "ok": np.bool_(True)}, stage=0)
    # flushed: readable before close
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data == row
    assert data["step"] == 1 and data["reward_mean"] == 0.25 and data["hist"] == [0, 1, 2]
    assert data["ok"] is True and data["stage"] == 0 and "time" in data
    writer.write(2, loss=float("nan"))
    writer.close()
    assert np.isnan(read_metrics(path)[1]["loss"])
    with pytest.raises(ValueError, match="closed"):
        writer.write(3, {})


def test_writer_resume_drops_later_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        for step in range(1, 6):
            writer.write(step, {"reward_mean": step / 10})
    with path.open("a") as f:
        f.write('{"step": 6, "rew')  # a line cut by a crash
    with MetricsWriter(path, resume_step=3) as writer:
        writer.write(4, {"reward_mean": 0.99})
    steps = [r["step"] for r in read_metrics(path)]
    assert steps == [1, 2, 3, 4]
    assert read_metrics(path)[-1]["reward_mean"] == 0.99
    with MetricsWriter(path):  # no resume: a new log
        pass
    assert read_metrics(path) == []


def test_progress_plain_lines():
    out = io.StringIO()  # not a TTY: plain lines
    with Progress(10, "grpo", keys=["reward_mean", "win_rate", "games_per_s"], every=5, file=out) as bar:
        assert bar.plain
        for step in range(10):
            bar.update(1, reward_mean=jnp.float32(0.1 * step), win_rate=0.5, games_per_s=1234.5, other=1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # at 5 and at 10 (close prints nothing new)
    assert lines[0].startswith("grpo 5/10 (50%)")
    assert "reward_mean 0.4" in lines[0] and "win_rate 0.5" in lines[0] and "games_per_s 1.23e+03" not in lines[0]
    assert "games_per_s 1234" in lines[0] or "games_per_s 1235" in lines[0]
    assert lines[1].startswith("grpo 10/10 (100%)") and "other" not in lines[1]


def test_progress_rich_runs():
    out = io.StringIO()
    bar = Progress(3, "sft", keys=["loss"], file=out, plain=False)
    assert not bar.plain
    for _ in range(3):
        bar.update(1, loss=0.5)
    bar.close()
    assert "sft" in out.getvalue()


def _write_run(path, n, offset=0.0, stage=0):
    with MetricsWriter(path) as writer:
        for step in range(n):
            writer.write(step, {"reward_mean": offset + step / n, "win_rate": 0.5, "draw_rate": 0.3,
                                "loss_rate": 0.2, "kl": 0.01 * step, "grad_norm": 1.0, "lr": 1e-4}, stage=stage)


def test_plot_metrics_writes_a_png(tmp_path):
    from matplotlib.image import imread

    _write_run(tmp_path / "runs" / "stage1.jsonl", 12)
    _write_run(tmp_path / "runs" / "stage2.jsonl", 8, offset=0.5, stage=1)
    out = plot_metrics(tmp_path / "runs", tmp_path / "plots" / "curves.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    few = plot_metrics([tmp_path / "runs" / "stage1.jsonl"], tmp_path / "few.png", keys=["reward_mean", "kl"])
    assert few.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(few).shape[1] < image.shape[1]  # 2 subplots side by side vs 3 columns
    with pytest.raises(FileNotFoundError):
        plot_metrics(tmp_path / "nothing", tmp_path / "x.png")


def test_results_table_matches_the_spec_format():
    rows = [
        {"model": "LFM2-2.6B, base", "win": 0.40, "draw": 0.11, "loss": 0.49, "format": 0.278, "invalid": 0.40},
        {"model": "after SFT", "win_rate": np.float32(0.74), "draw_rate": 0.13, "loss_rate": 0.13,
         "format_rate": 0.998, "invalid_rate": 0.11},
    ]
    columns = (("W", "win"), ("D", "draw"), ("L", "loss"), ("format", "format"), ("invalid", "invalid"))
    table = format_results_table(rows, columns, title="vs random opponent")
    assert table.splitlines() == [
        "| vs random opponent | W | D | L | format | invalid |",
        "|---|---|---|---|---|---|",
        "| LFM2-2.6B, base | 40 | 11 | 49 | 27.8 | 40 |",
        "| after SFT | 74 | 13 | 13 | 99.8 | 11 |",
    ]
    pct = format_results_table([{"model": "m", "win": 90, "draw": 9, "loss": 1, "format": 100}], columns,
                               fractions=False)
    assert pct.splitlines()[0] == "| model | W | D | L | format | invalid |"
    assert pct.splitlines()[2] == "| m | 90 | 9 | 1 | 100 | - |"
