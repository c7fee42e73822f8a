"""Baseline players in the evaluation's setting (1 000 games per opponent, first mover from the seed).

    python experiments/baselines.py [--games 1000] [--seed 0]

Players: a uniformly random legal mover, the minimax player drawing uniformly among optimal moves, and the
`best` teacher (optimal moves, the one that wins most often against the random opponent). They play on
device with `teacher.expert_games_device` (the game's own `step` and opponent). They never write
text, so there is no format column and no invalid move. Prints a results table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from envs.tictactoe import game as ttt
from envs.tictactoe.env import TicTacToe, outcome_rates
from envs.tictactoe.teacher import expert_games_device
from jaxrl_llm.metrics import format_results_table

PLAYERS = {"random legal mover": ("uniform", 1.0), "minimax (uniform)": ("uniform", 0.0),
           "minimax (best tie-break)": ("best", 0.0)}
OPPONENTS = {"random": 1.0, "optimal": 0.0}


def baseline_results(games: int = 1000, seed: int = 0) -> dict[str, dict[str, dict[str, float]]]:
    """{player: {opponent: {games, win, draw, loss}}} from `games` games per pair."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for i, (name, (teacher, explore)) in enumerate(PLAYERS.items()):
        out[name] = {}
        for j, (opponent, p) in enumerate(OPPONENTS.items()):
            key = jax.random.fold_in(jax.random.PRNGKey(seed), 10 * i + j)
            g = expert_games_device(key, games, jnp.float32(explore), jnp.float32(p), jnp.float32(p), 8, teacher)
            rates = outcome_rates(g.outcome, g.outcome != ttt.OUTCOME_ONGOING)
            out[name][opponent] = {"games": games, **{k: rates[k] for k in ("win", "draw", "loss")}}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="baseline players vs the random and optimal opponents")
    parser.add_argument("--games", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.games < 1:
        parser.error("--games must be >= 1")
    results = baseline_results(args.games, args.seed)
    rows = [{"model": f"{name} vs {opp}", **r, "format": float("nan"), "invalid": 0.0}
            for name, by_opp in results.items() for opp, r in by_opp.items()]
    print(format_results_table(rows, TicTacToe.results_columns))
    print(json.dumps({"baselines": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
