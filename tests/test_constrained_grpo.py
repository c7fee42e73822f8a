"""GRPO trains on constrained replies (issue 30, part 5): the update recomputes a content token's log-prob
over the set it was sampled from, as the sampler records it.

On a constrained rollout of a tiny random model (the one-turn bandit of `tests/bandit_env.py`, a cell of four),
the update's policy log-probs (before any optimizer step) equal the trajectory's sampler log-probs token by token
with the restriction, and differ without it; the reference's log-probs (the KL) and the decision metrics are
checked against an independent full forward restricted by hand. Then one `train.make_grpo_step` of a stage with
`constrained = true` runs, every reply parses and the params move.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import envs
from jaxrl_llm import train
from jaxrl_llm.algos.grpo import make_grpo_update
from jaxrl_llm.config import loads_config
from jaxrl_llm.rollout import make_rollout
from jaxrl_llm.train.components import fresh_params, fresh_start_warning
from jaxrl_llm.train.grpo_loop import decision_inputs, placed_like_outputs

from bandit_env import MODEL_AND_ENV_TOML  # noqa: E402  (tests/ is on sys.path)

envs.register("bandit", "bandit_env:Bandit", overwrite=True)

CONFIG = MODEL_AND_ENV_TOML + """

[[grpo]]
steps = 1
num_prompts = 4
group_size = 4

[grpo.sampling]
temperature = 0.7
constrained = true

[grpo.loss]
length_buckets = 2

[grpo.optim]
learning_rate = 3e-3
"""
TOL = 1e-4  # ratio 1 to TOL, token by token


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = loads_config(CONFIG, [f'run.output_dir="{tmp_path_factory.mktemp("run")}"'])
    comp = train.build(config)
    params = fresh_params(comp, jax.random.PRNGKey(0))
    stage = config.grpo[0]
    run = make_rollout(comp.env, comp.model_fn, comp.init_cache, comp.tables, stage.rollout,
                       comp.sampling_config(stage.sampling))
    examples = comp.env.sample_examples(jax.random.PRNGKey(1), stage.num_prompts, stage.group_size, stage.curriculum)
    traj = run(params, examples, jax.random.PRNGKey(2))
    return config, comp, params, traj


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def _restricted_stats(comp, params, traj, temperature):
    """Independent: the full logits, -inf outside each content token's set (by hand, from the sets), the
    temperature, log-softmax -> (log-prob of each token, entropy), float32[B, L] each (position 0: 0)."""
    logits = comp.module.apply({"params": params}, traj.tokens)[0][:, :-1].astype(jnp.float32)
    sets = np.asarray(comp.tables.reply_template.sets, bool)[:, : logits.shape[-1]]
    sets = jnp.asarray(np.pad(sets, ((0, 0), (0, logits.shape[-1] - sets.shape[1]))))  # tokens past the tokenizer's
    cs = jnp.asarray(traj.choice_set[:, 1:], jnp.int32)
    allowed = jnp.where((cs >= 0)[..., None], sets[jnp.maximum(cs, 0)], True)
    logp = jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, traj.tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.where(allowed, jnp.exp(logp) * logp, 0.0), axis=-1)
    return jnp.pad(picked, ((0, 0), (1, 0))), jnp.pad(ent, ((0, 0), (1, 0)))


@pytest.mark.parametrize("fast", [True, False])  # logits at loss positions + buckets, or the full-length path
def test_the_update_recomputes_the_sampler_logprobs_of_constrained_tokens(setup, fast):
    config, comp, params, traj = setup
    mask = np.asarray(traj.loss_mask) > 0
    cs = np.asarray(traj.choice_set)
    assert mask.sum() == 16 and (mask == (cs >= 0)).all() and traj.reply_format.all()
    temperature = config.grpo[0].sampling.temperature
    path = {} if fast else dict(length_buckets=1, logits_at_loss_only=False)
    # A token whose ratio leaves [1 - TOL, 1 + TOL] is counted in ratio_masked_frac: a per-token check. No
    # skipping and lr 0: every row is computed, and the "after" forward of decision_policy_change sees the
    # same params (so it is |restricted log-prob - sampler's| over the decision tokens).
    gcfg = dataclasses.replace(config.grpo[0].grpo_config(), ratio_mask_low=1 - TOL, ratio_mask_high=1 + TOL,
                               skip_zero_advantage=False, **path)
    step_args = dict(group_size=config.grpo[0].group_size, temperature=temperature)  # the stage's, as make_grpo_step
    opt = optax.sgd(0.0)
    inputs = (traj.tokens, traj.loss_mask, traj.logprobs, traj.reward, jax.random.PRNGKey(3))
    sets = comp.tables.reply_template.sets
    restricted = dict(choice_set=traj.choice_set, choice_sets=sets)
    out = {}
    for name, extra in (("restricted", restricted), ("whole vocabulary", {})):
        p = _copy(params)
        out[name] = make_grpo_update(comp.module, opt, gcfg, **step_args)(
            p, opt.init(p), *inputs, **decision_inputs(traj, comp.tables), **extra)[2]
    m = out["restricted"]
    assert float(m["ratio_masked_frac"]) == 0.0
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=TOL)
    assert float(m["decision_tokens"]) == 16 and float(m["decision_policy_change"]) < TOL
    assert float(out["whole vocabulary"]["ratio_masked_frac"]) == 1.0  # over 576 tokens, not 4
    assert float(out["whole vocabulary"]["decision_policy_change"]) > 1.0
    # entropy and decision_entropy over the allowed sets (at most ln 4), against the independent forward
    logq, ent = (np.asarray(x) for x in _restricted_stats(comp, params, traj, temperature))
    np.testing.assert_allclose(logq[mask], np.asarray(traj.logprobs)[mask], atol=TOL)
    assert float(m["decision_entropy"]) == pytest.approx(ent[mask].mean(), rel=1e-4)
    assert float(m["entropy"]) == pytest.approx(ent[mask].mean(), rel=1e-4) and ent[mask].max() <= np.log(4) + 1e-5
    assert float(m["illegal_choice_prob"]) == 0.0  # every cell is legal in the bandit
    # the reference's log-probs (beta > 0) are restricted too: the KL against another model's restricted ones
    ref = fresh_params(comp, jax.random.PRNGKey(9))
    logref = np.asarray(_restricted_stats(comp, ref, traj, temperature)[0])
    diff = (logref - logq)[mask]
    kl = (np.exp(diff) - diff - 1).mean()
    p = _copy(params)
    kcfg = dataclasses.replace(gcfg, beta=0.1)
    km = make_grpo_update(comp.module, opt, kcfg, ref_params=ref, **step_args)(p, opt.init(p), *inputs, **restricted)[2]
    assert float(km["kl"]) == pytest.approx(kl, rel=1e-3) and kl > 1e-4


def test_choice_set_needs_its_sets(setup):
    config, comp, params, traj = setup
    opt = optax.sgd(0.0)
    p = _copy(params)
    with pytest.raises(ValueError, match="choice_sets"):
        make_grpo_update(comp.module, opt, config.grpo[0].grpo_config(), group_size=config.grpo[0].group_size,
                         temperature=config.grpo[0].sampling.temperature)(
            p, opt.init(p), traj.tokens, traj.loss_mask, traj.logprobs, traj.reward, jax.random.PRNGKey(0),
            choice_set=traj.choice_set)


def test_a_constrained_grpo_step_from_a_fresh_model(setup):
    """One jitted step of the real pipeline: every reply parses, the update recomputes the sampler's
    log-probs (ratio 1 on its first and only minibatch) and the params move."""
    config, comp, params, _ = setup
    assert fresh_start_warning(config) is None  # constrained: no SFT needed
    step, optimizer = train.make_grpo_step(comp, 0)
    p = placed_like_outputs(_copy(params))
    o = placed_like_outputs(optimizer.init(p))
    for s in range(2):
        p, o, m, traj = step(p, o, None, jax.random.PRNGKey(10 + s))
        m = jax.device_get(m)
        assert float(m["format_rate"]) == 1.0 and bool(np.all(np.asarray(traj.reply_format)))
        assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=TOL)
        assert all(np.isfinite(float(v)) for k, v in m.items() if k not in ("decision_entropy", "illegal_choice_prob"))
    moved = sum(float(jnp.sum(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(p),
                                                                jax.tree_util.tree_leaves(params)))
    assert moved > 0
