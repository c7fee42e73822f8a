"""Whole games of a random player through the protocol, on device: the demo and the random baselines.

    import envs, jax
    from envs.random_play import play_random
    env = envs.make("connect_four")
    rates = play_random(env, jax.random.PRNGKey(0), 4096, env.eval_settings()[0].stage)   # {"win": 0.97, ...}

Each game is reset from `env.eval_examples`, then `env.random_reply` answers every message until the env
says done or `max_turns` replies were made (a finished game is never stepped again). The result is the
mean of each of `env.metrics` over the games that have it (host floats), plus "turns" (replies per game). No model, no
text: this measures the environment and its opponent alone.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import Env, Episode


@functools.partial(jax.jit, static_argnames=("env", "num_games", "stage", "max_turns"))
def random_games(env: Env, key: jax.Array, num_games: int, stage: Any, max_turns: int = 64):
    """Plays `num_games` games of `stage` with `env.random_reply`: (final states, Episode), batched [num_games].

    The loop ends when every game is done or after `max_turns` replies; the episodes' format score is 1
    for a game with a reply (the random replies are well formed), `truncated` marks the unfinished games.
    """
    params = env.params
    example_key, play_key = jax.random.split(key)
    examples = env.eval_examples(example_key, num_games, stage)
    state = jax.vmap(lambda e: env.reset(e, params))(examples)
    turns = jnp.zeros((num_games,), jnp.int32)

    def reply_all(carry):
        state, turns, step = carry
        keys = jax.random.split(jax.random.fold_in(play_key, step), num_games)
        live = ~jax.vmap(env.done)(state)
        replies = jax.vmap(lambda k, s: env.random_reply(k, s, params))(keys, state)
        moved = jax.vmap(lambda s, r: env.step(s, r, params))(state, replies)
        keep = lambda new, old: jnp.where(live.reshape(live.shape + (1,) * (new.ndim - 1)), new, old)
        return jax.tree_util.tree_map(keep, moved, state), turns + live.astype(jnp.int32), step + 1

    def going(carry):
        state, _, step = carry
        return (step < max_turns) & ~jnp.all(jax.vmap(env.done)(state))

    state, turns, _ = jax.lax.while_loop(going, reply_all, (state, turns, jnp.int32(0)))
    done = jax.vmap(env.done)(state)
    episode = Episode(format_score=(turns > 0).astype(jnp.float32), turns=turns, truncated=~done,
                      context_cut=jnp.zeros_like(done))
    return state, episode


def play_random(env: Env, key: jax.Array, num_games: int, stage: Any, max_turns: int = 64) -> dict[str, float]:
    """The means of `env.metrics` (and "turns") over `num_games` random-player games of `stage` (host floats)."""
    state, episode = random_games(env, key, num_games, stage, max_turns)
    metrics = jax.vmap(lambda s, e: env.metrics(s, e, env.params))(state, episode)
    metrics["turns"] = episode.turns.astype(jnp.float32)
    # A per-level metric is NaN on the games of other levels (e.g. arithmetic's exact_add2): its mean is over
    # the games that have it, and a metric that no game has is left out.
    means = {k: np.asarray(v, np.float64) for k, v in jax.device_get(metrics).items()}
    return {k: float(np.nanmean(v)) for k, v in means.items() if not np.isnan(v).all()}
