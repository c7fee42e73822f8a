"""LoRA (`models.lora`, the `[lora]` table): a fresh adapter is the base; only adapters get gradients and
optimizer state; a tiny model learns a target through adapters alone; `jaxrl-llm export` merges them with
the adapted model's logits; a LoRA run killed with SIGKILL resumes to the uninterrupted run's metrics;
bad settings are named errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algos import sft
from jaxrl_llm.algos.grpo import GrpoConfig, grpo_update_step
from jaxrl_llm.algos.optim import OptimConfig, make_optimizer
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.config import load_config
from jaxrl_llm.metrics import read_metrics
from models import lora
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache, init_params

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
SMALL = ["model.num_hidden_layers=2", 'model.layer_types=["conv", "full_attention"]', "eval.num_games=4"]
CFG = PRESETS["tiny"]  # both layer kinds, GQA: every target exists


@pytest.fixture(scope="module")
def base():
    return init_params(CFG, jax.random.PRNGKey(0))


def _noisy(adapters, key, std=0.3):
    """The adapters with every A and B moved off its initial value (so B != 0)."""
    leaves, tree = jax.tree_util.tree_flatten(adapters)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(tree, [x + std * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _apply(module, params, *args):
    """module.apply, jitted (module static)."""
    return _jitted_apply(module, params, *args)


_jitted_apply = jax.jit(lambda module, params, *args: module.apply({"params": params}, *args), static_argnums=0)


def _tree_equal(a, b) -> bool:
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                                     jax.tree_util.tree_leaves(b)))


# ---- the adapted model ----


def test_fresh_adapters_equal_the_base_in_every_path(base):
    config = lora.LoraConfig(rank=4, alpha=8.0)
    adapters = lora.init_adapters(config, base, jax.random.PRNGKey(1))
    # one adapter per targeted projection: tiny has 2 conv and 2 attention layers, each with an MLP
    assert len(lora.flat_adapters(adapters)) == 2 * 2 + 2 * 4 + 4 * 3
    for path, ab in lora.flat_adapters(adapters).items():
        kernel = lora._get(base, path)["kernel"]
        assert ab["lora_a"].shape == (kernel.shape[0], 4) and ab["lora_b"].shape == (4, kernel.shape[1])
        assert not np.any(np.asarray(ab["lora_b"])) and np.any(np.asarray(ab["lora_a"]))
    plain, adapted = Lfm2ForCausalLM(CFG), lora.LoraModel(Lfm2ForCausalLM(CFG), config)
    joined = lora.join(base, adapters)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 7), 0, CFG.vocab_size)
    # Equal up to float rounding: XLA may fuse the exact-zero B term differently (seen: 9e-8 on one CI run).
    np.testing.assert_allclose(_apply(adapted, joined, tokens)[0], _apply(plain, base, tokens)[0], rtol=0, atol=1e-6)
    # the cached path: a ragged prefill, then one decode step
    num_valid = jnp.array([7, 5], jnp.int32)
    outs = []
    for module, params in ((plain, base), (adapted, joined)):
        logits, cache = _apply(module, params, tokens, init_cache(CFG, 2, 16), num_valid)
        step, _ = _apply(module, params, tokens[:, :1], cache)
        outs.append((logits, step))
    for got, want in zip(outs[1], outs[0]):  # (jit may fuse the exact-zero term differently: 1 ulp)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # and moved adapters do change the logits (they are applied at all)
    moved = _apply(adapted, lora.join(base, _noisy(adapters, jax.random.PRNGKey(3))), tokens)[0]
    assert float(jnp.abs(moved - _apply(plain, base, tokens)[0]).max()) > 1e-3


def test_adapters_are_added_to_exactly_the_targeted_projections(base):
    """Independent check of the adapted output: the merged kernels, written out by hand in numpy."""
    config = lora.LoraConfig(rank=2, alpha=3.0, targets=("o_proj", "conv_in", "w2"))
    adapters = _noisy(lora.init_adapters(config, base, jax.random.PRNGKey(4)), jax.random.PRNGKey(5))
    assert sorted({p[1:] for p in lora.flat_adapters(adapters)}) == [
        ("conv", "in_proj"), ("feed_forward", "w2"), ("self_attn", "out_proj")]
    by_hand = jax.tree_util.tree_map(np.asarray, base)
    for path, ab in lora.flat_adapters(adapters).items():
        node = lora._get(by_hand, path)
        node["kernel"] = node["kernel"] + 1.5 * np.asarray(ab["lora_a"]) @ np.asarray(ab["lora_b"])
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 6), 0, CFG.vocab_size)
    adapted = _apply(lora.LoraModel(Lfm2ForCausalLM(CFG), config), lora.join(base, adapters), tokens)[0]
    expected = _apply(Lfm2ForCausalLM(CFG), by_hand, tokens)[0]
    np.testing.assert_allclose(adapted, expected, rtol=1e-5, atol=1e-5)


def test_dropout_only_with_a_key_and_the_same_masks_for_the_same_key(base):
    config = lora.LoraConfig(rank=4, dropout=0.5)
    adapters = _noisy(lora.init_adapters(config, base, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    module = lora.LoraModel(Lfm2ForCausalLM(CFG), config)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 6), 0, CFG.vocab_size)

    def run(key):
        return np.asarray(_apply(module, lora.join(base, adapters, key), tokens)[0])

    no_key = run(None)
    a, b, c = run(jax.random.PRNGKey(7)), run(jax.random.PRNGKey(7)), run(jax.random.PRNGKey(8))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - no_key).max() > 1e-4 and np.abs(a - c).max() > 1e-4


# ---- training: only the adapters ----


def test_gradients_reach_only_the_adapters(base):
    """SFT step: the first step changes B only (dL/dA = 0 while B = 0), the next one A too; the optimizer
    state is the adapters' size; GRPO: the update returns adapters, the base is never written, and the
    reference (the base with adapters off) equals a fresh policy (KL 0)."""
    config = lora.LoraConfig(rank=4)
    module = lora.LoraModel(Lfm2ForCausalLM(CFG), config)
    adapters = lora.init_adapters(config, base, jax.random.PRNGKey(1))
    base_copy = jax.tree_util.tree_map(np.array, base)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, total_steps=4))
    opt_state = optimizer.init(adapters)
    n_adapter = sum(x.size for x in jax.tree_util.tree_leaves(adapters))
    assert sum(x.size for x in jax.tree_util.tree_leaves(opt_state)) - 2 * n_adapter in range(1, 8)  # Adam mu, nu; counts and the injected hyper-parameters (scalars)
    step = sft.make_sft_step(module, optimizer)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, CFG.vocab_size)
    mask = jnp.ones((2, 12), jnp.float32)
    start = jax.tree_util.tree_map(np.array, adapters)
    one, opt_state, _ = step(adapters, opt_state, tokens, mask, base, None)
    for path, ab in lora.flat_adapters(one).items():
        np.testing.assert_array_equal(ab["lora_a"], lora._get(start, path)["lora_a"])
        assert np.abs(np.asarray(ab["lora_b"])).max() > 0
    two, _, _ = step(jax.tree_util.tree_map(jnp.array, one), opt_state, tokens, mask, base, None)
    assert all(np.abs(np.asarray(ab["lora_a"]) - lora._get(start, p)["lora_a"]).max() > 0
               for p, ab in lora.flat_adapters(two).items())
    assert _tree_equal(base, base_copy)

    gcfg = GrpoConfig(beta=0.1, num_minibatches=1)
    grpo_opt = make_optimizer(OptimConfig(learning_rate=1e-3, total_steps=1))
    fresh = lora.init_adapters(config, base, jax.random.PRNGKey(1))
    update = jax.jit(lambda p, o, ref, t, m, lp, r, k, f: grpo_update_step(module, grpo_opt, gcfg, p, o, ref, t, m, lp,
                                                                           r, k, frozen=f, group_size=2,
                                                                           temperature=1.0))
    rows = jax.random.randint(jax.random.PRNGKey(3), (4, 10), 0, CFG.vocab_size)
    loss_mask = jnp.zeros((4, 10)).at[:, 5:].set(1.0)
    sampler = jnp.full((4, 10), -6.0)
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
    new, new_opt, metrics = update(fresh, grpo_opt.init(fresh), base, rows, loss_mask, sampler, rewards,
                                   jax.random.PRNGKey(4), base)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(fresh)
    assert sum(x.size for x in jax.tree_util.tree_leaves(new_opt)) - 2 * n_adapter in range(1, 8)
    assert float(metrics["kl"]) == 0.0 and float(metrics["grad_norm"]) > 0
    assert any(np.abs(np.asarray(ab["lora_b"])).max() > 0 for ab in lora.flat_adapters(new).values())
    assert _tree_equal(base, base_copy)


def test_a_tiny_model_learns_a_target_through_its_adapters_alone(base):
    """A random base predicts four random 16-token rows at chance; rank-8 adapters (every projection, the
    embedding and norms frozen) make greedy teacher-forced prediction exact."""
    config = lora.LoraConfig(rank=8, alpha=16.0)
    module = lora.LoraModel(Lfm2ForCausalLM(CFG), config)
    adapters = lora.init_adapters(config, base, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 16), 0, CFG.vocab_size)
    mask = jnp.ones((4, 16), jnp.float32)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, schedule="constant", total_steps=40))
    opt_state = optimizer.init(adapters)
    step = sft.make_sft_step(module, optimizer)
    history = []
    for _ in range(40):
        adapters, opt_state, metrics = step(adapters, opt_state, tokens, mask, base, None)
        history.append({k: float(v) for k, v in metrics.items()})
    assert history[0]["accuracy"] < 0.1
    assert history[-1]["accuracy"] == 1.0 and history[-1]["loss"] < history[0]["loss"]
    check = sft.teacher_forced_check(module, lora.join(base, adapters),
                                     {"tokens": np.asarray(tokens), "loss_mask": np.asarray(mask)})
    assert check["exact"] == 1.0
    assert sft.teacher_forced_check(module, base, {"tokens": np.asarray(tokens),
                                                   "loss_mask": np.asarray(mask)})["exact"] == 0.0


# ---- checkpoints and export ----


def test_export_merges_the_adapters_with_the_adapted_logits(tmp_path, capsys):
    from jaxrl_llm import train
    from jaxrl_llm.checkpoint import Checkpointer
    from jaxrl_llm.cli import main
    from jaxrl_llm.compat import run_checkpointer
    from models.hf import load_hf

    overrides = [f'run.output_dir="{tmp_path / "run"}"', *SMALL, "lora.rank=4", "lora.alpha=4.0"]
    config = load_config(PRESET, overrides)
    comp = train.build(config)
    adapters = _noisy(train.initial_policy(comp), jax.random.PRNGKey(9), std=0.2)
    with run_checkpointer(train.sft_dir(config), keep=1, async_save=False) as ckpt:  # as `run_sft` leaves it
        ckpt.save(2, {"params": adapters}, config=config)
    saved = Checkpointer(train.sft_dir(config), read_only=True)
    assert {k.split("/")[0] for k in saved._stored_leaves(2)[1]} == {"params"}  # adapters only
    assert all("lora_" in k for k in saved._stored_leaves(2)[1])
    saved.close()
    out = tmp_path / "hf"
    args = ["export", str(PRESET), "--out", str(out)] + sum((["--set", s] for s in overrides), [])
    assert main(args) == 0, capsys.readouterr().err
    exported = load_hf(out)
    tokens = jax.random.randint(jax.random.PRNGKey(10), (2, 9), 0, comp.model_config.vocab_size)
    adapted = _apply(comp.module, lora.join(train.base_params(comp), adapters), tokens)[0]
    plain = _apply(comp.module, train.base_params(comp), tokens)[0]
    np.testing.assert_allclose(exported(tokens), adapted, rtol=1e-5, atol=2e-5)
    assert float(jnp.abs(adapted - plain).max()) > 1e-2  # the export is not simply the base
    # a checkpoint of adapters is refused by a config without LoRA (and the other way round), naming it
    full = load_config(PRESET, overrides[:-2])
    with pytest.raises(ValueError, match="LoRA rank = 4.*no LoRA"):
        train.policy_params(full, train.build(full), str(train.sft_dir(config)))


RESUME = ["lora.rank=4", "lora.dropout=0.1", "grpo.0.steps=4", "grpo.0.loss.beta=0.05", "grpo.0.rollout.max_turns=2",
          "grpo.0.sampling.max_new_tokens=8", "grpo.1.steps=0", "checkpoint.every_steps=1"]
VOLATILE = {"time", "step_time", "games_per_s", "tokens_per_s", "sampled_tokens_per_s"}


def test_sigkill_then_resume_with_lora_gives_the_uninterrupted_metrics(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the suite's compilation cache (conftest.py), kept between runs

    def train(out: Path, kill: str | None = None):  # killed: the loop with tests/kill_at.py's hook; else the CLI
        command = [str(ROOT / "tests" / "kill_at.py"), kill] if kill else ["-m", "jaxrl_llm.cli"]
        cmd = [sys.executable, *command, "train", str(PRESET)]
        for item in [f'run.output_dir="{out}"', *SMALL, *RESUME]:
            cmd += ["--set", item]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)

    ref = train(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = train(tmp_path / "killed", kill="grpo_step@3")  # step 3 computed, not yet written: SIGKILL
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert len(read_metrics(tmp_path / "killed" / "metrics.jsonl")) == 2
    again = train(tmp_path / "killed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 2/4" in again.stdout, again.stdout[-2000:]

    def stable(folder):
        return [{k: v for k, v in r.items() if k not in VOLATILE} for r in read_metrics(folder / "metrics.jsonl")]

    reference = stable(tmp_path / "ref")
    assert len(reference) == 4 and stable(tmp_path / "killed") == reference  # bitwise, step for step
    assert reference[0]["kl"] == 0.0  # the first update's policy is the base: the reference, adapters off
    from jaxrl_llm.checkpoint import Checkpointer

    with Checkpointer(tmp_path / "killed" / "checkpoints", read_only=True) as ckpt:
        leaves = ckpt._stored_leaves(4)[1]
    params = [k for k in leaves if k.startswith("params/")]
    assert params and all(k.endswith(("lora_a", "lora_b")) for k in params)  # the base is never saved


# ---- settings ----


@pytest.mark.parametrize("override,key,message", [
    ("lora.rank=-1", "lora.rank", ">= 0"),
    ("lora.rank=1.5", "lora.rank", "integer"),
    ("lora.alpha=0", "lora.alpha", "> 0"),
    ("lora.dropout=-0.1", "lora.dropout", r"\[0, 1\)"),
    ("lora.dropout=1.0", "lora.dropout", r"\[0, 1\)"),
    ('lora.targets=["q_prj"]', "lora.targets.0", "did you mean 'q_proj'"),
    ("lora.targets=[]", "lora.targets", "at least one"),
    ('lora.targets="all"', "lora.targets", "array"),
    ("lora.rnak=4", "lora.rnak", "did you mean 'rank'"),
])
def test_bad_settings_are_named_errors(override, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(PRESET, [override])
    assert info.value.key == key


def test_targets_the_model_lacks_are_a_named_error_at_build(tmp_path):
    from jaxrl_llm import train

    only_attention = [f'run.output_dir="{tmp_path}"', "model.num_hidden_layers=1", 'model.layer_types=["full_attention"]']
    with pytest.raises(ConfigError, match="conv_in.*match no layer") as info:
        train.build(load_config(PRESET, [*only_attention, "lora.rank=2", 'lora.targets=["q_proj", "conv_in"]']))
    assert info.value.key == "lora.targets"
    comp = train.build(load_config(PRESET, [*only_attention, "lora.rank=2"]))  # a group may match in part
    assert {p[1] for p in lora.flat_adapters(train.initial_policy(comp))} == {"self_attn", "feed_forward"}
    assert train.build(load_config(PRESET, [f'run.output_dir="{tmp_path}"'])).lora is None  # off by default
    assert dataclasses.replace(lora.LoraConfig(), rank=8).scale == 2.0
