"""TensorBoard / W&B logs (issue 16): a tiny run with `run.log = ["jsonl", "tensorboard"]`; the event file,
read back with an independent TFRecord reader, holds every scalar of metrics.jsonl, sft_metrics.jsonl and
eval_metrics.jsonl at its step, and the sample games as text."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.log_sinks import open_sinks, scalars
from jaxrl_llm.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"


def read_events(folder: Path) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], str]]:
    """{(tag, step): value} and {(tag, step): text} of every event file under `folder` (TFRecord framing:
    u64 length, u32 crc, the Event proto, u32 crc)."""
    from tensorboardX.proto import event_pb2

    values, texts = {}, {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    values[(v.tag, event.step)] = v.simple_value
                elif v.HasField("tensor") and v.tensor.string_val:
                    texts[(v.tag, event.step)] = b"".join(v.tensor.string_val).decode()
    return values, texts


def test_every_metric_and_the_samples_reach_tensorboard(tmp_path):
    from jaxrl_llm import train

    config = load_config(PRESET, [f'run.output_dir="{tmp_path}"', "model.num_hidden_layers=2",
                                  'model.layer_types=["conv", "full_attention"]', "eval.num_games=2",
                                  "grpo.0.steps=2", "grpo.1.steps=0", "run.sample_every=1", "eval.every_steps=2",
                                  'run.log=["jsonl", "tensorboard"]'])
    comp = train.build(config)
    train.run_sft(config, comp, log=lambda *a: None)
    train.train_grpo(config, comp, log=lambda *a: None)
    values, texts = read_events(tmp_path / "tensorboard")
    checked = 0
    for group, name in (("sft", "sft_metrics.jsonl"), ("grpo", "metrics.jsonl"), ("eval", "eval_metrics.jsonl")):
        rows = read_metrics(tmp_path / name)
        assert rows, name
        for row in rows:
            for key, value in scalars(row).items():
                got = values[(f"{group}/{key}", row["step"])]
                np.testing.assert_allclose(got, np.float32(value), rtol=1e-6, err_msg=f"{group}/{key}")
                checked += 1
    assert checked > 50
    assert len(values) == checked  # nothing else, nothing twice
    sample = texts[("samples/text_summary", 2)]
    assert sample == (tmp_path / "samples" / "step_000002.txt").read_text(encoding="utf-8")
    assert "<|im_start|>assistant" in sample


def test_scalars_leave_out_what_is_not_a_finite_number():
    assert scalars({"step": 3, "time": 1.0, "a": 1, "b": 2.5, "c": float("nan"), "d": "x", "e": True}) == \
        {"a": 1.0, "b": 2.5}


def test_unknown_sinks_are_named_and_wandb_without_the_package_says_so(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"run\.log\.1: unknown log 'tensorbord'"):
        load_config(PRESET, ['run.log=["jsonl", "tensorbord"]'])
    with pytest.raises(ConfigError, match=r"run\.log"):
        load_config(PRESET, ['run.log="tensorboard"'])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    lines = []
    assert open_sinks(("jsonl", "wandb"), tmp_path, lines.append) == []
    assert lines == ["wandb is not installed (pip install wandb): logging to jsonl only"]
