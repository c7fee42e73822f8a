"""The GRPO update's machinery (issue 30): length buckets and logits at loss positions equal the full path,
no optimizer step without signal, the schedule in optimizer updates with the rate applied logged, the
decision metrics against an independent computation, and the gradient against an independent REINFORCE."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.algos.grpo import (GrpoConfig, bucket_lengths, forward_slot_logprobs, grpo_update_step, loss_slots,
                                  make_grpo_update, policy_logprobs, real_lengths)
from jaxrl_llm.algos.optim import OptimConfig, learning_rate_schedule, make_optimizer
from models.lfm2 import ATTENTION, CONV, PRESETS, Lfm2ForCausalLM, init_params

VOCAB = 16
LENGTH = 40
OLD = dict(length_buckets=1, logits_at_loss_only=False)  # the full-length path


@pytest.fixture(scope="module")
def tiny():
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, num_hidden_layers=2, layer_types=(CONV, ATTENTION))
    module = Lfm2ForCausalLM(config)
    return config, module, init_params(config, jax.random.PRNGKey(0))


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def _batch(seed=0, batch=16, length=LENGTH, group=4):
    """Rows of different real lengths: a prompt, 1-3 replies of 1-3 model tokens, then padding (random
    tokens after the last reply: they must not matter)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(batch, length)).astype(np.int32)
    mask = np.zeros((batch, length), np.float32)
    decision = np.zeros((batch, length), np.float32)
    for b in range(batch):
        t = int(rng.integers(2, 6))
        end = int(rng.integers(8, length + 1))
        while t < end - 3:
            n = int(rng.integers(1, 4))
            mask[b, t:t + n] = 1.0
            decision[b, t] = 1.0
            t += n + int(rng.integers(2, 9))
    logq = np.where(mask > 0, -rng.uniform(1.5, 3.5, size=(batch, length)), 0.0).astype(np.float32)
    rewards = rng.integers(0, 3, size=batch).astype(np.float32)
    rewards[:group] = 1.0  # one group without spread
    return {k: jnp.asarray(v) for k, v in dict(tokens=tokens, mask=mask, logq=logq, rewards=rewards,
                                                  decision=decision).items()}


def _full_logp(module, params, tokens):
    """Independent log-probs: the full logits, log-softmax, the next token's entry (position 0: 0)."""
    logits = module.apply({"params": params}, tokens)[0]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0))), jnp.pad(logp, ((0, 0), (1, 0), (0, 0)))


def test_buckets_and_slots_helpers():
    assert bucket_lengths(400, 8) == (56, 104, 152, 200, 256, 304, 352, 400)
    assert bucket_lengths(40, 1) == (40,)
    assert bucket_lengths(7, 4) == (7,)
    mask = jnp.asarray([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], jnp.float32)
    assert real_lengths(mask).tolist() == [5, 0]
    pos, valid = loss_slots(mask, 4)
    assert pos.tolist() == [[1, 2, 4, 0], [0, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, False], [False] * 4]


def test_logit_positions_equal_the_full_logits(tiny):
    _, module, params = tiny
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(3, 24)), jnp.int32)
    positions = jnp.asarray(np.random.default_rng(1).integers(0, 24, size=(3, 5)), jnp.int32)
    full = module.apply({"params": params}, tokens)[0]
    picked = module.apply({"params": params}, tokens, logit_positions=positions)[0]
    assert picked.shape == (3, 5, VOCAB)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(jnp.take_along_axis(full, positions[..., None], 1)),
                               atol=1e-5)


@pytest.mark.parametrize("beta, per_token", [(0.0, False), (0.05, True)])
def test_real_lengths_and_loss_logits_equal_the_full_path(tiny, beta, per_token):
    """Params after an update (SGD, 2 minibatches x 2 micro-batches, shuffled) agree with the full-length,
    all-logits path; one compiled program serves batches of other real lengths (no recompile)."""
    _, module, params = tiny
    data = _batch()
    extra = {}
    if per_token:  # per-token advantages (H2's interface): differ along the row
        adv = jnp.asarray(np.random.default_rng(5).normal(size=(16, LENGTH)), jnp.float32)
        extra["advantages"] = jnp.where(data["mask"] > 0, adv, 0.0)
    opt = optax.sgd(0.5)
    out = {}
    for name, kw in (("old", OLD), ("new", dict(length_buckets=5, logits_at_loss_only=True))):
        cfg = GrpoConfig(num_minibatches=2, grad_accum_steps=2, beta=beta, max_completion_tokens=12, **kw)
        update = make_grpo_update(module, opt, cfg, ref_params=params if beta else None, group_size=4, temperature=1.0)
        p = _copy(params)
        out[name] = update(p, opt.init(p), data["tokens"], data["mask"], data["logq"], data["rewards"],
                           jax.random.PRNGKey(3), **extra)
        if name == "new":  # other real lengths, same shapes: the same compiled program
            short = _batch(seed=1)
            p = _copy(params)
            update(p, opt.init(p), short["tokens"], short["mask"], short["logq"], short["rewards"],
                   jax.random.PRNGKey(4), **extra)
            assert update.jitted._cache_size() == 1
    for a, b in zip(jax.tree_util.tree_leaves(out["new"][0]), jax.tree_util.tree_leaves(out["old"][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    moved = sum(float(jnp.sum(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(out["new"][0]),
                                                                jax.tree_util.tree_leaves(params)))
    assert moved > 1e-3
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac", "kl", "entropy"):
        assert float(out["new"][2][key]) == pytest.approx(float(out["old"][2][key]), rel=1e-4, abs=1e-6), key
    assert float(out["new"][2]["loss_tokens_cut"]) == 0.0


def test_no_signal_no_optimizer_step(tiny):
    """Equal rewards in every group and beta = 0: params and Adam's state (moments, count) stay exactly as
    they were, also when every row is computed; a batch with signal moves them."""
    _, module, params = tiny
    data = _batch(seed=2)
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, total_steps=10, schedule="constant"))
    for skip in (True, False):
        cfg = GrpoConfig(num_minibatches=2, skip_zero_advantage=skip)
        update = make_grpo_update(module, opt, cfg, group_size=4, temperature=1.0)
        p = _copy(params)
        p, o, m = update(p, opt.init(p), data["tokens"], data["mask"], data["logq"], data["rewards"],
                         jax.random.PRNGKey(0))
        assert float(m["optimizer_steps"]) == 2.0
        before = jax.device_get((p, o))
        flat = jnp.full((16,), 0.5)
        p, o, m = update(_copy(p), _copy(o), data["tokens"], data["mask"], data["logq"], flat, jax.random.PRNGKey(1))
        after = jax.device_get((p, o))
        for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
            np.testing.assert_array_equal(a, b)
        assert float(m["optimizer_steps"]) == 0.0 and float(m["learning_rate"]) == 0.0
        assert float(m["frac_groups_with_spread"]) == 0.0


def test_schedule_counts_optimizer_updates_and_logs_the_rate_applied(tiny):
    from jaxrl_llm.config import GrpoStage

    stage = GrpoStage(steps=3, num_prompts=4, group_size=4, loss=GrpoConfig(num_minibatches=2, passes=2),
                      optim=OptimConfig(learning_rate=1.0, warmup_steps=3, schedule="linear", end_lr_ratio=0.0))
    optim = stage.optim_config()
    assert optim.total_steps == 3 * 2 * 2
    schedule = learning_rate_schedule(optim)
    _, module, params = tiny
    data = _batch(seed=4)
    opt = make_optimizer(optim)
    update = make_grpo_update(module, opt, dataclasses.replace(stage.grpo_config(), max_completion_tokens=None),
                              group_size=stage.group_size, temperature=stage.sampling.temperature)
    p = _copy(params)
    o = opt.init(p)
    for step in range(2):
        p, o, m = update(p, o, data["tokens"], data["mask"], data["logq"], data["rewards"], jax.random.PRNGKey(step))
        applied = [float(schedule(4 * step + i)) for i in range(4)]
        assert float(m["learning_rate"]) == pytest.approx(np.mean(applied), rel=1e-6)


@pytest.mark.parametrize("change_rows", [1000, 8])
def test_decision_metrics_against_an_independent_computation(tiny, change_rows):
    """On-policy samples: decision_policy_change against the full forward after the update (over every
    row: policy_change_rows >= the batch, or the first 8), decision_entropy and illegal_choice_prob against the full
    forward before it (one minibatch, every row computed)."""
    _, module, params = tiny
    data = _batch(seed=6)
    rng = np.random.default_rng(7)
    choice_tokens = jnp.asarray([3, 5, 7, 11], jnp.int32)
    legal = jnp.asarray(rng.random((16, LENGTH, 4)) < 0.5)

    def stats(q):
        logits = module.apply({"params": q}, data["tokens"])[0][:, :-1] / 1.3
        logp = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(logp, data["tokens"][:, 1:, None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        illegal = jnp.sum(jnp.where(legal[:, 1:], 0.0, jnp.exp(logp[..., choice_tokens])), -1)
        return picked, ent, illegal

    b_logp, b_ent, b_ill = map(np.asarray, stats(params))
    logq = jnp.where(data["mask"] > 0, jnp.pad(jnp.asarray(b_logp), ((0, 0), (1, 0))), 0.0)
    opt = optax.sgd(1.0)
    cfg = GrpoConfig(grad_accum_steps=2, max_completion_tokens=12, skip_zero_advantage=False,
                     policy_change_rows=change_rows)
    p = _copy(params)
    new, _, m = make_grpo_update(module, opt, cfg, group_size=4, temperature=1.3)(
        p, opt.init(p), data["tokens"], data["mask"], logq, data["rewards"], jax.random.PRNGKey(0),
        decision_mask=data["decision"], choice_legal=legal, choice_tokens=choice_tokens)
    d = np.asarray(data["decision"][:, 1:])
    a_logp = np.asarray(stats(new)[0])
    n = d.sum()
    assert float(m["decision_tokens"]) == n
    r = min(change_rows, 16)
    expected = (d[:r] * np.abs(a_logp - b_logp)[:r]).sum() / d[:r].sum()
    assert float(m["decision_policy_change"]) == pytest.approx(expected, rel=1e-3)
    assert float(m["decision_policy_change"]) > 1e-4
    assert float(m["decision_entropy"]) == pytest.approx((d * b_ent).sum() / n, rel=1e-5)
    assert float(m["illegal_choice_prob"]) == pytest.approx((d * b_ill).sum() / n, rel=1e-5)
    assert float(m["frac_groups_with_spread"]) == pytest.approx(1.0 - float(m["frac_zero_std_groups"]))


def test_decision_policy_change_is_nan_when_off_and_the_setting_is_checked():
    """policy_change_rows = 0: no forward after the update, the metric NaN; a negative count is named."""
    from jaxrl_llm.algos.grpo_metrics import decision_metrics

    dec = {"dec_n": jnp.float32(3.0), "dec_entropy": jnp.float32(1.5)}
    decision = jnp.asarray([[1.0, 0.0], [1.0, 1.0]])
    before = jnp.zeros((2, 2))
    off = decision_metrics(dec, decision, None, before)
    assert np.isnan(float(off["decision_policy_change"])) and float(off["decision_tokens"]) == 3.0
    first = decision_metrics(dec, decision, jnp.asarray([[0.5, 9.0]]), before)  # the first row: one decision token
    assert float(first["decision_policy_change"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="policy_change_rows"):
        GrpoConfig(policy_change_rows=-1)


def test_loss_on_decision_tokens(tiny):
    """loss_on = "decision" is the update with loss mask * decision mask: the format tokens get no gradient."""
    _, module, params = tiny
    data = _batch(seed=8)
    opt = optax.sgd(0.5)
    out = []
    for cfg, mask, extra in (
        (GrpoConfig(loss_on="decision"), data["mask"], {"decision_mask": data["decision"]}),
        (GrpoConfig(), data["mask"] * data["decision"], {}),
    ):
        p = _copy(params)
        out.append(make_grpo_update(module, opt, cfg, group_size=4, temperature=1.0)(
            p, opt.init(p), data["tokens"], mask, data["logq"], data["rewards"], jax.random.PRNGKey(0), **extra))
    for a, b in zip(jax.tree_util.tree_leaves(out[0][0]), jax.tree_util.tree_leaves(out[1][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert float(out[0][2]["num_tokens"]) == float(jnp.sum(data["decision"]))
    with pytest.raises(ValueError, match="decision_mask"):
        make_grpo_update(module, opt, GrpoConfig(loss_on="decision"), group_size=4, temperature=1.0)(
            params, opt.init(params), data["tokens"], data["mask"], data["logq"], data["rewards"], jax.random.PRNGKey(0))


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_is_the_independent_reinforce_gradient(tiny, per_token):
    """On-policy (sampler log-probs = the policy's), the update's gradient (SGD with lr 1: params before -
    after) over the new path (buckets, logits at loss positions, 2 micro-batches) has cosine >= 0.9999 with
    -sum(mask * A * grad log pi) / N computed independently: advantages in NumPy, log-probs from the full
    logits, one `jax.grad`."""
    _, module, params = tiny
    data = _batch(seed=9)
    tokens, mask = data["tokens"], np.asarray(data["mask"])
    rewards = np.asarray(data["rewards"]).reshape(-1, 4)
    centred = rewards - rewards.mean(1, keepdims=True)
    std = rewards.std(1, ddof=1, keepdims=True)
    adv_rows = np.where(std > 0, centred / (std + 1e-4), 0.0).reshape(-1)
    if per_token:
        adv = np.random.default_rng(10).normal(size=mask.shape).astype(np.float32) * mask
        extra = {"advantages": jnp.asarray(adv)}
    else:
        adv = np.repeat(adv_rows[:, None], mask.shape[1], axis=1)
        extra = {}
    logq = jax.jit(lambda p: _full_logp(module, p, tokens)[0])(params)
    logq = jnp.where(data["mask"] > 0, logq, 0.0)

    def reinforce(p):
        logp = _full_logp(module, p, tokens)[0]
        return -jnp.sum(jnp.asarray(mask * adv) * logp) / mask.sum()

    expected = jax.jit(jax.grad(reinforce))(params)
    cfg = GrpoConfig(grad_accum_steps=2, max_completion_tokens=12, length_buckets=2, compute_entropy=False)
    p = _copy(params)
    after, _, m = make_grpo_update(module, optax.sgd(1.0), cfg, group_size=4, temperature=1.0)(
        p, optax.sgd(1.0).init(p), tokens, data["mask"], logq, data["rewards"], jax.random.PRNGKey(0), **extra)
    got = np.concatenate([np.ravel(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                          for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(after))])
    want = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree_util.tree_leaves(expected)])
    cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cosine >= 0.9999, cosine
    assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=1e-3)
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)


def test_update_step_inside_a_larger_jit_with_lora(tiny):
    """The keyword inputs pass through `grpo_update_step` inside another jit, with a LoRA policy."""
    from models import lora

    config, module, params = tiny
    section = lora.LoraConfig(rank=2)
    wrapped = lora.LoraModel(module, section)
    adapters = lora.init_adapters(section, params, jax.random.PRNGKey(1))
    data = _batch(seed=11)
    opt = optax.adam(1e-2)
    cfg = GrpoConfig(grad_accum_steps=2, length_buckets=3, max_completion_tokens=12)
    fn = jax.jit(lambda a, o: grpo_update_step(wrapped, opt, cfg, a, o, None, data["tokens"], data["mask"], data["logq"],
                                               data["rewards"], jax.random.PRNGKey(0), frozen=params,
                                               group_size=4, temperature=1.0, decision_mask=data["decision"]))
    new, _, m = fn(adapters, opt.init(adapters))
    assert np.isfinite(float(m["decision_policy_change"])) and float(m["decision_policy_change"]) > 0
    assert "learning_rate" not in m  # a plain optax.adam does not inject its rate


def test_forward_slot_logprobs_are_the_full_forwards_logprobs_at_the_loss_tokens(tiny):
    """The update's bucketed, loss-positions-only forward (the train benchmark's floor) against a plain full
    forward's token log-probs at the loss positions."""
    _, module, params = tiny
    data = _batch(seed=11)
    full = np.asarray(policy_logprobs(module, params, data["tokens"], temperature=1.3)[0])
    cfg = GrpoConfig(grad_accum_steps=2, max_completion_tokens=12, length_buckets=3)
    logp, positions, valid = jax.jit(lambda p, t, m: forward_slot_logprobs(module, cfg, p, t, m, temperature=1.3))(
        params, data["tokens"], data["mask"])
    rows, pos = np.nonzero(np.asarray(valid))
    expected = full[rows, np.asarray(positions)[rows, pos]]
    np.testing.assert_allclose(np.asarray(logp)[rows, pos], expected, atol=2e-5)
    assert valid.sum() == np.asarray(data["mask"]).sum()
