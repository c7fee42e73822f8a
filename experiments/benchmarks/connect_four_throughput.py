"""Connect Four throughput: random-play moves/s, our bitboard rules vs pgx's `connect_four`, at 1 024 / 4 096 /
16 384 games in the same run, and our search opponent's cost per move at depth 2 and 4.

    python experiments/benchmarks/connect_four_throughput.py [--plies 42] [--repeats 3]

Both sides play whole random games (uniform legal columns) as one jitted `lax.scan` over plies, vmapped over
games; a move is one ply of one live-or-finished game slot (both sides step every slot every ply, as a
batched simulator does). The search rows time `game.search_values` vmapped over 1 024 positions after 8
random plies, compiled at max_depth = depth. Machine facts first, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from envs.connect_four import game as c4


def _facts() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count()}


def _ours(n: int, plies: int):
    @jax.jit
    def run(key):
        def body(carry, k):
            mover, other = carry
            legal = jax.vmap(c4.legal_columns)(mover, other)
            col = jax.random.categorical(k, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)
            done = jax.vmap(c4.has_four)(other) | jax.vmap(c4.is_full)(mover, other)
            new, _ = jax.vmap(c4.play)(mover, other, jnp.where(done, -1, col))
            return (other, new), None

        z = jnp.zeros((n, 2), jnp.uint32)
        (a, b), _ = jax.lax.scan(body, (z, z), jax.random.split(key, plies))
        return a.sum() + b.sum()

    return run


def _pgx(n: int, plies: int):
    import pgx

    env = pgx.make("connect_four")

    @jax.jit
    def run(key):
        state = jax.vmap(env.init)(jax.random.split(key, n))

        def body(s, k):
            col = jax.random.categorical(k, jnp.where(s.legal_action_mask, 0.0, -jnp.inf)).astype(jnp.int32)
            return jax.vmap(env.step)(s, col), None

        s, _ = jax.lax.scan(body, state, jax.random.split(jax.random.fold_in(key, 1), plies))
        return s._x.board.sum()

    return run


def _time(fn, repeats: int) -> float:
    jax.block_until_ready(fn(jax.random.PRNGKey(0)))  # compile
    best = float("inf")
    for r in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(jax.random.PRNGKey(r + 1)))
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plies", type=int, default=42)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    facts = _facts()
    print(json.dumps(facts))
    out = {"machine": facts, "random_play": [], "search": []}
    for n in (1024, 4096, 16384):
        ours, theirs = _time(_ours(n, args.plies), args.repeats), _time(_pgx(n, args.plies), args.repeats)
        row = {"games": n, "ours_moves_per_s": n * args.plies / ours, "pgx_moves_per_s": n * args.plies / theirs,
               "ratio_ours_over_pgx": theirs / ours}
        out["random_play"].append(row)
        print(f"{n:6d} games: ours {row['ours_moves_per_s']:.3g} moves/s, pgx {row['pgx_moves_per_s']:.3g} moves/s, "
              f"ratio {row['ratio_ours_over_pgx']:.2f}", flush=True)
    m = 1024
    key = jax.random.PRNGKey(5)
    mover = other = jnp.zeros((m, 2), jnp.uint32)
    for k in jax.random.split(key, 8):  # 8 random plies (a finished game just keeps its board)
        legal = jax.vmap(c4.legal_columns)(mover, other)
        col = jax.random.categorical(k, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)
        new, _ = jax.vmap(c4.play)(mover, other, col)
        mover, other = other, new
    for depth in (2, 4):
        fn = lambda key, d=depth: c4.search_values_batch(mover, other, jnp.full(m, d, jnp.int32), d)  # noqa: E731
        s = _time(fn, args.repeats)
        row = {"depth": depth, "positions": m, "us_per_move": 1e6 * s / m, "moves_per_s": m / s}
        out["search"].append(row)
        print(f"search depth {depth}: {row['us_per_move']:.1f} us per move ({m} positions batched)", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
