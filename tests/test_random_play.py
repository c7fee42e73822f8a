"""The protocol's random player (`envs.random_play`, `Env.random_reply`) and `jaxrl-llm demo`.

Tic-Tac-Toe's random-vs-random rates are checked against an exact host computation over the game tree
(independent of the env: plain lists and the reference winner), the other envs against invariants.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

import envs
from envs.random_play import play_random
from jaxrl_llm.cli.main import main
from nim_env import Nim
from reference_tictactoe import ref_winner

GAMES = 16384


@functools.lru_cache(maxsize=None)
def _random_vs_random(board: tuple, model_to_move: bool) -> tuple[float, float, float]:
    """Exact (win, draw, loss) of the model (X = 1) when both sides play uniformly random free cells."""
    w = ref_winner(board)
    if w:
        return (1.0, 0.0, 0.0) if w == 1 else (0.0, 0.0, 1.0)
    free = [i for i, v in enumerate(board) if v == 0]
    if not free:
        return (0.0, 1.0, 0.0)
    total = np.zeros(3)
    for i in free:
        nxt = list(board)
        nxt[i] = 1 if model_to_move else 2
        total += _random_vs_random(tuple(nxt), not model_to_move)
    return tuple(total / len(free))


def test_tictactoe_random_player_matches_the_exact_rates():
    env = envs.make("tictactoe")
    rates = play_random(env, jax.random.PRNGKey(0), GAMES, env.eval_settings()[0].stage)  # "random": p = 1
    exact = 0.5 * (np.array(_random_vs_random((0,) * 9, True)) + np.array(_random_vs_random((0,) * 9, False)))
    sigma = np.sqrt(exact * (1 - exact) / GAMES)
    got = np.array([rates["win"], rates["draw"], rates["loss"]])
    assert np.all(np.abs(got - exact) < 5 * sigma), (got, exact)
    assert rates["invalid"] == rates["missing"] == rates["unfinished"] == 0.0


def test_a_random_player_never_beats_the_optimal_opponent():
    env = envs.make("tictactoe")
    rates = play_random(env, jax.random.PRNGKey(1), 4096, env.eval_settings()[1].stage)  # "optimal": p = 0
    assert rates["win"] == 0.0 and rates["loss"] > 0.8 and rates["unfinished"] == 0.0


def test_connect_four_random_games_end_legally():
    env = envs.make("connect_four", max_depth=2)
    for setting in env.eval_settings():
        rates = play_random(env, jax.random.PRNGKey(2), 1024, setting.stage)
        assert rates["win"] + rates["draw"] + rates["loss"] + rates["unfinished"] == pytest.approx(1.0)
        assert rates["invalid"] == rates["missing"] == rates["unfinished"] == 0.0
        assert 4 <= rates["turns"] <= 21
    assert play_random(env, jax.random.PRNGKey(2), 1024, env.eval_settings()[-1].stage)["win"] < 0.2


def test_the_default_random_reply_draws_from_the_grammar():
    arithmetic = envs.make("arithmetic")
    rates = play_random(arithmetic, jax.random.PRNGKey(3), 2048, arithmetic.eval_settings()[0].stage)
    assert rates["turns"] == 1.0 and rates["invalid"] == 0.0 and rates["exact"] < 0.01
    nim = Nim(Nim.Params())  # a test env that does not override random_reply
    rates = play_random(nim, jax.random.PRNGKey(4), 512, nim.eval_settings()[0].stage)
    assert rates["turns"] >= 1.0


def test_the_demo_command_prints_each_setting_and_names_bad_input(capsys):
    assert main(["demo", "tictactoe", "--games", "256"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["setting"] for row in last["demo"]] == ["random", "optimal"]
    assert all(row["games_per_s"] > 0 for row in last["demo"])
    assert main(["demo", "no_such_env"]) == 2
    assert "registered" in capsys.readouterr().err
    assert main(["demo", "tictactoe", "--set", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
