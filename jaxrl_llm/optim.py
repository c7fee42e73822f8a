"""Optimizers for SFT and GRPO: optax AdamW with warmup, a decay schedule and global-norm clipping."""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then `schedule` ("cosine", "linear" or "constant") down to
    `end_lr_ratio * learning_rate` at `total_steps`; gradients clipped to `max_grad_norm` (0 disables)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 0
    total_steps: int = 1000
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0 (got {self.learning_rate})")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1 (got {self.warmup_steps}, {self.total_steps})")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule must be 'cosine', 'linear' or 'constant' (got {self.schedule!r})")
        if not 0.0 <= self.end_lr_ratio <= 1.0:
            raise ValueError(f"end_lr_ratio must be in [0, 1] (got {self.end_lr_ratio})")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, 0 disables clipping (got {self.max_grad_norm})")


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    """Step -> learning rate: linear warmup from 0, then the configured decay."""
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
    """optax chain: clip by global norm (if set) -> AdamW on the schedule."""
    parts = []
    if config.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    )
    return optax.chain(*parts)
