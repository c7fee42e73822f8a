"""The checks of `grpo.grpo_update_step`'s inputs: its group size and temperature, the batch's shapes,
and its optional per-token inputs (moved out of `algos.grpo`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # lazy: import cycle with algos.grpo (type hints only)
    from jaxrl_llm.algos.grpo_config import GrpoConfig


def check_step_args(group_size, temperature) -> tuple[int, float]:
    """The update's `group_size` (an int >= 2) and `temperature` (a finite number > 0), as Python int and
    float; a ValueError naming the argument otherwise."""
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, (bool, np.bool_)):
        raise ValueError(f"group_size must be an integer (completions per example), got {group_size!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (got {group_size}): a group of one has no baseline")
    if not isinstance(temperature, (int, float, np.integer, np.floating)) or isinstance(temperature, (bool, np.bool_)):
        raise ValueError(f"temperature must be a number (the sampler's), got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (got {temperature})")
    return int(group_size), float(temperature)


def check_batch(config: GrpoConfig, group_size: int, tokens, loss_mask, sampler_logprobs, rewards):
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, L], got shape {tokens.shape}")
    if loss_mask.shape != tokens.shape or sampler_logprobs.shape != tokens.shape:
        raise ValueError(
            f"tokens {tokens.shape}, loss_mask {loss_mask.shape} and sampler_logprobs {sampler_logprobs.shape} "
            "must have the same shape [B, L]"
        )
    batch = tokens.shape[0]
    if rewards.shape != (batch,):
        raise ValueError(f"rewards must be float32[{batch}], got shape {rewards.shape}")
    if batch % group_size:
        raise ValueError(f"batch {batch} is not a multiple of group_size {group_size}")
    if batch % config.micro_batches:
        raise ValueError(
            f"batch {batch} is not a multiple of num_minibatches * grad_accum_steps = "
            f"{config.num_minibatches} * {config.grad_accum_steps}"
        )


def check_extras(config: GrpoConfig, shape, advantages, decision_mask, choice_legal, choice_tokens,
                  choice_set=None, choice_sets=None):
    """The optional per-token inputs of `grpo_update_step`, as float32 / bool / int32 / int8 arrays (or None)."""
    batch, length = shape
    if (choice_set is None) != (choice_sets is None):
        raise ValueError("choice_set (the trajectory's, int8[B, L]) and choice_sets (bool[K, V], "
                         "tables.reply_template.sets) go together: constrained replies need both")
    if choice_set is not None:
        choice_set = jnp.asarray(choice_set, jnp.int8)
        choice_sets = jnp.asarray(choice_sets, bool)
        if choice_set.shape != (batch, length):
            raise ValueError(f"choice_set must be int8[{batch}, {length}], got shape {choice_set.shape}")
        if choice_sets.ndim != 2:
            raise ValueError(f"choice_sets must be bool[K, V], got shape {choice_sets.shape}")
    if advantages is not None:
        advantages = jnp.asarray(advantages, jnp.float32)
        if advantages.shape not in ((batch,), (batch, length)):
            raise ValueError(f"advantages must be float32[{batch}] or float32[{batch}, {length}], got shape "
                             f"{advantages.shape}")
    if decision_mask is not None:
        decision_mask = jnp.asarray(decision_mask, jnp.float32)
        if decision_mask.shape != (batch, length):
            raise ValueError(f"decision_mask must be float32[{batch}, {length}], got shape {decision_mask.shape}")
    if config.loss_on == "decision" and decision_mask is None:
        raise ValueError("GrpoConfig.loss_on = 'decision' needs decision_mask (the trajectory's decision tokens)")
    if choice_legal is not None:
        if choice_tokens is None:
            raise ValueError("choice_legal needs choice_tokens (int32[C], the token of each choice)")
        choice_tokens = jnp.asarray(choice_tokens, jnp.int32)
        choice_legal = jnp.asarray(choice_legal, bool)
        if choice_legal.shape != (batch, length, choice_tokens.shape[0]):
            raise ValueError(f"choice_legal must be bool[{batch}, {length}, {choice_tokens.shape[0]}] (C from "
                             f"choice_tokens), got shape {choice_legal.shape}")
        if choice_tokens.shape[0] == 0:
            choice_legal = choice_tokens = None
    return advantages, decision_mask, choice_legal, choice_tokens, choice_set, choice_sets
