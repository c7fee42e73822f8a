"""The GRPO update's metrics: per-token means of the loss's sums, the per-step figures, the batch's
rewards and advantages, and the decision-token metrics (moved out of `algos.grpo`; see
`grpo.grpo_update_step` for what each metric means).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxrl_llm.algos.token_logprobs import logits_entropy

if TYPE_CHECKING:  # lazy: import cycle with algos.grpo (type hints only)
    from jaxrl_llm.algos.grpo_config import GrpoConfig


def finish_metrics(sums: dict, with_entropy: bool) -> dict:
    """Per-token means from the sums of `_loss_and_sums`."""
    n = jnp.maximum(sums["tokens"], 1.0)
    metrics = {
        "num_tokens": sums["tokens"],
        "clip_frac_low": sums["clip_low"] / n,
        "clip_frac_high": sums["clip_high"] / n,
        "clip_frac": (sums["clip_low"] + sums["clip_high"]) / n,
        "ratio_mean": sums["ratio"] / n,
        "kl": sums["kl"] / n,
        "ratio_masked_frac": sums["ratio_masked"] / n,
    }
    if with_entropy:
        metrics["entropy"] = sums["entropy"] / n
    return metrics


def decision_sums(logits: jax.Array, micro: dict, kb: int, choice_tokens) -> dict:
    """Entropy and illegal-choice mass summed over a micro-batch's decision slots, without gradient
    (logits float32[R, kb, V]; {} without `decision` in micro, no illegal mass without `legal`)."""
    if "decision" not in micro:
        return {}
    logits = jax.lax.stop_gradient(logits)
    d = micro["decision"][:, :kb]
    out = {"dec_n": jnp.sum(d), "dec_entropy": jnp.sum(d * logits_entropy(logits))}
    if "legal" in micro:
        logz = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        p_choice = jnp.exp(logits[..., choice_tokens] - logz)  # [R, kb, C]
        out["dec_illegal"] = jnp.sum(d * jnp.sum(jnp.where(micro["legal"][:, :kb], 0.0, p_choice), axis=-1))
    return out


def step_metrics(config: GrpoConfig, steps: dict) -> tuple[dict, dict]:
    """The figures of `update.minibatch_update`'s steps -> (metrics, decision sums over the whole update).

    metrics: the `grpo_loss` metrics, loss and grad_norm averaged over the optimizer steps; grad_norm_max;
    optimizer_steps (taken); learning_rate (the mean rate of the steps taken) when the optimizer logs it.
    """
    steps = dict(steps)
    taken = jnp.sum(steps.pop("optimizer_step"))
    rate = steps.pop("learning_rate", None)
    dec = {k: jnp.sum(steps.pop(k)) for k in list(steps) if k.startswith("dec_")}
    per_step = finish_metrics(steps, config.compute_entropy)
    per_step.pop("num_tokens")
    per_step.update(loss=steps["loss"], grad_norm=steps["grad_norm"])
    metrics = {k: jnp.mean(v) for k, v in per_step.items()}
    metrics.update(grad_norm_max=jnp.max(steps["grad_norm"]), optimizer_steps=taken)
    if rate is not None:
        metrics["learning_rate"] = jnp.sum(rate) / jnp.maximum(taken, 1.0)
    return metrics, dec


def advantage_stats(advantages: jax.Array, loss_mask: jax.Array) -> dict:
    """advantage_mean / _std / _min / _max: over rows (float32[B]) or over loss tokens (float32[B, L])."""
    if advantages.ndim == 1:
        stats = (jnp.mean(advantages), jnp.std(advantages), jnp.min(advantages), jnp.max(advantages))
    else:
        on = loss_mask > 0
        n_on = jnp.maximum(jnp.sum(on), 1)
        mean = jnp.sum(jnp.where(on, advantages, 0.0)) / n_on
        std = jnp.sqrt(jnp.sum(jnp.where(on, (advantages - mean) ** 2, 0.0)) / n_on)
        stats = (mean, std, jnp.min(jnp.where(on, advantages, jnp.inf)), jnp.max(jnp.where(on, advantages, -jnp.inf)))
    return dict(zip(("advantage_mean", "advantage_std", "advantage_min", "advantage_max"), stats))


def batch_metrics(group_size: int, rewards, advantages, loss_mask, slot_mask) -> dict:
    """The batch's figures: rewards, advantages, groups (of group_size rows) without spread, loss tokens (and
    those past the slots)."""
    grouped = rewards.reshape(-1, group_size)
    zero_std = jnp.mean(jnp.all(grouped == grouped[:, :1], axis=1).astype(jnp.float32))
    return {"reward_mean": jnp.mean(rewards), "reward_std": jnp.std(rewards), **advantage_stats(advantages, loss_mask),
            "frac_zero_std_groups": zero_std, "frac_groups_with_spread": 1.0 - zero_std,
            "num_tokens": jnp.sum(loss_mask), "loss_tokens_cut": jnp.sum(loss_mask) - jnp.sum(slot_mask)}


def decision_metrics(dec: dict, decision, after, before) -> dict:
    """decision_tokens (of decision float32[B, K]), decision_policy_change (mean |after - before| log-prob
    over the decision slots of the first R rows, after float32[R, K]; NaN when after is None or those rows
    have no decision token), decision_entropy and illegal_choice_prob (from the sums `dec`; NaN when no
    micro-batch was computed)."""
    seen = jnp.where(dec["dec_n"] > 0, dec["dec_n"], jnp.nan)
    change = jnp.float32(jnp.nan)
    if after is not None:
        measured = decision[: after.shape[0]]
        n_measured = jnp.sum(measured)
        change = jnp.where(n_measured > 0, jnp.sum(measured * jnp.abs(after - before[: after.shape[0]]))
                           / jnp.maximum(n_measured, 1.0), jnp.nan)
    out = {"decision_tokens": jnp.sum(decision), "decision_policy_change": change,
           "decision_entropy": dec["dec_entropy"] / seen}
    if "dec_illegal" in dec:
        out["illegal_choice_prob"] = dec["dec_illegal"] / seen
    return out
