"""Environment throughput: the Tic-Tac-Toe env against pgx's tic_tac_toe and a pure-Python loop.

Every peer plays full games with the model side choosing uniformly among the legal moves; ours meets
the minimax opponent (mixture p, default 0.5) inside `step`, pgx's second player is the same random
policy. The figure is moves applied per second, both players' moves counted the same way for every
peer: the pieces on the final boards, summed over games, divided by the wall time of the whole-game
program. The JAX peers are each one jitted program (reset + a fixed-length scan, vmapped over the
batch: ours 5 model replies, each with the opponent's answer, pgx 9 plies), compiled and warmed up
first, timed with block_until_ready over several repeats (best and median reported).
The pure-Python peer plays our rules and the same opponent in plain Python at a smaller game count.

    python experiments/benchmarks/env_throughput.py            # batches 1 024, 4 096, 16 384
    python experiments/benchmarks/env_throughput.py --quick    # smoke run

The last line printed is one JSON object with the rates and the ratios per batch size.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import envs
from envs import tictactoe as ttt

MODEL_REPLIES = 5  # the most replies a complete game can need from the model (it may move first)


def _nth_legal_table() -> np.ndarray:
    """int32[512 * 9]: entry mask * 9 + r is the r-th legal cell of the 9-bit legal mask."""
    table = np.zeros((512, 9), np.int32)
    for mask in range(512):
        cells = [c for c in range(9) if mask >> c & 1]
        table[mask, : len(cells)] = cells
    return table.reshape(-1)


_NTH_LEGAL = _nth_legal_table()


def random_legal(word: jax.Array, legal: jax.Array) -> jax.Array:
    """uint32[B] random words, bool[B, 9] -> int32[B]: a uniform legal cell per row.

    The policy of both JAX peers: the legal cells as a 9-bit mask, r = floor(u * #legal) for u the word's top 24 bits as a fraction, and the r-th
    legal cell read from a 512 x 9 table. The words of a whole game come from one jax.random.bits call
    up front, so the policy stays cheap next to either environment and the figures measure the games.
    """
    mask = (legal.astype(jnp.int32) << jnp.arange(9, dtype=jnp.int32)).sum(-1)
    r = ((word >> 8) * jax.lax.population_count(mask).astype(jnp.uint32)) >> 24  # floor(u * #legal)
    return jnp.asarray(_NTH_LEGAL)[mask * 9 + r.astype(jnp.int32)]


ENV = ttt.TicTacToe()


@functools.partial(jax.jit, static_argnums=(1, 2))
def play_ours(key: jax.Array, batch: int, p: float) -> jax.Array:
    """Full games of the Tic-Tac-Toe env through the protocol (`env.reset` / `env.step` with parsed
    replies, as a rollout calls them) -> int32[]: moves applied (pieces on the final boards)."""
    seed_key, move_key = jax.random.split(key)
    examples = ttt.Example(jax.random.bits(seed_key, (batch,), jnp.uint32), jnp.full((batch,), p, jnp.float32))
    state = jax.vmap(ENV.reset, in_axes=(0, None))(examples, ENV.params)

    def reply(state, word):
        moves = random_legal(word, ttt.legal_moves(state.board))
        return jax.vmap(ENV.step, in_axes=(0, 0, None))(state, envs.ParsedReply.of(moves), ENV.params), None

    words = jax.random.bits(move_key, (MODEL_REPLIES, batch), jnp.uint32)
    state, _ = jax.lax.scan(reply, state, words)
    return (state.board != ttt.EMPTY).sum(dtype=jnp.int32)


def make_play_pgx():
    import pgx

    env = pgx.make("tic_tac_toe")

    @functools.partial(jax.jit, static_argnums=1)
    def play_pgx(key: jax.Array, batch: int) -> jax.Array:
        """Full games of pgx tic_tac_toe -> int32[]: moves applied (pieces on the final boards)."""
        init_key, move_key = jax.random.split(key)
        state = jax.vmap(env.init)(jax.random.split(init_key, batch))

        def ply(state, word):
            action = random_legal(word, state.legal_action_mask)
            return jax.vmap(env.step)(state, action), None

        words = jax.random.bits(move_key, (9, batch), jnp.uint32)
        state, _ = jax.lax.scan(ply, state, words)
        return (state._x.board >= 0).sum(dtype=jnp.int32)

    return play_pgx


def time_jax(fns: dict, repeats: int) -> dict:
    """Compile + warm up each `fn(key)`, then time them interleaved (so load on the machine hits
    every peer alike), repeats times each. Rates in moves per second: best and median over wall
    time, and best over process CPU time (all threads; steadier on a shared machine, since time the
    process is not running does not count)."""
    for fn in fns.values():
        jax.block_until_ready(fn(jax.random.PRNGKey(0)))
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for r in range(repeats):
        key = jax.random.PRNGKey(r + 1)
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            moves = int(jax.block_until_ready(fn(key)))
            wall[name].append(moves / (time.perf_counter() - start))
            cpu[name].append(moves / max(time.process_time() - start_cpu, 1e-9))
    return {
        name: {"best": max(wall[name]), "median": statistics.median(wall[name]), "cpu_best": max(cpu[name])}
        for name in fns
    }


# ---------------------------------------------------------------------------------------------------
# The pure-Python peer: our rules and opponent, one game at a time.

_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def _py_winner(board: list[int]) -> int:
    for a, b, c in _LINES:
        if board[a] != 0 and board[a] == board[b] == board[c]:
            return board[a]
    return 0


@functools.lru_cache(maxsize=None)
def _py_score(board: tuple[int, ...], player: int) -> int:
    free = board.count(0)
    w = _py_winner(list(board))
    if w:
        return (1 + free) if w == player else -(1 + free)
    if free == 0:
        return 0
    return max(-_py_score(board[:c] + (player,) + board[c + 1 :], 3 - player) for c in range(9) if board[c] == 0)


def _py_opponent(board: list[int], rng: random.Random, p: float) -> int:
    free = [c for c in range(9) if board[c] == 0]
    if rng.random() < p:
        return rng.choice(free)
    t = tuple(board)
    scores = {c: -_py_score(t[:c] + (2,) + t[c + 1 :], 1) for c in free}
    best = max(scores.values())
    return rng.choice([c for c, s in scores.items() if s == best])


def play_python(games: int, p: float, seed: int) -> int:
    """Full games in plain Python (random legal model moves) -> moves applied."""
    rng = random.Random(seed)
    moves = 0
    for _ in range(games):
        board = [0] * 9
        if rng.random() < 0.5:
            board[_py_opponent(board, rng, p)] = 2
        while True:
            board[rng.choice([c for c in range(9) if board[c] == 0])] = 1
            if _py_winner(board) or 0 not in board:
                break
            board[_py_opponent(board, rng, p)] = 2
            if _py_winner(board) or 0 not in board:
                break
        moves += 9 - board.count(0)
    return moves


def time_python(games: int, p: float, repeats: int) -> dict:
    play_python(max(games // 10, 10), p, seed=0)  # warm up the minimax memo
    rates = []
    for r in range(repeats):
        start = time.perf_counter()
        moves = play_python(games, p, seed=r + 1)
        rates.append(moves / (time.perf_counter() - start))
    return {"best": max(rates), "median": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=200, help="timed repeats per peer and batch (best reported)")
    parser.add_argument("--p", type=float, default=0.5, help="opponent random_move_prob")
    parser.add_argument("--python-games", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.repeats, args.python_games = [256, 1024], 2, 100
    if not 0.0 <= args.p <= 1.0:
        raise ValueError(f"--p must lie in [0, 1], got {args.p}")

    play_pgx = make_play_pgx()
    python_rate = time_python(args.python_games, args.p, max(1, min(args.repeats, 3)))
    rows = []
    for batch in args.batches:
        timed = time_jax(
            {"ours": lambda k, b=batch: play_ours(k, b, args.p), "pgx": lambda k, b=batch: play_pgx(k, b)},
            args.repeats,
        )
        rows.append(dict(batch=batch, **timed))

    backend = jax.default_backend()
    print(f"Tic-Tac-Toe full random-play games, moves applied per second ({backend}, "
          f"{jax.device_count()} device(s), p = {args.p}, {args.repeats} repeats: best wall, median wall, "
          f"best per CPU second)")  # fmt: skip
    header = (f"{'batch':>7} | {'ours best':>12} {'ours med':>12} {'ours cpu':>12} | {'pgx best':>12} "
              f"{'pgx med':>12} {'pgx cpu':>12} | {'wall ratio':>10} {'cpu ratio':>9}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for row in rows:
        o, g = row["ours"], row["pgx"]
        print(f"{row['batch']:>7} | {o['best']:>12,.0f} {o['median']:>12,.0f} {o['cpu_best']:>12,.0f} | "
              f"{g['best']:>12,.0f} {g['median']:>12,.0f} {g['cpu_best']:>12,.0f} | "
              f"{o['best'] / g['best']:>9.2f}x {o['cpu_best'] / g['cpu_best']:>8.2f}x")  # fmt: skip
    print(f"pure Python ({args.python_games} games, one at a time): {python_rate['best']:,.0f} moves/s best")
    summary = {
        "benchmark": "env_throughput",
        "backend": backend,
        "p": args.p,
        "repeats": args.repeats,
        "python_moves_per_s": round(python_rate["best"]),
        "batches": {
            str(row["batch"]): {
                "ours_moves_per_s": round(row["ours"]["best"]),
                "pgx_moves_per_s": round(row["pgx"]["best"]),
                "ours_median_moves_per_s": round(row["ours"]["median"]),
                "pgx_median_moves_per_s": round(row["pgx"]["median"]),
                "ours_cpu_moves_per_s": round(row["ours"]["cpu_best"]),
                "pgx_cpu_moves_per_s": round(row["pgx"]["cpu_best"]),
                "ratio_vs_pgx": round(row["ours"]["best"] / row["pgx"]["best"], 3),
                "ratio_vs_pgx_cpu": round(row["ours"]["cpu_best"] / row["pgx"]["cpu_best"], 3),
                "ratio_vs_python": round(row["ours"]["best"] / python_rate["best"], 1),
            }
            for row in rows
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
