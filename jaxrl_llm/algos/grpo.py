"""GRPO: group advantages, the clipped-ratio policy loss and the jitted optimizer update.

One update, for a batch of B trajectories laid out in groups (rows i*G .. (i+1)*G - 1 answer the same
example), all inside one `jit`:
  1. advantages from the rewards, per group (`episode_advantages`: GRPO's `group_advantages`, or RLOO's
     leave-one-out `rloo_advantages` with `GrpoConfig.estimator = "rloo"`), or given per token;
  2. with a KL penalty (beta > 0), the frozen reference model's log-probs of the batch, once;
  3. the generic update (`algos.update.minibatch_update`) with this module's per-micro-batch loss
     (`_micro_loss`): `passes` passes over `num_minibatches` minibatches (rows shuffled per pass, or in
     order); each minibatch recomputes the policy's log-probs with a forward (`module.apply`) over each
     micro-batch's length bucket, with the LM head only at the loss positions, takes the gradient of
     `grpo_loss` (optionally accumulated over `grad_accum_steps` micro-batches with `lax.scan`) and
     applies one optax update, unless no row of the minibatch carries signal (then params and optimizer
     state stay as they are).
The importance ratio compares the current policy with the sampler that produced the tokens: its
log-probs are the trajectory's `logprobs` (aligned with `tokens`: position t holds log p(tokens[t])).

Notation used in the docstrings: B rows, L positions, V vocabulary, m[b, t] the loss mask (1 on the
model's sampled tokens), A[b] the advantage, logp / logq / logref the policy's, sampler's and reference's
log-prob of the token at each position, r = exp(logp - logq) the per-token importance ratio.
The per-token and slot log-probs live in `algos.token_logprobs`, the metrics in `algos.grpo_metrics`,
the input checks in `algos.grpo_inputs`; this module re-exports the public log-prob helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.algos.update import UpdateSchedule, bucket_lengths, bucketed_map, minibatch_update, real_lengths
from jaxrl_llm.checks import ConfigError, check_choice, check_float, check_int
from jaxrl_llm.algos.grpo_inputs import check_batch, check_extras, check_step_args
from jaxrl_llm.algos.grpo_metrics import batch_metrics, decision_metrics, decision_sums, finish_metrics, step_metrics
from jaxrl_llm.algos.token_logprobs import (  # noqa: F401  (token_logprobs .. slot_logits: re-exported)
    at_slots,
    forward_inputs,
    logits_entropy,
    loss_slots,
    picked_logprobs,
    policy_logprobs,
    slot_forward,
    slot_layout,
    slot_logits,
    slot_logprobs,
    token_entropy,
    token_logprobs,
)
from models import lora

LOSS_TYPES = ("token-mean", "sequence-mean-token-mean", "dr-grpo")
SCALE_REWARDS = ("group", "none")
LOSS_ON = ("reply", "decision")
ADVANTAGES = ("episode", "step", "mix")
ESTIMATORS = ("grpo", "rloo")


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """GRPO hyper-parameters (static under jit; validated on construction): exactly the `[grpo.loss]` table.
    The group size and the temperature are not in it: `grpo_update_step` / `make_grpo_update` take them.

    scale_rewards: "group" divides the centred rewards by the group's std (+ std_eps); "none" only
        centres them (Dr. GRPO's advice).
    std_eps: added to the group std before dividing (as TRL, 1e-4).
    epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] (DAPO's
        asymmetric "clip higher"; 0.2 / 0.28).
    beta: coefficient of the k3 KL estimator to the frozen reference; 0 needs no reference model (it is
        then never evaluated).
    loss_type: how per-token losses are aggregated (formulas in `grpo_loss`): "token-mean",
        "sequence-mean-token-mean" or "dr-grpo".
    max_completion_tokens: the constant normaliser of "dr-grpo" (required for it, ignored otherwise):
        the most model tokens a row can hold. In a multi-turn game that is the loss-mask tokens of all
        replies together, e.g. `env.max_turns * sampling.max_new_tokens`.
    ratio_mask_low, ratio_mask_high: importance-ratio masking; a token whose ratio r = pi / pi_sampler is
        outside [ratio_mask_low, ratio_mask_high] contributes nothing to the loss (None disables a side).
        Guards against tokens where sampler and trainer disagree (e.g. numerics, stale samples).
    num_minibatches: optimizer steps per pass; must divide B.
    passes: passes over the batch per update (each pass sees every row once).
    grad_accum_steps: micro-batches per minibatch (gradient accumulated with `lax.scan`); must divide
        B / num_minibatches. The result equals the minibatch taken in one piece.
    shuffle: rows are permuted with the update's key at each pass (else taken in order).
    compute_entropy: also compute the policy's per-token entropy (a metric; no gradient).
    skip_zero_advantage: with beta = 0 a row whose advantage is 0 (e.g. every row of a group whose rewards
        are all equal) has an exactly zero gradient, so the update does not compute it. Each minibatch's rows
        are ordered with the advantaged ones first, and a micro-batch whose rows all have advantage 0 skips
        its forward and backward pass (`lax.cond`); its gradient is the exact zero, and the optimizer step
        is the same. The params come out as without skipping (up to float summation order); the per-token
        metrics (clip fractions, ratio, entropy) are then means over the computed rows. Use
        grad_accum_steps > 1 for a finer granularity. Ignored when beta > 0 or entropy_coef > 0 (the KL
        term and the entropy bonus have a gradient on every row).
    entropy_coef: an entropy bonus (>= 0; 0 = off, the default): each loss token's loss gets
        - entropy_coef * H, H the entropy of the policy's distribution for that token (the logits divided by
        the sampler's temperature; under constrained replies over the allowed set, so a forced token has
        H = 0), aggregated like the rest of the loss. Against the collapse of the sampled decisions' entropy,
        which ends exploration: every group's replies become the same and carry no reward spread. On
        unconstrained replies it also raises the entropy of the format tokens: keep it small there, or use
        constrained replies or loss_on = "decision".
    length_buckets: the update runs each micro-batch (and the reference / metric forwards, chunk by chunk)
        over the shortest of `length_buckets` static lengths (`bucket_lengths`: multiples of L / n rounded
        up to 8, the last L) that holds its longest real row (the last loss token + 1), chosen with
        `lax.switch`: each bucket compiles once, no step recompiles. A causal model's log-probs at the kept
        positions are those of the full context, so the update equals the full-length one (float
        rounding aside). With grad_accum_steps > 1 each minibatch's rows are ordered by length (the
        advantaged ones first under skip_zero_advantage) before it is cut into micro-batches (exact: the
        micro-batches share their minibatch's normalisers). 1: every row at the full context (the old path).
    logits_at_loss_only: the final hidden states are gathered at the positions that predict loss tokens
        before the LM head (the model's `logit_positions=...`), so the logits and log-softmax cost
        K positions a row instead of L, with K = max_completion_tokens rounded up to 8 (at most L; L when
        it is unset). A row with more loss tokens than K loses the later ones (metric `loss_tokens_cut`;
        0 when max_completion_tokens is the true bound, max_turns * max_new_tokens, as a stage sets it).
        False: the logits at every position (the old path).
    loss_on: "reply" (every model token, today) or "decision" (only the tokens that carry the reply
        grammar's content, the `decision_mask` given to `grpo_update_step`: the move, the answer; the
        fixed format text then gets no gradient and cannot drift).
    advantage: what each token's advantage is (`algos.advantages.token_advantages`): "episode" the group
        advantage of the game's reward on every token (today's GRPO); "step" per-turn step groups after
        GiGPO (turns of one group played from the same state, keyed by `Env.state_key`, compared by
        their discounted returns; each turn's advantage on its own tokens); "mix" episode_weight *
        episode + step_weight * step.
    episode_weight, step_weight: the two weights of "mix" (>= 0, not both 0; ignored otherwise).
    step_discount: the discount of the per-turn return of "step" and "mix", in [0, 1] (GiGPO's 0.95).
    policy_change_rows: how many rows (the batch's first: its examples are drawn at random) the metric
        `decision_policy_change` measures: it costs one no-gradient forward of those rows after the
        update. At least the batch size: every row (exact, one more forward of the whole batch: ~1/3 of
        an every-row update); 0: off (NaN). Default 16: an eighth of the CPU preset's 128 rows, ~100
        decision tokens.
    estimator: the episode advantage (`episode_advantages`): "grpo" the group-relative one
        (`group_advantages`, with scale_rewards and std_eps); "rloo" REINFORCE's leave-one-out baseline
        (`rloo_advantages`: a row's reward minus the mean of the other rows of its group; no std division,
        so scale_rewards and std_eps do not touch it), through the same clipped-ratio loss, which with one
        pass and one minibatch (ratio 1) is REINFORCE's -A grad log pi. It sets the episode advantage of
        "episode" and of "mix" (the step part stays GiGPO's); "step" uses no episode advantage, so "rloo"
        with it is an error.
    """

    scale_rewards: str = "group"
    std_eps: float = 1e-4
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: str = "token-mean"
    max_completion_tokens: int | None = None
    ratio_mask_low: float | None = None
    ratio_mask_high: float | None = None
    num_minibatches: int = 1
    passes: int = 1
    grad_accum_steps: int = 1
    shuffle: bool = True
    compute_entropy: bool = True
    skip_zero_advantage: bool = True
    length_buckets: int = 4
    logits_at_loss_only: bool = True
    loss_on: str = "reply"
    advantage: str = "episode"
    episode_weight: float = 1.0
    step_weight: float = 1.0
    step_discount: float = 0.95
    estimator: str = "grpo"
    policy_change_rows: int = 16
    entropy_coef: float = 0.0

    def __post_init__(self):
        for name in ("num_minibatches", "passes", "grad_accum_steps"):
            check_int(self, name, 1)
        check_choice(self, "scale_rewards", SCALE_REWARDS)
        check_float(self, "std_eps", low=0.0, low_open=True)
        check_float(self, "epsilon_low", 0.0, 1.0, high_open=True)
        check_float(self, "epsilon_high", low=0.0)
        check_float(self, "beta", low=0.0)
        check_choice(self, "loss_type", LOSS_TYPES)
        if self.max_completion_tokens is not None:
            check_int(self, "max_completion_tokens", 1)
        elif self.loss_type == "dr-grpo":
            raise ConfigError("is needed by loss_type 'dr-grpo' (its constant normaliser, e.g. max_turns * "
                              "max_new_tokens)", ("max_completion_tokens",), "GrpoConfig")
        if self.ratio_mask_low is not None:
            check_float(self, "ratio_mask_low", 0.0, 1.0, high_open=True)
        if self.ratio_mask_high is not None:
            check_float(self, "ratio_mask_high", low=1.0, low_open=True)
        check_int(self, "length_buckets", 1)
        check_choice(self, "loss_on", LOSS_ON)
        check_choice(self, "advantage", ADVANTAGES)
        check_float(self, "episode_weight", low=0.0)
        check_float(self, "step_weight", low=0.0)
        check_float(self, "step_discount", 0.0, 1.0)
        if self.advantage == "mix" and self.episode_weight == 0 and self.step_weight == 0:
            raise ConfigError("advantage 'mix' needs episode_weight or step_weight > 0 (both are 0)",
                              ("step_weight",), "GrpoConfig")
        check_choice(self, "estimator", ESTIMATORS)
        check_int(self, "policy_change_rows", 0)
        check_float(self, "entropy_coef", low=0.0)
        if self.estimator == "rloo" and self.advantage == "step":
            raise ConfigError("'rloo' is an episode advantage, which advantage 'step' does not use (use "
                              "advantage 'episode' or 'mix', or estimator 'grpo')", ("estimator",), "GrpoConfig")

    @property
    def dense_gradient(self) -> bool:
        """Whether every row has a gradient whatever its advantage (the KL term or the entropy bonus is on)."""
        return self.beta > 0 or self.entropy_coef > 0

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pass: num_minibatches * grad_accum_steps (must divide B)."""
        return self.num_minibatches * self.grad_accum_steps


# ----------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------


def _reward_groups(rewards: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """The rewards by group, checked: float32[B] -> (float32[B / G, G], bool[B / G, 1] all equal in the group)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards must be float32[B] with B a multiple of group_size {group_size}, got shape {rewards.shape}"
        )
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (got {group_size})")
    groups = rewards.reshape(-1, group_size)
    return groups, jnp.all(groups == groups[:, :1], axis=1, keepdims=True)


def group_advantages(rewards: jax.Array, group_size: int, scale: str = "group", eps: float = 1e-4) -> jax.Array:
    """Group-relative advantages: float32[B] -> float32[B] (B a multiple of group_size, groups consecutive).

    A[i] = r[i] - mean_g(r)                       (scale "none")
    A[i] = (r[i] - mean_g(r)) / (std_g(r) + eps)  (scale "group")
    std_g is the SAMPLE (unbiased, ddof = 1) standard deviation over the group, as torch's default `std`
    that TRL uses; eps = 1e-4 by default (TRL's). A group with equal rewards gets exactly A = 0.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS} (got {scale!r})")
    groups, equal = _reward_groups(rewards, group_size)
    # A group of equal rewards gets exactly 0: its float mean may differ from them by an ulp, which the
    # std division would blow up to ~1e-4 (a spurious push on every row of the group).
    centred = jnp.where(equal, 0.0, groups - groups.mean(axis=1, keepdims=True))
    if scale == "group":
        std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))
        centred = centred / (std + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Leave-one-out advantages (RLOO): float32[B] -> float32[B] (B a multiple of group_size G, groups consecutive).

    A[i] = r[i] - (1 / (G - 1)) * sum_{j in group(i), j != i} r[j]   (= G / (G - 1) * (r[i] - mean_g(r)))
    Each row's REINFORCE baseline is the mean reward of the other rows of its group, which does not depend
    on the row's own sample (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!";
    Ahmadian et al. 2024, arXiv 2402.14740). No std division. A group with equal rewards gets exactly A = 0.
    """
    groups, equal = _reward_groups(rewards, group_size)
    others = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
    return jnp.where(equal, 0.0, groups - others).reshape(-1)


def episode_advantages(config: GrpoConfig, rewards: jax.Array, group_size: int) -> jax.Array:
    """The episode advantage of `config.estimator`: float32[B] -> float32[B] in groups of group_size
    (`group_advantages` with the config's scale_rewards and std_eps, or `rloo_advantages`)."""
    if config.estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    return group_advantages(rewards, group_size, config.scale_rewards, config.std_eps)


# ----------------------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------------------

_SUM_KEYS = ("tokens", "clip_low", "clip_high", "ratio", "kl", "ratio_masked", "entropy")


def _loss_and_sums(policy_logprobs, sampler_logprobs, ref_logprobs, advantages, loss_mask, config: GrpoConfig,
                   token_count, num_rows: int, entropy=None):
    """The loss with the normalisers given (so micro-batches can share their minibatch's), and metric sums.

    token_count: masked tokens of the whole minibatch ("token-mean"); num_rows: its rows (the other modes).
    advantages: float32[B] (one per row) or float32[B, L] (one per token). entropy: float32[B, L] or None,
    with its gradient (the bonus of `GrpoConfig.entropy_coef`; the metric sum takes none).
    Returns (loss scalar, dict of per-token sums over masked tokens, keys `_SUM_KEYS`).
    """
    mask = loss_mask.astype(jnp.float32)
    on = mask > 0
    policy_logprobs = policy_logprobs.astype(jnp.float32)
    # Off the mask the log-probs may be anything (sampler 0, policy garbage): keep the ratio finite there.
    log_ratio = jnp.where(on, policy_logprobs - sampler_logprobs.astype(jnp.float32), 0.0)
    ratio = jnp.exp(log_ratio)
    adv = advantages.astype(jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv
    clipped_ratio = jnp.clip(ratio, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    kl = jnp.zeros_like(per_token)
    if ref_logprobs is not None and config.beta > 0:
        diff = jnp.where(on, ref_logprobs.astype(jnp.float32) - policy_logprobs, 0.0)
        kl = jnp.exp(diff) - diff - 1.0
        per_token = per_token + config.beta * kl
    if entropy is not None and config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * entropy.astype(jnp.float32)

    keep = mask
    r_sg = jax.lax.stop_gradient(ratio)
    if config.ratio_mask_low is not None:
        keep = keep * (r_sg >= config.ratio_mask_low)
    if config.ratio_mask_high is not None:
        keep = keep * (r_sg <= config.ratio_mask_high)
    weighted = per_token * keep

    if config.loss_type == "token-mean":
        loss = jnp.sum(weighted) / jnp.maximum(token_count, 1.0)
    elif config.loss_type == "sequence-mean-token-mean":
        per_row = jnp.sum(weighted, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        loss = jnp.sum(per_row) / num_rows
    else:  # dr-grpo
        loss = jnp.sum(weighted) / (num_rows * config.max_completion_tokens)

    sg = jax.lax.stop_gradient
    sums = {
        "tokens": jnp.sum(mask),
        "clip_low": jnp.sum(mask * ((r_sg < 1.0 - config.epsilon_low) & (adv < 0))),
        "clip_high": jnp.sum(mask * ((r_sg > 1.0 + config.epsilon_high) & (adv > 0))),
        "ratio": jnp.sum(mask * r_sg),
        "kl": jnp.sum(mask * sg(kl)),
        "ratio_masked": jnp.sum(mask - keep),
        "entropy": jnp.sum(mask * sg(entropy)) if entropy is not None else jnp.zeros((), jnp.float32),
    }
    return loss, sums


def grpo_loss(
    policy_logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    advantages: jax.Array,
    loss_mask: jax.Array,
    config: GrpoConfig,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The clipped-ratio GRPO loss: float32[B, L] x3 (ref may be None), float32[B] or [B, L], float32[B, L] -> (scalar, metrics).

    Per token (m = 1):
        r = exp(logp - logq)
        l = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * kl - entropy_coef * H
        kl = exp(logref - logp) - (logref - logp) - 1          (k3 estimator; only when beta > 0 and ref given)
        H: the given entropy (the bonus only when entropy_coef > 0 and entropy is given)
    Importance-ratio masking: k = m * [ratio_mask_low <= r <= ratio_mask_high] (each bound optional; the
    mask has no gradient). Masked-out tokens contribute 0 to the sums below, while the normalisers still
    count the trajectory's tokens (m): they are fixed by the data, not by the current policy.
    Aggregation (n_b = sum_t m[b, t], N = sum_b n_b):
        "token-mean":               loss = sum_{b,t} k l / N
        "sequence-mean-token-mean": loss = (1 / B) sum_b (sum_t k l / n_b)      (rows with n_b = 0 give 0)
        "dr-grpo":                  loss = sum_{b,t} k l / (B * max_completion_tokens)
    Metrics (means over the m tokens): clip_frac_low (r < 1 - epsilon_low and A < 0: the low clip
    binds), clip_frac_high (r > 1 + epsilon_high and A > 0), clip_frac, ratio_mean,
    kl, ratio_masked_frac; num_tokens = N; entropy (mean of the given float32[B, L]) when given.
    """
    mask = loss_mask.astype(jnp.float32)
    loss, sums = _loss_and_sums(policy_logprobs, sampler_logprobs, ref_logprobs, advantages, mask, config,
                                jnp.sum(mask), mask.shape[0], entropy)
    metrics = finish_metrics(sums, entropy is not None)
    metrics["loss"] = loss
    return loss, metrics


# ----------------------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------------------


def _micro_loss(module, config: GrpoConfig, temperature, slots: int, rows: int, frozen, choice_sets, choice_tokens,
                p, micro: dict, bucket: int, token_count: jax.Array, key: jax.Array) -> tuple[jax.Array, dict]:
    """The GRPO loss of one micro-batch at a bucket length (`update.minibatch_update`'s loss_fn) -> (loss, sums).

    micro: R rows of `_update_data` (tokens int32[R, L]; pos, target, mask, sampler [R, K]; adv [R] or
    [R, K]; ref, cset, decision, legal when present). rows and token_count: the minibatch's rows and loss
    tokens (the normalisers its micro-batches share); key: the LoRA dropout key; temperature: the
    sampler's (`slot_forward`). sums: `_SUM_KEYS` and the decision sums (`decision_sums`).
    """
    kb = min(slots, bucket)
    cut = lambda x: x[:, :kb]  # noqa: E731
    policy = p if frozen is None else lora.join(frozen, p, key)
    logits = slot_forward(module, config, temperature, choice_sets, policy, micro["tokens"][:, :bucket], micro["pos"],
                          kb, cut(micro["cset"]) if "cset" in micro else None)
    entropy = logits_entropy(logits) if config.compute_entropy or config.entropy_coef > 0 else None
    adv = micro["adv"] if micro["adv"].ndim == 1 else cut(micro["adv"])
    loss, sums = _loss_and_sums(picked_logprobs(logits, cut(micro["target"])), cut(micro["sampler"]),
                                cut(micro["ref"]) if "ref" in micro else None, adv, cut(micro["mask"]), config,
                                token_count, rows, entropy)
    return loss, {**sums, **decision_sums(logits, micro, kb, choice_tokens)}


def _update_data(config: GrpoConfig, tokens, loss_mask, sampler_logprobs, advantages, dense_gradient: bool,
                 decision_mask=None, choice_legal=None, choice_set=None) -> tuple[dict, int]:
    """The rows the generic update walks -> (data, K): tokens int32[B, L]; at the K slots (`slot_layout`)
    pos, target, mask, sampler, and cset / decision / legal when given ([B, K]); adv float32[B] or [B, K];
    need (`real_lengths`) and signal (a row with an advantage != 0 on a loss token; every row when
    dense_gradient: the KL term or the entropy bonus has a gradient everywhere)."""
    positions, valid, slots = slot_layout(config, loss_mask)
    at = functools.partial(at_slots, config, positions)
    slot_mask = at(loss_mask) * valid
    adv = advantages if advantages.ndim == 1 else at(advantages)
    adv_2d = adv[:, None] if adv.ndim == 1 else adv
    signal = jnp.any((adv_2d != 0) & (slot_mask > 0), axis=1)
    data = {"tokens": tokens, "pos": positions, "target": at(tokens), "mask": slot_mask, "sampler": at(sampler_logprobs),
            "adv": adv, "need": real_lengths(loss_mask),
            "signal": jnp.ones_like(signal) if dense_gradient else signal}
    if choice_set is not None:  # the allowed set of each slot's token (-1: the whole vocabulary)
        data["cset"] = at(choice_set)
    if decision_mask is not None:  # the decision metrics' sums ride along the training forwards
        data["decision"] = at(decision_mask) * valid
        if choice_legal is not None:
            data["legal"] = at(choice_legal)
    return data, slots


def _bucketed_logprobs(module, config: GrpoConfig, temperature, slots: int, choice_sets, policy, rows: int | None = None,
                       *, data: dict, buckets: tuple[int, ...]) -> jax.Array:
    """The update's no-gradient forward of the first `rows` rows (None: all B) of `_update_data`'s data, chunk
    by chunk (B / micro_batches rows, or fewer to divide `rows`) at their length buckets -> float32[rows, K]."""
    batch = data["need"].shape[0]
    rows = batch if rows is None else rows
    head = {k: v[:rows] for k, v in forward_inputs(data).items()}
    logprobs = functools.partial(slot_logprobs, module, config, temperature, slots, choice_sets, policy)
    return bucketed_map(logprobs, head, data["need"][:rows], buckets, math.gcd(rows, batch // config.micro_batches))[0]


def forward_slot_logprobs(module, config: GrpoConfig, params, tokens: jax.Array, loss_mask: jax.Array, *,
                          temperature: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The update's no-gradient forward alone (its reference forward when beta > 0): the log-probs of the
    loss tokens, the logits divided by `temperature`, computed as the update computes them (length buckets,
    logits at loss positions only, chunks of B / micro_batches rows). Traceable; a floor for an update's time.

    tokens int32[B, L], loss_mask float32[B, L] -> (logprobs float32[B, K], positions int32[B, K], valid
    bool[B, K]): slot k of row b is the loss token at positions[b, k] where valid (`slot_layout`).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    loss_mask = jnp.asarray(loss_mask, jnp.float32)
    zeros = jnp.zeros(tokens.shape[:1], jnp.float32)
    data, slots = _update_data(config, tokens, loss_mask, jnp.zeros_like(loss_mask), zeros, False)
    logp = _bucketed_logprobs(module, config, temperature, slots, None, params, data=data,
                              buckets=bucket_lengths(tokens.shape[1], config.length_buckets))
    return logp, data["pos"], data["mask"] > 0


def grpo_update_step(
    module,
    optimizer: optax.GradientTransformation,
    config: GrpoConfig,
    params,
    opt_state,
    ref_params,
    tokens: jax.Array,
    loss_mask: jax.Array,
    sampler_logprobs: jax.Array,
    rewards: jax.Array,
    key: jax.Array,
    frozen=None,
    *,
    group_size: int,
    temperature: float,
    advantages: jax.Array | None = None,
    decision_mask: jax.Array | None = None,
    choice_legal: jax.Array | None = None,
    choice_tokens: jax.Array | None = None,
    choice_set: jax.Array | None = None,
    choice_sets: jax.Array | None = None,
):
    """One GRPO update (traceable; `make_grpo_update` jits it) -> (params, opt_state, metrics).

    tokens int32[B, L], loss_mask float32[B, L], sampler_logprobs float32[B, L] (the trajectory's
    `logprobs`), rewards float32[B] (groups of `group_size` consecutive rows), key: shuffling.
    group_size, temperature (keyword, required): G, the completions per example (an int >= 2; a stage's
    `group_size`), and the sampler's temperature (a finite number > 0; a stage's `sampling.temperature`),
    which divides the policy's and reference's logits before the log-softmax, so that the ratio compares
    the same distributions.
    ref_params: the frozen reference's params (used only when beta > 0; may be None otherwise).
    frozen: None, or the frozen base of a LoRA policy (`models.lora`): params are then its adapters, the
    policy is `lora.join(frozen, params, dropout key)` (one dropout key per micro-batch, drawn from the
    pass key without changing the shuffle) and only the adapters get gradients and optimizer updates.
    Optional (None: as without them):
      advantages float32[B] or float32[B, L]: replaces the group advantages of `rewards` ([B, L]: one per
        token, e.g. `algos.advantages.token_advantages`);
      decision_mask float32[B, L]: 1 on the tokens that carry the reply grammar's content; the loss mask
        with `GrpoConfig.loss_on = "decision"`, and the decision metrics below;
      choice_legal bool[B, L, C] with choice_tokens int32[C]: at each position, which choices are legal,
        and the token that spells each (`TextTables.choice_tokens`); for `illegal_choice_prob`;
      choice_set int8[B, L] with choice_sets bool[K, V] (constrained replies: `Trajectory.choice_set` and
        `tables.reply_template.sets`): a token with choice_set[b, t] = k >= 0 was sampled from the logits
        restricted to set k, so its log-prob is recomputed the same way: the logits that predict it are
        `generate.restrict_logits`-ed (-inf outside the set) before the log-softmax, in the policy's, the
        reference's and the decision metrics' forwards alike.
    Runs passes * num_minibatches optimizer steps (`algos.update.minibatch_update`); each minibatch's loss
    is `grpo_loss` over its rows (its own token count / row count as normalisers, shared by its
    micro-batches, so accumulation is exact). Without `advantages`, the episode advantages of `rewards`
    (`episode_advantages`: `GrpoConfig.estimator`).
    A minibatch without signal (beta = 0 and every advantage on its loss tokens 0) takes no optimizer step:
    params and optimizer state (moments, step count) stay exactly as they were.
    Each micro-batch runs at its length bucket and the LM head only at the loss positions
    (`GrpoConfig.length_buckets`, `logits_at_loss_only`).
    Metrics (scalars): loss, grad_norm (global norm before the optimizer's clipping), the `grpo_loss`
    metrics, all averaged over the optimizer steps; grad_norm_max; optimizer_steps (taken);
    learning_rate (the mean rate of the steps taken, read from the optimizer state, when the optimizer
    injects it as `optim.make_optimizer` does; 0 when none was taken); reward_mean / reward_std;
    advantage_mean / advantage_std / advantage_min / advantage_max (over rows, or with per-token
    advantages over loss tokens); frac_zero_std_groups (groups whose rewards are all equal) and
    frac_groups_with_spread (the others); num_tokens (loss tokens of the batch); loss_tokens_cut (loss
    tokens past the K slots of `logits_at_loss_only`, 0 when max_completion_tokens bounds them).
    With decision_mask: decision_tokens; decision_policy_change, the mean |log pi_after - log pi_before|
    of the sampled decision tokens of the first `GrpoConfig.policy_change_rows` rows (NaN when 0), pi_after
    from one no-grad forward of those rows after the whole update (at the
    decision positions' buckets), pi_before the sampler's log-probs (the same params, the same temperature:
    the trajectory was sampled from the policy before this update); decision_entropy, and with
    choice_legal illegal_choice_prob (the probability mass on the illegal choices' tokens), over the
    decision tokens from the update's own forwards (each minibatch's before its optimizer step; rows a
    skip did not compute are not in them; NaN when none was computed).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    loss_mask = jnp.asarray(loss_mask, jnp.float32)
    sampler_logprobs = jnp.asarray(sampler_logprobs, jnp.float32)
    rewards = jnp.asarray(rewards, jnp.float32)
    group_size, temperature = check_step_args(group_size, temperature)
    check_batch(config, group_size, tokens, loss_mask, sampler_logprobs, rewards)
    advantages, decision_mask, choice_legal, choice_tokens, choice_set, choice_sets = check_extras(
        config, tokens.shape, advantages, decision_mask, choice_legal, choice_tokens, choice_set, choice_sets)
    use_ref = config.beta > 0
    if use_ref and ref_params is None:
        raise ValueError("GrpoConfig.beta > 0 needs ref_params (the frozen reference model)")
    if advantages is None:
        advantages = episode_advantages(config, rewards, group_size)
    if config.loss_on == "decision":
        loss_mask = loss_mask * decision_mask
    batch, length = tokens.shape
    data, slots = _update_data(config, tokens, loss_mask, sampler_logprobs, advantages, config.dense_gradient,
                               decision_mask, choice_legal, choice_set)
    schedule = UpdateSchedule(bucket_lengths(length, config.length_buckets), config.num_minibatches, config.passes,
                              config.grad_accum_steps, config.shuffle,
                              config.skip_zero_advantage and not config.dense_gradient)
    no_grad_logprobs = functools.partial(_bucketed_logprobs, module, config, temperature, slots, choice_sets,
                                         data=data, buckets=schedule.buckets)

    if use_ref:  # once per update
        data["ref"] = no_grad_logprobs(ref_params)
    loss_fn = functools.partial(_micro_loss, module, config, temperature, slots, batch // config.num_minibatches,
                                frozen, choice_sets, choice_tokens)
    params, opt_state, steps = minibatch_update(loss_fn, optimizer, schedule, params, opt_state, data, key,
                                                normalisers=lambda mb: jnp.sum(mb["mask"]))
    metrics, dec = step_metrics(config, steps)
    metrics.update(batch_metrics(group_size, rewards, advantages, loss_mask, data["mask"]))
    if "decision" in data:  # one no-grad forward of the measured rows after the update; before = the sampler's
        rows = min(config.policy_change_rows, batch)
        after = no_grad_logprobs(params if frozen is None else lora.join(frozen, params), rows) if rows else None
        metrics.update(decision_metrics(dec, data["decision"], after, data["sampler"]))
    return params, opt_state, metrics


def make_grpo_update(module, optimizer: optax.GradientTransformation, config: GrpoConfig, ref_params=None, *,
                     group_size: int, temperature: float) -> Callable[..., tuple[Any, Any, dict]]:
    """Compile-once update: `update(params, opt_state, tokens, loss_mask, sampler_logprobs, rewards, key,
    **extra) -> (params, opt_state, metrics)` (shapes, the optional keyword arguments `extra` and the
    metrics as in `grpo_update_step`; group_size and temperature, required, are its, checked here and
    fixed in the compiled update).

    module: a Flax LM, `module.apply({"params": p}, tokens) -> (logits[B, L, V], _)`; optimizer: e.g.
    `optim.make_optimizer(OptimConfig)`. params and opt_state are donated (do not reuse the arguments).
    ref_params: the frozen reference, needed iff config.beta > 0; it is copied here, so passing the
    initial policy params (which the update then donates) is safe. With beta == 0 it is ignored.
    The jitted function is `update.jitted(params, opt_state, ref_params, tokens, ...)`; inside a larger
    `jit` call `grpo_update_step` directly.
    """
    group_size, temperature = check_step_args(group_size, temperature)
    if config.beta > 0:
        if ref_params is None:
            raise ValueError("GrpoConfig.beta > 0 needs ref_params (the frozen reference model)")
        ref_params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), ref_params)
    else:
        ref_params = None
    jitted = jax.jit(functools.partial(grpo_update_step, module, optimizer, config, group_size=group_size,
                                       temperature=temperature), donate_argnums=(0, 1))

    def update(params, opt_state, tokens, loss_mask, sampler_logprobs, rewards, key, **extra):
        return jitted(params, opt_state, ref_params, tokens, loss_mask, sampler_logprobs, rewards, key, **extra)

    update.jitted = jitted
    return update


def update_from_trajectory(update: Callable, params, opt_state, trajectory, key: jax.Array):
    """`update` on a `rollout.Trajectory`: its tokens, loss_mask, logprobs (sampler) and reward."""
    return update(params, opt_state, trajectory.tokens, trajectory.loss_mask, trajectory.logprobs,
                  trajectory.reward, key)
