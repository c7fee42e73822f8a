"""RLOO, the second algorithm (issue 29): REINFORCE with a leave-one-out baseline, selected by
`[grpo.loss] estimator = "rloo"` and run by the same generic update (`algos.update`) as GRPO.

The leave-one-out advantage against a plain-Python computation on hand-made rewards; a bad estimator name,
and "rloo" with the per-turn-only advantage, are config errors naming the key; with "mix" the episode part is
RLOO's; and the CPU preset (`experiments/presets/cpu.toml`, made smaller, constrained replies so that a fresh
model's games differ) trains a few steps with it: the loss is finite, the logged advantages are RLOO's and
the params move.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import train
from jaxrl_llm.algos.advantages import token_advantages
from jaxrl_llm.algos.grpo import GrpoConfig, episode_advantages, group_advantages, rloo_advantages
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.config import load_config
from jaxrl_llm.train.components import fresh_params
from jaxrl_llm.train.grpo_loop import placed_like_outputs

PRESET = Path(__file__).resolve().parents[1] / "experiments" / "presets" / "cpu.toml"


def ref_rloo(rewards: list[float], group_size: int) -> list[float]:
    """Independent: each reward minus the mean of the OTHER rewards of its group, in plain Python."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            out.append(r - sum(others) / len(others))
    return out


@pytest.mark.parametrize("group_size, rewards", [
    (2, [1.0, 0.0, 0.5, 0.5, -0.1, 0.9]),
    (4, [1.0, 0.0, 0.0, 0.0, 0.2, 0.7, 0.7, 1.0]),
    (3, [0.3, 0.3, 0.3, 1.0, 0.5, -0.1]),
])
def test_rloo_advantages_equal_the_python_reference(group_size, rewards):
    got = np.asarray(rloo_advantages(jnp.asarray(rewards, jnp.float32), group_size))
    np.testing.assert_allclose(got, ref_rloo(rewards, group_size), rtol=1e-6, atol=1e-7)
    # The same as G / (G - 1) times the mean-centred rewards (GRPO's advantage with scale "none").
    scaled = group_size / (group_size - 1) * np.asarray(group_advantages(jnp.asarray(rewards), group_size, "none"))
    np.testing.assert_allclose(got, scaled, rtol=1e-5, atol=1e-6)


def test_rloo_of_equal_rewards_is_exactly_zero_and_ignores_the_std_settings():
    rewards = jnp.array([0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3], jnp.float32)  # 0.1: no exact float mean
    assert np.all(np.asarray(rloo_advantages(rewards, 4)) == 0.0)
    spread = jnp.array([1.0, 0.0, 0.0, 0.0])
    for scale in ("group", "none"):
        config = GrpoConfig(estimator="rloo", scale_rewards=scale, std_eps=0.5)
        np.testing.assert_allclose(np.asarray(episode_advantages(config, spread, 4)), [1.0, -1 / 3, -1 / 3, -1 / 3],
                                   rtol=1e-6)
    grpo = GrpoConfig()  # the default estimator is GRPO's, unchanged
    np.testing.assert_array_equal(np.asarray(episode_advantages(grpo, spread, 4)),
                                  np.asarray(group_advantages(spread, 4)))


def test_bad_estimator_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"estimator.*'grpo', 'rloo'.*did you mean 'rloo'"):
        GrpoConfig(estimator="rlo")
    with pytest.raises(ConfigError, match=r"grpo\.0\.loss\.estimator.*'grpo', 'rloo'"):
        load_config(PRESET, ['grpo.0.loss.estimator="ppo"'])
    with pytest.raises(ConfigError, match=r"estimator.*advantage 'step'"):
        GrpoConfig(estimator="rloo", advantage="step")


def test_mix_takes_rloo_as_its_episode_part():
    """advantage "mix": the step part is GiGPO's either way, so the difference of the two estimators is
    episode_weight * (RLOO - GRPO) on every token."""
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 3, 8).astype(np.float32) / 2
    turn_rewards = np.where(rng.random((8, 3)) < 0.3, -0.1, 0.0).astype(np.float32)
    keys = rng.integers(0, 3, (8, 3)).astype(np.uint32)
    played = np.ones((8, 3), bool)
    token_turn = np.tile(np.array([-1, 0, 0, 1, -1, 2], np.int32), (8, 1))
    args = (rewards, turn_rewards, keys, played, token_turn, 4)
    mix = dict(advantage="mix", episode_weight=0.7, step_weight=1.5)
    got = np.asarray(token_advantages(GrpoConfig(estimator="rloo", **mix), *args))
    base = np.asarray(token_advantages(GrpoConfig(**mix), *args))
    diff = 0.7 * (np.array(ref_rloo(rewards.tolist(), 4)) - np.asarray(group_advantages(rewards, 4)))
    np.testing.assert_allclose(got - base, np.broadcast_to(diff[:, None], got.shape), rtol=1e-5, atol=1e-5)
    episode = np.asarray(token_advantages(GrpoConfig(estimator="rloo"), *args))
    np.testing.assert_allclose(episode, np.broadcast_to(np.array(ref_rloo(rewards.tolist(), 4))[:, None], episode.shape),
                               rtol=1e-6, atol=1e-6)


SMALLER = [  # the CPU preset's first stage, on a 2-layer model and a batch of 8 games
    "model.num_hidden_layers=2",
    'model.layer_types=["conv", "full_attention"]',
    "grpo.0.num_prompts=2",
    "grpo.0.group_size=4",
    "grpo.0.loss.num_minibatches=1",
    "grpo.0.sampling.constrained=true",  # every reply a cell: a fresh model's games differ in reward
    "grpo.0.optim.learning_rate=1e-3",
    "grpo.0.optim.warmup_steps=0",
]


def test_rloo_trains_the_cpu_preset_for_a_few_steps(tmp_path):
    config = load_config(PRESET, [f'run.output_dir="{tmp_path}"', 'grpo.0.loss.estimator="rloo"', *SMALLER])
    assert config.grpo[0].grpo_config().estimator == "rloo"
    comp = train.build(config)
    params = fresh_params(comp, jax.random.PRNGKey(0))
    step, optimizer = train.make_grpo_step(comp, 0)
    p = placed_like_outputs(jax.tree_util.tree_map(jnp.copy, params))
    o = placed_like_outputs(optimizer.init(p))
    taken = 0.0
    for s in range(3):
        p, o, m, traj = step(p, o, None, jax.random.PRNGKey(100 + s))
        m = jax.device_get(m)
        assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
        want = np.array(ref_rloo(np.asarray(traj.reward).tolist(), 4))
        assert float(m["advantage_min"]) == pytest.approx(want.min(), abs=1e-5)
        assert float(m["advantage_max"]) == pytest.approx(want.max(), abs=1e-5)
        taken += float(m["optimizer_steps"])
    assert taken > 0  # some group had a spread of rewards
    moved = sum(float(jnp.sum(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(p),
                                                                jax.tree_util.tree_leaves(params)))
    assert moved > 0
