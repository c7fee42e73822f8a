"""GRPO: advantages, the loss in each aggregation mode against hand loops, gradients, and a tiny model learning."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.algos import grpo
from jaxrl_llm.algos.grpo import (
    GrpoConfig,
    group_advantages,
    grpo_loss,
    grpo_update_step,
    make_grpo_update,
    policy_logprobs,
    token_entropy,
    token_logprobs,
    update_from_trajectory,
)
from jaxrl_llm.algos.optim import OptimConfig, make_optimizer
from jaxrl_llm.rollout import Trajectory
from jaxrl_llm.generate import SamplingConfig, make_sampler
from models.family import cached_call
from models.lfm2 import ATTENTION, CONV, PRESETS, Lfm2ForCausalLM, init_cache, init_params

VOCAB = 16


@pytest.fixture(scope="module")
def tiny():
    """PRESETS["tiny"] cut to one conv and one attention layer (both kinds, quick to compile), vocab 16."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, num_hidden_layers=2, layer_types=(CONV, ATTENTION))
    module = Lfm2ForCausalLM(config)
    return config, module, init_params(config, jax.random.PRNGKey(0))


# One static length for the update's micro-batches: each length bucket compiles its own forward and backward,
# and these tests are about the loss, accumulation, skipping and the bonus, not the buckets (tested in
# tests/test_grpo_update.py with 2, 3 and 5 buckets against the full-length path).
ONE_BUCKET = dict(length_buckets=1)


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def _norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree_util.tree_leaves(tree)))


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale_rewards": "batch"}, "scale_rewards"),
        ({"epsilon_low": 1.0}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"beta": -1.0}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"epsilon_high": float("inf")}, "epsilon_high"),
        ({"loss_type": "grpo"}, "loss_type"),
        ({"loss_type": "dr-grpo"}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"ratio_mask_low": 1.5}, "ratio_mask_low"),
        ({"ratio_mask_high": 0.9}, "ratio_mask_high"),
        ({"num_minibatches": 0}, "num_minibatches"),
        ({"passes": 0}, "passes"),
        ({"grad_accum_steps": 2.0}, "grad_accum_steps"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GrpoConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 1}, "group_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"group_size": 4.0}, "group_size"),
        ({"group_size": True}, "group_size"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_step_argument_validation(tiny, kwargs, match):
    """The group size and temperature are the update's arguments (not GrpoConfig fields), required and checked."""
    _, module, params = tiny
    opt = optax.sgd(0.1)
    args = {"group_size": 2, "temperature": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_grpo_update(module, opt, GrpoConfig(), **args)
    z = jnp.zeros((4, 5))
    with pytest.raises(ValueError, match=match):
        grpo_update_step(module, opt, GrpoConfig(), params, opt.init(params), None, z.astype(jnp.int32), z, z,
                         jnp.zeros(4), jax.random.PRNGKey(0), **args)
    with pytest.raises(TypeError):
        GrpoConfig(**kwargs)  # no longer fields of the loss table
    with pytest.raises(TypeError, match="group_size"):
        make_grpo_update(module, opt, GrpoConfig(), temperature=1.0)  # required


def test_update_rejects_bad_batches(tiny):
    _, module, params = tiny
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="ref_params"):
        make_grpo_update(module, opt, GrpoConfig(beta=0.1), group_size=2, temperature=1.0)
    update = make_grpo_update(module, opt, GrpoConfig(num_minibatches=2), group_size=4, temperature=1.0)
    z = jnp.zeros((6, 5))
    with pytest.raises(ValueError, match="group_size"):
        update(params, opt.init(params), z.astype(jnp.int32), z, z, jnp.zeros(6), jax.random.PRNGKey(0))


# ------------------------------------------------------------------------------------------------
# Advantages, log-probs, entropy
# ------------------------------------------------------------------------------------------------


def test_group_advantages_hand_cases():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 3.0])
    a = np.asarray(group_advantages(rewards, 4, "none"))
    np.testing.assert_allclose(a, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25], atol=1e-6)
    a = np.asarray(group_advantages(rewards, 4, "group"))
    # Sample std of (1, 0, 0, 1): sqrt(4 * 0.25 / 3); of (0, 0, 0, 3): sqrt((3 * 0.5625 + 5.0625) / 3) = 1.5.
    s1 = math.sqrt(1.0 / 3.0)
    expected = [0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4), 0, 0, 0, 0,
                -0.75 / 1.5001, -0.75 / 1.5001, -0.75 / 1.5001, 2.25 / 1.5001]
    np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(a))
    # Equal rewards everywhere: all zero, no NaN.
    a = np.asarray(group_advantages(jnp.ones(6), 3, "group"))
    assert np.all(a == 0.0)
    # Equal rewards whose float mean is off by an ulp (8 x 0.3, 8 x 1.1): still exactly zero, not ~3e-4.
    for value in (0.3, 1.1, 0.7):
        for scale in ("group", "none"):
            assert np.all(np.asarray(group_advantages(jnp.full(8, value, jnp.float32), 8, scale)) == 0.0)


def test_token_logprobs_and_entropy_against_loops():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 2
    tokens = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    lp = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    ent = np.asarray(token_entropy(jnp.asarray(logits)))
    for b in range(2):
        assert lp[b, 0] == 0.0 and ent[b, 0] == 0.0
        for t in range(1, 5):
            z = logits[b, t - 1].astype(np.float64)
            logz = math.log(sum(math.exp(v) for v in z))
            assert lp[b, t] == pytest.approx(z[tokens[b, t]] - logz, abs=1e-5)
            h = -sum(math.exp(v - logz) * (v - logz) for v in z)
            assert ent[b, t] == pytest.approx(h, abs=1e-5)


# ------------------------------------------------------------------------------------------------
# The loss against hand loops
# ------------------------------------------------------------------------------------------------


def _reference_loss(logp, logq, logref, adv, mask, mode, eps_low, eps_high, beta, max_tokens=None,
                    mask_low=None, mask_high=None):
    """The GRPO loss with explicit loops over rows and tokens (float64)."""
    rows, length = mask.shape
    total, count, per_row = 0.0, 0.0, []
    for b in range(rows):
        row_sum, row_count = 0.0, 0.0
        for t in range(length):
            if mask[b, t] == 0:
                continue
            row_count += 1
            r = math.exp(logp[b, t] - logq[b, t])
            if (mask_low is not None and r < mask_low) or (mask_high is not None and r > mask_high):
                continue
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            loss = -min(r * adv[b], clipped * adv[b])
            if beta > 0:
                d = logref[b, t] - logp[b, t]
                loss += beta * (math.exp(d) - d - 1)
            row_sum += loss
        total += row_sum
        count += row_count
        per_row.append(row_sum / row_count if row_count else 0.0)
    if mode == "token-mean":
        return total / count
    if mode == "sequence-mean-token-mean":
        return sum(per_row) / rows
    return total / (rows * max_tokens)


def _loss_case():
    """4 rows x 6 positions with ratios well outside [0.8, 1.28] on both sides and both advantage signs."""
    rng = np.random.default_rng(3)
    logq = -rng.uniform(0.2, 3.0, size=(4, 6))
    log_ratio = rng.choice([-0.6, -0.3, -0.1, 0.0, 0.1, 0.2, 0.4, 0.7], size=(4, 6))
    logp = logq + log_ratio
    logref = logp + rng.normal(scale=0.3, size=(4, 6))
    adv = np.array([1.3, -0.7, 0.4, -1.1])
    mask = np.array(
        [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1], [0, 0, 0, 1, 1, 0]], np.float64
    )
    return logp, logq, logref, adv, mask


@pytest.mark.parametrize("mode", grpo.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_loss_matches_hand_loops(mode, beta):
    logp, logq, logref, adv, mask = _loss_case()
    cfg = GrpoConfig(loss_type=mode, beta=beta, max_completion_tokens=5)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, metrics = grpo_loss(f32(logp), f32(logq), f32(logref) if beta else None, f32(adv), f32(mask), cfg)
    expected = _reference_loss(logp, logq, logref, adv, mask, mode, 0.2, 0.28, beta, max_tokens=5)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Both clip sides bind somewhere, and the metrics count them by hand.
    r = np.exp(logp - logq)
    low = ((r < 0.8) & (adv[:, None] < 0) & (mask > 0)).sum() / mask.sum()
    high = ((r > 1.28) & (adv[:, None] > 0) & (mask > 0)).sum() / mask.sum()
    assert low > 0 and high > 0
    assert float(metrics["clip_frac_low"]) == pytest.approx(low)
    assert float(metrics["clip_frac_high"]) == pytest.approx(high)
    assert float(metrics["ratio_mean"]) == pytest.approx((r * mask).sum() / mask.sum(), rel=1e-5)
    assert float(metrics["num_tokens"]) == mask.sum()
    if beta:
        d = logref - logp
        kl = ((np.exp(d) - d - 1) * mask).sum() / mask.sum()
        assert float(metrics["kl"]) == pytest.approx(kl, rel=1e-4)
    else:
        assert float(metrics["kl"]) == 0.0


@pytest.mark.parametrize("mode", grpo.LOSS_TYPES)
def test_ratio_masking_removes_out_of_bounds_tokens(mode):
    logp, logq, logref, adv, mask = _loss_case()
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    cfg = GrpoConfig(loss_type=mode, max_completion_tokens=5, ratio_mask_low=0.7, ratio_mask_high=1.4)
    loss, metrics = grpo_loss(f32(logp), f32(logq), None, f32(adv), f32(mask), cfg)
    expected = _reference_loss(logp, logq, logref, adv, mask, mode, 0.2, 0.28, 0.0, max_tokens=5,
                               mask_low=0.7, mask_high=1.4)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    r = np.exp(logp - logq)
    out = (mask > 0) & ((r < 0.7) | (r > 1.4))
    assert out.sum() > 0
    assert float(metrics["ratio_masked_frac"]) == pytest.approx(out.sum() / mask.sum())
    # The masked tokens get no gradient; the kept ones do.
    g = np.asarray(jax.grad(lambda lp: grpo_loss(lp, f32(logq), None, f32(adv), f32(mask), cfg)[0])(f32(logp)))
    assert np.all(g[out] == 0.0)
    # Changing a masked-out token's log-prob further out of bounds changes nothing.
    bumped = logp + np.where(out, np.sign(np.log(r)) * 2.0, 0.0)
    assert float(grpo_loss(f32(bumped), f32(logq), None, f32(adv), f32(mask), cfg)[0]) == pytest.approx(float(loss))


@pytest.mark.parametrize("mode", grpo.LOSS_TYPES)
def test_entropy_bonus_is_the_loss_minus_the_aggregated_entropy(mode):
    """entropy_coef: each masked token's loss gets - coef * H, aggregated like the loss (the hand loops with
    H subtracted), with gradient -coef x the token's aggregation weight on H; the metric is unchanged."""
    logp, logq, logref, adv, mask = _loss_case()
    entropy = np.random.default_rng(5).uniform(0.1, 2.0, size=mask.shape)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    coef = 0.3
    base_cfg = GrpoConfig(loss_type=mode, max_completion_tokens=5)
    cfg = dataclasses.replace(base_cfg, entropy_coef=coef)
    assert cfg.dense_gradient and not base_cfg.dense_gradient
    base, base_metrics = grpo_loss(f32(logp), f32(logq), None, f32(adv), f32(mask), base_cfg, entropy=f32(entropy))
    loss, metrics = grpo_loss(f32(logp), f32(logq), None, f32(adv), f32(mask), cfg, entropy=f32(entropy))
    # The bonus as a loss of its own: the hand loops with advantage 0 and no ratio term leave only -coef * H.
    per_token = -coef * entropy * mask
    if mode == "token-mean":
        bonus = per_token.sum() / mask.sum()
    elif mode == "sequence-mean-token-mean":
        bonus = np.mean(per_token.sum(axis=1) / mask.sum(axis=1))
    else:
        bonus = per_token.sum() / (mask.shape[0] * 5)
    assert float(loss) == pytest.approx(float(base) + bonus, rel=1e-5, abs=1e-6)
    assert float(metrics["entropy"]) == pytest.approx(float(base_metrics["entropy"]))
    g = np.asarray(jax.grad(lambda h: grpo_loss(f32(logp), f32(logq), None, f32(adv), f32(mask), cfg, entropy=h)[0])(
        f32(entropy)))
    assert np.all(g[mask == 0] == 0.0) and np.all(g[mask > 0] < 0.0)
    # Without the coefficient the entropy is a metric only: no gradient.
    g0 = jax.grad(lambda h: grpo_loss(f32(logp), f32(logq), None, f32(adv), f32(mask), base_cfg, entropy=h)[0])(
        f32(entropy))
    assert np.all(np.asarray(g0) == 0.0)


def test_entropy_of_restricted_logits_has_a_finite_gradient():
    """Constrained replies restrict the logits to the allowed set with -inf elsewhere: the entropy is that of
    the allowed tokens alone, and its gradient is finite (0 on the -inf logits), so an entropy bonus cannot
    turn the update's gradient into NaN."""
    logits = jnp.asarray([[0.3, -jnp.inf, 1.1, -jnp.inf, -0.4], [-jnp.inf, -jnp.inf, 2.0, -jnp.inf, -jnp.inf]])
    allowed = np.asarray([[0.3, 1.1, -0.4]], np.float64)
    p = np.exp(allowed - np.log(np.exp(allowed).sum()))
    ent = np.asarray(grpo.logits_entropy(logits))
    np.testing.assert_allclose(ent, [-(p * np.log(p)).sum(), 0.0], atol=1e-6)
    g = np.asarray(jax.grad(lambda z: jnp.sum(grpo.logits_entropy(z)))(logits))
    assert np.all(np.isfinite(g)) and np.all(g[~np.isfinite(np.asarray(logits))] == 0.0)


def test_entropy_bonus_steps_on_a_batch_without_reward_spread(tiny):
    """Every group's rewards equal: no advantage, so plain GRPO takes no optimizer step; with the entropy bonus
    every row has a gradient (nothing is skipped) and the steps raise the policy's entropy on the loss tokens."""
    _, module, params = tiny
    tokens, mask, logq, _ = _synthetic_batch(seed=4, batch=8)
    rewards = jnp.ones(8, jnp.float32)
    opt = optax.sgd(1.0)

    def mean_entropy(p):
        _, ent = policy_logprobs(module, p, tokens, with_entropy=True)
        return float(jnp.sum(ent * mask) / jnp.sum(mask))

    out = {}
    for coef in (0.0, 0.5):
        cfg = GrpoConfig(num_minibatches=2, grad_accum_steps=2, entropy_coef=coef, **ONE_BUCKET)
        p = _copy(params)
        out[coef] = make_grpo_update(module, opt, cfg, group_size=4, temperature=1.0)(
            p, opt.init(p), tokens, mask, logq, rewards, jax.random.PRNGKey(2))
    assert float(out[0.0][2]["optimizer_steps"]) == 0
    assert float(out[0.5][2]["optimizer_steps"]) == 2
    assert mean_entropy(out[0.5][0]) > mean_entropy(params) + 1e-3


def test_loss_gradient_is_zero_off_the_mask(tiny):
    logp, logq, logref, adv, mask = _loss_case()
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    for mode in grpo.LOSS_TYPES:
        cfg = GrpoConfig(loss_type=mode, beta=0.1, max_completion_tokens=5)
        g = jax.grad(lambda lp: grpo_loss(lp, f32(logq), f32(logref), f32(adv), f32(mask), cfg)[0])(f32(logp))
        g = np.asarray(g)
        assert np.all(g[mask == 0] == 0.0) and np.all(g[mask > 0] != 0.0)
        # Garbage off the mask (policy, sampler and reference) changes neither the loss nor its gradient.
        junk = np.where(mask > 0, 0.0, 50.0)
        l1 = grpo_loss(f32(logp - junk), f32(logq + junk), f32(logref - junk), f32(adv), f32(mask), cfg)[0]
        l0 = grpo_loss(f32(logp), f32(logq), f32(logref), f32(adv), f32(mask), cfg)[0]
        assert float(l1) == pytest.approx(float(l0), rel=1e-6)

    # Through the model (one compiled program): the logits that predict masked-out tokens get no
    # gradient, and tokens after a row's last masked token change neither the loss nor the params' gradient.
    _, module, params = tiny
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, size=(4, 6)), jnp.int32)
    trailing = np.zeros((4, 6), bool)
    for b in range(4):
        trailing[b, np.nonzero(mask[b])[0].max() + 1 :] = True
    assert trailing.sum() > 0
    perturbed = jnp.where(jnp.asarray(trailing), (tokens + 5) % VOCAB, tokens)
    cfg = GrpoConfig()
    adv, mask = f32(adv), f32(mask)

    @jax.jit
    def check(p):
        logits = module.apply({"params": p}, tokens)[0]
        logq = jax.lax.stop_gradient(token_logprobs(logits, tokens)) - 0.2
        g_logits = jax.grad(lambda z: grpo_loss(token_logprobs(z, tokens), logq, None, adv, mask, cfg)[0])(logits)

        def loss_of(p, toks):
            return grpo_loss(policy_logprobs(module, p, toks)[0], logq, None, adv, mask, cfg)[0]

        both = jax.vmap(jax.value_and_grad(loss_of), in_axes=(None, 0))(p, jnp.stack([tokens, perturbed]))
        return g_logits, both

    g, (values, grads) = check(params)
    g = np.abs(np.asarray(g)).sum(-1)  # [B, L]: the logits at t predict token t + 1
    m = np.asarray(mask)
    assert np.all(g[:, :-1][m[:, 1:] == 0] == 0.0)
    assert np.all(g[:, -1] == 0.0)
    assert np.all(g[:, :-1][m[:, 1:] > 0] > 0.0)
    assert float(values[0]) == pytest.approx(float(values[1]), abs=1e-6)
    for leaf in jax.tree_util.tree_leaves(grads):
        np.testing.assert_allclose(np.asarray(leaf[0]), np.asarray(leaf[1]), atol=1e-6)


def test_on_policy_gradient_is_the_policy_gradient(tiny):
    """With sampler log-probs equal to the policy's, ratio == 1 and the gradient is -sum(A grad logp) / N."""
    _, module, params = tiny
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(4, 6)), jnp.int32)
    mask = jnp.asarray(_loss_case()[4], jnp.float32)
    adv = group_advantages(jnp.array([1.0, 0.0, 0.2, 0.9]), 2)
    cfg = GrpoConfig()

    @jax.jit
    def both(p):
        logq = jax.lax.stop_gradient(policy_logprobs(module, p, tokens)[0])

        def loss(p):
            return grpo_loss(policy_logprobs(module, p, tokens)[0], logq, None, adv, mask, cfg)

        def pg(p):
            lp = policy_logprobs(module, p, tokens)[0]
            return -jnp.sum(adv[:, None] * lp * mask) / jnp.sum(mask)

        return jax.value_and_grad(loss, has_aux=True)(p), jax.grad(pg)(p)

    ((value, metrics), g), g_ref = both(params)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["clip_frac"]) == 0.0
    # On-policy the value is -mean(A) over the tokens.
    assert float(value) == pytest.approx(float(-jnp.sum(adv[:, None] * mask) / jnp.sum(mask)), abs=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# The update
# ------------------------------------------------------------------------------------------------


def _synthetic_batch(seed=0, batch=8, length=7):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(batch, length)).astype(np.int32)
    mask = np.zeros((batch, length), np.float32)
    for b in range(batch):
        n = rng.integers(1, 4)
        mask[b, length - 1 - n - (b % 2) : length - (b % 2)] = 1.0
    logq = np.where(mask > 0, -rng.uniform(1.5, 3.5, size=(batch, length)), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, size=batch).astype(np.float32)
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(logq), jnp.asarray(rewards)


def test_gradient_accumulation_is_exact(tiny):
    """4 micro-batches accumulated = the gradient of the loss over the whole minibatch (checked with SGD)."""
    _, module, params = tiny
    tokens, mask, logq, rewards = _synthetic_batch()
    lr = 0.5
    opt = optax.sgd(lr)
    cfg = GrpoConfig(loss_type="sequence-mean-token-mean", grad_accum_steps=4, shuffle=False,
                     ratio_mask_high=5.0, compute_entropy=False, **ONE_BUCKET)
    adv = group_advantages(rewards, 4)

    @jax.jit
    def whole(p):
        def loss(p):
            return grpo_loss(policy_logprobs(module, p, tokens)[0], logq, None, adv, mask, cfg)[0]

        return jax.value_and_grad(loss)(p)

    loss, grads = whole(params)
    expected = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    update = make_grpo_update(module, opt, cfg, group_size=4, temperature=1.0)
    p = _copy(params)
    p4, _, m4 = update(p, opt.init(p), tokens, mask, logq, rewards, jax.random.PRNGKey(0))
    assert float(m4["loss"]) == pytest.approx(float(loss), rel=1e-5)
    assert float(m4["grad_norm"]) == pytest.approx(_norm(grads), rel=1e-5)
    assert float(m4["grad_norm"]) > 0
    for a, b in zip(jax.tree_util.tree_leaves(p4), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_skipping_zero_advantage_rows_gives_the_same_update(tiny):
    """skip_zero_advantage: the micro-batches whose rows all have advantage 0 are not computed, and the
    params after SGD steps (2 minibatches x 4 micro-batches, shuffled or not) equal the unskipped update's
    (SGD: Adam's first steps turn float-order noise in near-zero gradients into lr-sized differences)."""
    _, module, params = tiny
    tokens, mask, logq, _ = _synthetic_batch(seed=3, batch=16)
    rewards = jnp.asarray([1, 0, 1, 0, 0.5, 0.5, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3, 0, 1, 1, 1], jnp.float32)
    # The zero-advantage rows get a sampler far from the policy: their ratios show whether they were computed.
    zero_rows = np.asarray(group_advantages(rewards, 4)) == 0
    assert zero_rows.sum() == 8
    logq = jnp.where(jnp.asarray(zero_rows)[:, None] & (mask > 0), -20.0, logq)
    opt = optax.sgd(0.5)
    for shuffle in (True, False):
        out = {}
        for skip in (True, False):
            cfg = GrpoConfig(num_minibatches=2, grad_accum_steps=4, skip_zero_advantage=skip,
                             shuffle=shuffle, compute_entropy=False, **ONE_BUCKET)
            p = _copy(params)
            update = make_grpo_update(module, opt, cfg, group_size=4, temperature=1.0)
            out[skip] = update(p, opt.init(p), tokens, mask, logq, rewards, jax.random.PRNGKey(1))
        for a, b in zip(jax.tree_util.tree_leaves(out[True][0]), jax.tree_util.tree_leaves(out[False][0])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
        assert float(out[True][2]["loss"]) == pytest.approx(float(out[False][2]["loss"]), rel=1e-5, abs=1e-7)
    # In order, each minibatch holds one advantaged and one zero group: the zero rows fill whole micro-batches,
    # which are skipped. Unskipped, their far samplers give huge ratios; skipped, only the advantaged rows count.
    assert float(out[False][2]["ratio_mean"]) > 1e3 > float(out[True][2]["ratio_mean"])
    # With a KL term every row has a gradient: nothing is skipped.
    cfg = GrpoConfig(num_minibatches=2, grad_accum_steps=4, beta=0.1, compute_entropy=False, **ONE_BUCKET)
    p = _copy(params)
    kl = make_grpo_update(module, opt, cfg, ref_params=params, group_size=4, temperature=1.0)(
        p, opt.init(p), tokens, mask, logq, rewards, jax.random.PRNGKey(1))
    assert float(kl[2]["ratio_mean"]) > 1e3


def test_tiny_model_learns_to_say_three(tiny):
    """Sampled last token rewarded when it is id 3: after a few dozen updates p(3) rises a lot.

    The update uses every feature at once (KL to the initial policy, minibatches, gradient accumulation,
    ratio masking, shuffling) so that one compiled program covers them.
    """
    config, module, params = tiny
    params = _copy(params)
    groups, group_size, prompt_len = 4, 8, 3
    batch = groups * group_size
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(4, VOCAB, size=(groups, prompt_len)), group_size, axis=0)
    prompts = jnp.asarray(prompts, jnp.int32)
    sampler = make_sampler(cached_call(module), SamplingConfig(temperature=1.0, max_new_tokens=1))
    gconf = GrpoConfig(num_minibatches=2, grad_accum_steps=2, beta=0.01,
                       ratio_mask_low=0.05, ratio_mask_high=20.0)
    opt = make_optimizer(OptimConfig(learning_rate=3e-3, total_steps=100, schedule="constant"))
    # The reference is the initial policy, given as the very arrays the update then donates.
    update = make_grpo_update(module, opt, gconf, ref_params=params, group_size=group_size, temperature=1.0)
    opt_state = opt.init(params)
    probe = jax.jit(lambda p: jax.nn.softmax(module.apply({"params": p}, prompts)[0][:, -1], -1)[:, 3].mean())
    p_start = float(probe(params))

    key = jax.random.PRNGKey(0)
    history = []
    for step in range(30):
        key, k_sample, k_update = jax.random.split(key, 3)
        cache = init_cache(config, batch, prompt_len + 1)
        out = sampler(params, prompts, jnp.full((batch,), prompt_len), cache, k_sample)
        tokens = jnp.concatenate([prompts, out.tokens], axis=1)
        loss_mask = jnp.zeros(tokens.shape, jnp.float32).at[:, -1].set(1.0)
        logprobs = jnp.zeros(tokens.shape, jnp.float32).at[:, -1].set(out.logprobs[:, 0])
        reward = (out.tokens[:, 0] == 3).astype(jnp.float32)
        if step == 0:
            # Real sampler log-probs (cached decode) agree with the trainer's full forward.
            own = jax.jit(lambda p, t: policy_logprobs(module, p, t)[0])(params, tokens)[:, -1]
            assert float(jnp.max(jnp.abs(own - out.logprobs[:, 0]))) < 1e-4
        traj = Trajectory(tokens=tokens, length=None, loss_mask=loss_mask, logprobs=logprobs, reply_lengths=None,
                          reply_format=None, reply_truncated=None, reply_kind=None, reply_value=None, turns=None,
                          context_cut=None, truncated=None, reward=reward, reward_parts={}, metrics={}, examples=None,
                          final_state=None)
        params, opt_state, metrics = update_from_trajectory(update, params, opt_state, traj, k_update)
        history.append(metrics)
    p_end = float(probe(params))
    assert p_start < 0.2
    assert p_end > 0.6, (p_start, p_end)

    history = jax.device_get(history)
    for m in history:
        for k, v in m.items():
            assert np.isfinite(v), k
        assert m["num_tokens"] == batch
        assert 0.0 <= m["frac_zero_std_groups"] <= 1.0 and m["entropy"] > 0
    assert history[-1]["kl"] > 0  # the policy has moved away from the reference
    assert history[-1]["reward_mean"] > history[0]["reward_mean"]
