"""The experiment driver end to end on a tiny config: SFT -> GRPO stages -> eval; the same GRPO step on 8
CPU devices and on one. (Exact resume after SIGKILL at five points of a run: tests/test_fault_runs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.metrics import plot_metrics, read_metrics

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
# A 2-layer model (one conv, one attention) and short games: compiles fast, still every code path.
SMALL = [
    "model.num_hidden_layers=2",
    'model.layer_types=["conv", "full_attention"]',
    "eval.num_games=4",
]


def _overrides(out: Path, *more: str) -> list[str]:
    return [f'run.output_dir="{out}"', *SMALL, *more]


def test_sft_then_grpo_stages_then_eval(tmp_path):
    from jaxrl_llm import train

    config = load_config(PRESET, _overrides(tmp_path, "run.sample_every=2", "eval.every_steps=3"))
    comp = train.build(config)
    train.run_sft(config, comp, log=lambda *a: None)
    assert (tmp_path / "sft").is_dir() and len(read_metrics(tmp_path / "sft_metrics.jsonl")) == config.sft.steps
    result = train.train_grpo(config, comp, log=lambda *a: None)
    total = sum(s.steps for s in config.grpo)
    assert result["step"] == total
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["stage"] for r in rows] == [0] * config.grpo[0].steps + [1] * config.grpo[1].steps
    for key in ("reward_mean", "win_rate", "draw_rate", "loss_rate", "format_rate", "invalid_rate", "kl",
                "grad_norm", "learning_rate", "step_time", "games_per_s", "tokens_per_s", "reply_length",
                "truncation_rate", "entropy"):
        assert key in rows[0] and np.isfinite(rows[0][key]), key
    assert (tmp_path / "samples" / "step_000002.jsonl").is_file()
    assert "<|im_start|>assistant" in (tmp_path / "samples" / "step_000002.txt").read_text()
    evals = read_metrics(tmp_path / "eval_metrics.jsonl")
    assert [r["step"] for r in evals] == [3] and "optimal_draw" in evals[0]
    results = train.evaluate(comp, result["params"], games_path=tmp_path / "eval.jsonl")
    assert set(results) == {"random", "optimal"}
    for r in results.values():
        assert r["games"] == 4 and abs(r["win"] + r["draw"] + r["loss"] + r["unfinished"] - 1) < 1e-6
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 8
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl_llm import train
    from jaxrl_llm.config import load_config
    assert jax.device_count() == 8
    config = load_config(PRESET, OVERRIDES)
    comp = train.build(config)
    mesh = train.make_mesh(config)
    assert mesh.shape == {"data": 4, "fsdp": 2}, mesh.shape
    key = jax.random.PRNGKey(3)
    params = train.fresh_params(comp, key)

    def one_step(mesh):
        step, optimizer = train.make_grpo_step(comp, 0, mesh)
        p = train.shard_params(comp, jax.tree_util.tree_map(jnp.copy, params), mesh)
        new, _, metrics, traj = step(p, optimizer.init(p), None, key)
        return jax.device_get(new), jax.device_get(metrics), jax.device_get(traj.tokens)

    single = one_step(None)
    sharded = one_step(mesh)
    np.testing.assert_array_equal(sharded[2], single[2])  # the same games
    np.testing.assert_allclose(sharded[1]["loss"], single[1]["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(sharded[0]), jax.tree_util.tree_leaves(single[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("SHARDED-OK", float(single[1]["loss"]))
    """
)


def test_grpo_step_on_8_devices_equals_one_device(tmp_path):
    overrides = _overrides(tmp_path, "mesh.fsdp=2", "grpo.0.num_prompts=4", "grpo.0.group_size=2",
                           "grpo.0.rollout.max_turns=2", "grpo.0.sampling.max_new_tokens=8")
    code = f"PRESET = {str(PRESET)!r}\nOVERRIDES = {overrides!r}\n" + SHARDED
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert "SHARDED-OK" in result.stdout, result.stderr[-4000:]


def test_cli_reports_config_errors_before_compiling(capsys):
    from jaxrl_llm.cli import main

    assert main(["train", str(PRESET), "--set", "grpo.0.sampling.temprature=1.0"]) == 2
    err = capsys.readouterr().err
    assert "temprature" in err and "temperature" in err
    assert main(["train", str(PRESET), "--set", "grpo.0.temperature=1.0"]) == 2  # the key is one table deeper
    assert "sampling.temperature" in capsys.readouterr().err
    assert main(["eval", "no/such/preset.toml"]) == 2


def test_play_against_a_scripted_person(tmp_path, monkeypatch):
    from jaxrl_llm.cli.play import play_terminal

    config = load_config(PRESET, _overrides(tmp_path, "sampling.max_new_tokens=8", "eval.rollout.max_turns=3"))
    answers = iter(["y", "4", "0", "8", "2", "6", "1", "3", "5", "7"])
    lines = []
    assert play_terminal(config, input_fn=lambda prompt: next(answers), print_fn=lines.append) == 0
    text = "\n".join(lines)
    assert "model:" in text and ("unfinished" in text or "wins" in text or "draw" in text or "fits" in text)


def test_an_exported_folder_serves_as_checkpoint_for_eval_and_play(tmp_path, capsys):
    import jax

    from jaxrl_llm import train
    from jaxrl_llm.cli import main
    from models.hf import save_hf

    config = load_config(PRESET, _overrides(tmp_path))
    comp = train.build(config)
    params = train.fresh_params(comp, jax.random.PRNGKey(3))
    folder = save_hf(comp.model_config, params, tmp_path / "hf")
    loaded = train.policy_params(config, comp, str(folder))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                                         loaded, params))
    assert main(["eval", str(PRESET), "--checkpoint", str(folder), *sum((["--set", s] for s in _overrides(tmp_path)), [])]) == 0
    assert "Hugging Face folder" in capsys.readouterr().out
    other = load_config(PRESET, _overrides(tmp_path, "model.hidden_size=64"))
    with pytest.raises(ValueError, match="use the preset it was trained with"):
        train.policy_params(other, train.build(other), str(folder))
