"""Per-token advantages: the episode's group advantage, or per-turn credit from step groups (GiGPO).

Pure, jittable functions of a batch of B games in GRPO groups (rows i*G .. (i+1)*G - 1 answer the same
example) with T turn slots and L token positions. `token_advantages` is what the update uses; the
`[grpo.loss]` table selects it (`GrpoConfig.advantage`, `episode_weight`, `step_weight`, `step_discount`).

    "episode"  A[b, l] = A_E[b], the episode advantage of the game's reward on every token: today's GRPO
               (`grpo.group_advantages`), or RLOO's leave-one-out one with `GrpoConfig.estimator = "rloo"`
               (`grpo.rloo_advantages`; `grpo.episode_advantages` picks).
    "step"     A[b, l] = A_S[b, t] for a token of turn t (0 on the other tokens): the step advantage of
               the turn, after GiGPO (Feng et al. 2025, arXiv 2505.10978, "step-level groups"):
                 - the turn's return, with discount gamma = step_discount, the env's turn rewards r[b, k]
                   (`Env.turn_reward`) and the game's reward R[b] received at its last turn played
                   (n[b] turns played, turn indices 0 .. n[b] - 1):
                       G[b, t] = sum_{k = t}^{n[b] - 1} gamma^(k - t) r[b, k] + gamma^(n[b] - 1 - t) R[b];
                 - the step group of a turn: the turns of the same GRPO group (any game of it, the same
                   game included) played from the same state, i.e. with the same `Env.state_key`;
                 - A_S[b, t] = (G[b, t] - mean_S G) / (std_S G + std_eps) with `scale_rewards` "group"
                   (std_S the sample std, ddof 1, as `group_advantages`), G[b, t] - mean_S G with
                   "none"; exactly 0 when the turn's step group has one member or equal returns, and for
                   turns not played.
    "mix"      A[b, l] = episode_weight * A_E[b] + step_weight * A_S[b, t].

R already holds every part of the env's rubric (e.g. a board game's invalid part, once per game); the
turn rewards add the per-turn credit on top (a board game charges its invalid-move penalty to each turn
that made one), so a turn is compared with its step group by what it did and what followed it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.algos.grpo import GrpoConfig, episode_advantages


def turn_returns(rewards: jax.Array, turn_rewards: jax.Array, turn_played: jax.Array, discount: float) -> jax.Array:
    """Discounted per-turn returns: float32[B], float32[B, T], bool[B, T], gamma -> float32[B, T].

    G[b, t] = sum_{k=t}^{n-1} gamma^(k-t) r[b, k] + gamma^(n-1-t) R[b] for the played turns t < n (the
    played turns are a prefix 0 .. n-1 of each row, as the rollout records them); 0 for turns not played.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    turn_rewards = jnp.asarray(turn_rewards, jnp.float32)
    played = jnp.asarray(turn_played, bool)
    # The next turn's return, or the game's reward after its last turn; scanned from the last turn back.
    next_played = jnp.concatenate([played[:, 1:], jnp.zeros_like(played[:, :1])], axis=1)

    def back(later, xs):
        r, here, more = xs
        g = jnp.where(here, r + jnp.where(more, discount * later, rewards), 0.0)
        return g, g

    _, returns = jax.lax.scan(back, jnp.zeros_like(rewards), (turn_rewards.T, played.T, next_played.T), reverse=True)
    return returns.T


def step_advantages(returns: jax.Array, turn_keys: jax.Array, turn_played: jax.Array, group_size: int,
                    scale: str = "group", eps: float = 1e-4) -> jax.Array:
    """Step-group advantages: float32[B, T], uint32[B, T], bool[B, T] -> float32[B, T].

    A turn's step group: the played turns of its GRPO group (G = group_size consecutive rows) with its
    state key. A = (G - mean) / (std + eps) ("group"; sample std, ddof 1) or G - mean ("none") over the
    step group; exactly 0 for a singleton step group, a group of equal returns and a turn not played.
    """
    batch, turns = returns.shape
    if batch % group_size:
        raise ValueError(f"batch {batch} is not a multiple of group_size {group_size}")
    n = group_size * turns
    g = jnp.asarray(returns, jnp.float32).reshape(-1, n)
    k = jnp.asarray(turn_keys).reshape(-1, n)
    on = jnp.asarray(turn_played, bool).reshape(-1, n)
    same = (k[:, :, None] == k[:, None, :]) & on[:, :, None] & on[:, None, :]  # [groups, n, n]
    count = same.sum(axis=2)
    mean = jnp.sum(jnp.where(same, g[:, None, :], 0.0), axis=2) / jnp.maximum(count, 1)
    # Equal returns give exactly 0 (their float mean may be an ulp off, which the std would blow up).
    spread = jnp.any(same & (g[:, None, :] != g[:, :, None]), axis=2)
    centred = jnp.where(spread, g - mean, 0.0)
    if scale == "group":
        dev = jnp.where(same, g[:, None, :] - mean[:, :, None], 0.0)
        std = jnp.sqrt(jnp.sum(dev**2, axis=2) / jnp.maximum(count - 1, 1))
        centred = centred / (std + eps)
    return jnp.where(on & (count > 1), centred, 0.0).reshape(batch, turns)


def per_token(turn_values: jax.Array, token_turn: jax.Array) -> jax.Array:
    """Each token's turn value: float32[B, T], int32[B, L] (turn index, -1 off the replies) -> float32[B, L]."""
    picked = jnp.take_along_axis(turn_values, jnp.clip(token_turn, 0, turn_values.shape[1] - 1), axis=1)
    return jnp.where(token_turn >= 0, picked, 0.0)


def token_advantages(config: GrpoConfig, rewards: jax.Array, turn_rewards: jax.Array, turn_keys: jax.Array,
                     turn_played: jax.Array, token_turn: jax.Array, group_size: int) -> jax.Array:
    """The advantage of every token (see the module docstring) -> float32[B, L].

    rewards float32[B] (the rubric's reward per game), turn_rewards float32[B, T], turn_keys uint32[B, T],
    turn_played bool[B, T] (`Trajectory.reply_kind >= 0`), token_turn int32[B, L]; config: its
    `advantage`, `estimator`, `episode_weight`, `step_weight`, `step_discount`, `scale_rewards` and `std_eps`.
    """
    episode = episode_advantages(config, rewards, group_size)
    length = token_turn.shape[1]
    if config.advantage == "episode":
        return jnp.broadcast_to(episode[:, None], (episode.shape[0], length))
    returns = turn_returns(rewards, turn_rewards, turn_played, config.step_discount)
    step = step_advantages(returns, turn_keys, turn_played, group_size, config.scale_rewards, config.std_eps)
    if config.advantage == "step":
        return per_token(step, token_turn)
    return config.episode_weight * episode[:, None] + config.step_weight * per_token(step, token_turn)


def step_metrics(config: GrpoConfig, rewards: jax.Array, turn_rewards: jax.Array, turn_keys: jax.Array,
                 turn_played: jax.Array, group_size: int) -> dict[str, jax.Array]:
    """Figures of the step groups (f32 scalars; arguments as `token_advantages`): `step_shared_frac`, the
    share of played turns whose state another turn of their GRPO group shares, and
    `step_advantage_nonzero_frac`, the share of played turns with a non-zero step advantage."""
    batch, turns = turn_keys.shape
    n = group_size * turns
    k = jnp.asarray(turn_keys).reshape(-1, n)
    on = jnp.asarray(turn_played, bool).reshape(-1, n)
    count = ((k[:, :, None] == k[:, None, :]) & on[:, :, None] & on[:, None, :]).sum(axis=2)
    returns = turn_returns(rewards, turn_rewards, turn_played, config.step_discount)
    step = step_advantages(returns, turn_keys, turn_played, group_size, config.scale_rewards, config.std_eps)
    played = jnp.maximum(on.sum(), 1)
    return {"step_shared_frac": (jnp.sum(on & (count > 1)) / played).astype(jnp.float32),
            "step_advantage_nonzero_frac": (jnp.sum(on.reshape(batch, turns) & (step != 0)) / played
                                            ).astype(jnp.float32)}


def advantage_inputs(config: GrpoConfig, traj, group_size: int) -> dict[str, jax.Array]:
    """The `advantages` keyword of `grpo_update_step` for a `rollout.Trajectory` in groups of group_size rows:
    {} with advantage "episode" (the update's own group advantages, today's path), else
    {"advantages": float32[B, L]} (`token_advantages`)."""
    if config.advantage == "episode":
        return {}
    return {"advantages": token_advantages(config, traj.reward, traj.turn_rewards, traj.turn_keys,
                                           traj.reply_kind >= 0, traj.token_turn, group_size)}


def advantage_metrics(config: GrpoConfig, traj, group_size: int) -> dict[str, jax.Array]:
    """`step_metrics` of a `rollout.Trajectory` (groups of group_size rows) with advantage "step" or "mix"; {}
    with "episode"."""
    if config.advantage == "episode":
        return {}
    return step_metrics(config, traj.reward, traj.turn_rewards, traj.turn_keys, traj.reply_kind >= 0, group_size)
