"""The `jaxrl-llm` command line.

`jaxrl-llm demo` plays a batch of Tic-Tac-Toe games on the accelerator with the pure environment (a
uniformly random model side against the controlled minimax opponent) and prints the outcome table:
the default job until the training commands land.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    """Random legal play against the opponent at each strength; prints W/D/L and games/s."""
    import jax

    from jaxrl_llm.random_play import play_random_games

    print(f"JAX {jax.__version__} on {jax.devices()[0].platform}: {args.games} games per opponent strength")
    print(f"{'opponent p':>10} | {'W %':>6} {'D %':>6} {'L %':>6} | {'games/s':>12}")
    rows = []
    for p in args.p:
        key = jax.random.PRNGKey(args.seed)
        play_random_games(key, args.games, p)  # compile
        start = time.perf_counter()
        result = play_random_games(key, args.games, p)
        elapsed = time.perf_counter() - start
        row = {"p": p, **result, "games_per_s": args.games / elapsed}
        rows.append(row)
        print(
            f"{p:>10.2f} | {100 * row['win']:6.1f} {100 * row['draw']:6.1f} {100 * row['loss']:6.1f} "
            f"| {row['games_per_s']:12.0f}"
        )
    print("(p = 1 is the random opponent, p = 0 the optimal one; a random mover never beats the optimal one.)")
    print(json.dumps({"demo": rows}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-llm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="play random games against the minimax opponent on device")
    demo.add_argument("--games", type=_positive_int, default=16384, help="games per opponent strength")
    demo.add_argument("--p", type=_probability, nargs="+", default=[1.0, 0.5, 0.0], help="opponent random-move probabilities")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxrl-llm` script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
