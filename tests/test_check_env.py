"""`envs.check_env` (issue 31 section 2): the built-in envs and the example user env pass; an env that breaks
each rule of the protocol fails with the method named and what it returned; `jaxrl-llm check-env NAME`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

import envs
from envs.check import EnvCheckError, check_env
from jaxrl_llm.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def guess(request):
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "guess_env"))
    request.addfinalizer(lambda: sys.path.remove(str(ROOT / "examples" / "guess_env")))
    from guess_env import env

    return env


@pytest.mark.parametrize("name", ["tictactoe", "arithmetic", "connect_four"])
def test_builtin_envs_pass(name):
    passed = check_env(envs.make(name), max_turns=4)
    assert len(passed) == 6


def test_example_env_passes(guess):
    passed = check_env(guess.GuessNumber(), max_turns=8)
    assert any("8 of 8 games finished" in p for p in passed)


def _failures(env, **kw) -> list[str]:
    with pytest.raises(EnvCheckError) as info:
        check_env(env, max_turns=8, **kw)
    assert str(len(info.value.failures)) in str(info.value)
    return info.value.failures


def test_wrong_number_of_message_codes(guess):
    class TwoCodes(guess.GuessNumber):
        def message_codes(self, state, params):
            return jnp.stack([state.status, state.status])

    (failure,) = _failures(TwoCodes())
    assert failure.startswith("message_codes after reset returned int32[2]") and "expected int32[1]" in failure


def test_message_code_out_of_range(guess):
    class OutOfRange(guess.GuessNumber):
        def message_codes(self, state, params):
            return (state.status + 7)[None]

    failures = _failures(OutOfRange())
    assert "message_codes after reset returned code 7 for slot 'status', which has 7 pieces" in failures[0]


def test_a_finished_game_that_changes(guess):
    class Restless(guess.GuessNumber):
        def step(self, state, reply, params):
            new = super().step(state, reply, params)
            return new._replace(guesses=jnp.where(state.done, state.guesses + 1, new.guesses))

    (failure,) = _failures(Restless())
    assert failure.startswith("step changed a finished game: state.guesses went from")


def test_step_that_changes_dtype(guess):
    class Float(guess.GuessNumber):
        def step(self, state, reply, params):
            return super().step(state, reply, params)._replace(guesses=jnp.float32(1.0) * 0 + 1.0)

    (failure,) = _failures(Float())
    assert failure.startswith("step returned") and "keep the state's structure, shapes and dtypes" in failure


def test_step_that_is_not_jittable(guess):
    class HostOnly(guess.GuessNumber):
        def step(self, state, reply, params):
            if bool(reply.found):  # a Python branch on a traced value
                return state
            return state

    (failure,) = _failures(HostOnly())
    assert failure.startswith("step is not jittable and vmappable")


def test_rubric_part_missing_and_undeclared_mean(guess):
    class Broken(guess.GuessNumber):
        metric_kinds = {}

        def rubric(self, params):
            return (envs.RubricPart("solved", 1.0), envs.RubricPart("speed", 0.5))

    failures = _failures(Broken())
    assert any(f.startswith("reward_parts returned parts ['format', 'solved'] but the rubric names ['speed']")
               for f in failures)
    assert any(f.startswith("metrics returned 'guesses' =") and "outside [0, 1]" in f
               and "metric_kinds = {'guesses': 'mean'}" in f for f in failures)


def test_unknown_metric_kind(guess):
    class BadKind(guess.GuessNumber):
        metric_kinds = {"guesses": "count"}

    (failure,) = _failures(BadKind())
    assert failure.startswith("metric_kinds {'guesses': 'count'}")


def test_reward_params_that_are_not_params_fields(guess):
    class BadRewardParams(guess.GuessNumber):
        reward_params = ("win_weight",)

    (failure,) = _failures(BadRewardParams())
    assert failure.startswith("reward_params names ['win_weight'], which are not fields of the env's Params")


def test_cli_check_env(guess, capsys):
    assert main(["check-env", "guess_env.env:GuessNumber", "--max-turns", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok: ") == 6 and "passes every check" in out
    assert main(["check-env", "tictactoee"]) == 2
    assert "did you mean 'tictactoe'" in capsys.readouterr().err
