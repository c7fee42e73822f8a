"""Optimizers for SFT and GRPO: optax AdamW with warmup, a decay schedule and global-norm clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax

from jaxrl_llm.checks import ConfigError, check_choice, check_float, check_int

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then `schedule` ("cosine", "linear" or "constant") down to
    `end_lr_ratio * learning_rate` at `total_steps` (None: the run's number of optimizer updates);
    gradients clipped to `max_grad_norm` (0 disables). The `[sft.optim]` and `[grpo.optim]` tables.

    warmup_steps and total_steps count optimizer updates, the unit the schedule is applied in: one per
    SFT step; `passes * num_minibatches` per GRPO step (a GRPO stage's default total is
    `steps * passes * num_minibatches`). The rate applied is in the optimizer state
    (`applied_learning_rate`)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self):
        check_float(self, "learning_rate", low=0.0, low_open=True)
        check_int(self, "warmup_steps", 0)
        if self.total_steps is not None:
            check_int(self, "total_steps", 1)
        check_choice(self, "schedule", SCHEDULES)
        check_float(self, "end_lr_ratio", 0.0, 1.0)
        check_float(self, "weight_decay", low=0.0)
        check_float(self, "b1", 0.0, 1.0, high_open=True)
        check_float(self, "b2", 0.0, 1.0, high_open=True)
        check_float(self, "eps", low=0.0, low_open=True)
        check_float(self, "max_grad_norm", low=0.0)

    def for_steps(self, steps: int) -> "OptimConfig":
        """This config with total_steps resolved: its own, else `steps` (at least 1)."""
        if self.total_steps is not None:
            return self
        return dataclasses.replace(self, total_steps=max(int(steps), 1))


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    """Step -> learning rate: linear warmup from 0, then the configured decay (total_steps must be set:
    `config.for_steps(steps)`)."""
    if config.total_steps is None:
        raise ConfigError("is not set: resolve it with OptimConfig.for_steps(steps) first", ("total_steps",),
                          "OptimConfig")
    peak, end = config.learning_rate, config.learning_rate * config.end_lr_ratio
    decay_steps = max(config.total_steps - config.warmup_steps, 1)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.end_lr_ratio)
    elif config.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if config.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
    return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """optax chain: clip by global norm (if set) -> AdamW on the schedule, its learning rate injected into
    the state (`optax.inject_hyperparams`) so that the rate each update applied can be read back
    (`applied_learning_rate`)."""
    parts = []
    if config.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2", "eps", "weight_decay"))
    parts.append(
        adamw(
            learning_rate=learning_rate_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    )
    return optax.chain(*parts)


def applied_learning_rate(opt_state) -> jax.Array | None:
    """The learning rate the last update applied (float32 scalar), read from an optimizer state with an
    injected `learning_rate` (`make_optimizer`'s; before any update: the first update's); None when the
    state has none (e.g. a plain `optax.adam`)."""
    is_injected = lambda x: isinstance(getattr(x, "hyperparams", None), dict)  # noqa: E731
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=is_injected):
        if is_injected(node) and "learning_rate" in node.hyperparams:
            return node.hyperparams["learning_rate"]
    return None


def global_norm(tree) -> jax.Array:
    """The global L2 norm of a pytree (optax.tree.norm where it exists, optax.global_norm before)."""
    norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
    return norm(tree)
