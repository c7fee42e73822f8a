"""Tests of the Tic-Tac-Toe game (envs.tictactoe.game) and its rubric (envs.tictactoe.env) against the
independent pure-Python reference (tests/reference_tictactoe.py)."""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs import tictactoe as ttt
from envs.tictactoe import game

sys.path.insert(0, os.path.dirname(__file__))
import reference_tictactoe as ref  # noqa: E402

ENV = ttt.TicTacToe()
PARAMS = ENV.params
NO_LIMIT = 10**6  # the game has no turn limit (the rollout has one): the reference gets none either

# Compiled once, reused by every test.
reset_j = jax.jit(ttt.reset)
step_j = jax.jit(ttt.step)
opponent_j = jax.jit(ttt.opponent_move)


def _episode(state, format_score):
    return envs.Episode(format_score=jnp.float32(format_score), turns=state.turns, truncated=~state.done,
                        context_cut=jnp.bool_(False))


@functools.partial(jax.jit, static_argnums=2)
def _reward(state, format_score, params):
    parts = ENV.reward_parts(state, _episode(state, format_score), params)
    return parts["win"], parts["invalid"], ENV.reward(state, _episode(state, format_score), params)


def reward_j(state, format_score, params=PARAMS):
    """(win part, invalid part, total) of the env's rubric for a final state."""
    return _reward(state, format_score, params)


@jax.jit
@jax.vmap
def analyse(board, player):
    """Everything the rules say about one (board, player to move), batched."""
    return dict(
        winner=ttt.winner(board),
        legal=ttt.legal_moves(board),
        optimal=ttt.optimal_moves(board, player),
        value=ttt.minimax_value(board, player),
        score=ttt.minimax_score(board, player),
        index=ttt.board_index(board),
        valid=ttt.valid_board(board),
    )


batched_opponent = jax.jit(jax.vmap(ttt.opponent_move))


def board_of(*moves: tuple[int, int]) -> np.ndarray:
    b = np.zeros(9, np.int8)
    for cell, player in moves:
        b[cell] = player
    return b


def host(state: ttt.State) -> dict:
    return {k: np.asarray(v) for k, v in state._asdict().items()}


# ---------------------------------------------------------------------------------------------------
# Minimax table vs the reference


def test_spec_consequences():
    out = analyse(
        jnp.asarray(np.stack([board_of(), board_of((4, ttt.X)), board_of((0, ttt.X)), board_of()])),
        jnp.array([ttt.O, ttt.O, ttt.O, ttt.X]),
    )
    optimal = np.asarray(out["optimal"])
    assert optimal[0].all() and optimal[3].all()  # empty board: every cell, for either player
    assert set(np.flatnonzero(optimal[1])) == {0, 2, 6, 8}  # X centre -> the corners
    assert set(np.flatnonzero(optimal[2])) == {4}  # X corner -> the centre only
    assert (np.asarray(out["value"]) == 0).all()  # all of these are draws under perfect play
    # The reference agrees, independently.
    assert all(ref.ref_optimal((0,) * 9, ref.O))
    assert {i for i, v in enumerate(ref.ref_optimal(tuple(int(v) for v in board_of((4, 1))), ref.O)) if v} == {0, 2, 6, 8}


def test_reachable_positions_match_reference():
    positions = ref.reachable_positions()
    assert 10_000 < len(positions) < 11_000  # 5 478 legal positions per starting player, overlapping
    boards = np.array([b for b, _ in positions], np.int8)
    players = np.array([p for _, p in positions], np.int32)
    out = {k: np.asarray(v) for k, v in analyse(jnp.asarray(boards), jnp.asarray(players)).items()}
    expected_winner = np.array([ref.ref_winner(b) for b, _ in positions])
    expected_legal = np.array([ref.ref_legal(b) for b, _ in positions])
    expected_optimal = np.array([ref.ref_optimal(b, p) for b, p in positions])
    expected_score = np.array([ref.ref_score(b, p) for b, p in positions])
    expected_value = np.array([ref.ref_value(b, p) for b, p in positions])
    expected_index = np.array([ref.ref_index(b) for b, _ in positions])
    np.testing.assert_array_equal(out["winner"], expected_winner)
    np.testing.assert_array_equal(out["legal"], expected_legal)
    np.testing.assert_array_equal(out["optimal"], expected_optimal)
    np.testing.assert_array_equal(out["score"], expected_score)
    np.testing.assert_array_equal(out["value"], expected_value)
    np.testing.assert_array_equal(out["index"], expected_index)
    assert out["valid"].all()
    assert out["winner"].dtype == np.int8 and out["value"].dtype == np.int8 and out["index"].dtype == np.int32
    # Every live position has at least one optimal move; finished ones have none.
    finished = np.array([ref.ref_finished(b) for b, _ in positions])
    assert (out["optimal"].any(1) == ~finished).all()


def test_table_is_cached_and_shaped():
    table = ttt.minimax_table()
    assert table.shape == (3**9, 2) and table.dtype == jnp.int8
    assert ttt.minimax_table() is table
    assert int(table[0, 0]) == 0 and int(table[0, 1]) == 0
    # X holds 0 and 1, O holds 4: X to move wins at once with 5 cells left free, scoring 1 + 5.
    b = board_of((0, ttt.X), (1, ttt.X), (4, ttt.O))
    idx = ref.ref_index(tuple(int(v) for v in b))
    assert int(table[idx, 0]) == ref.ref_score(tuple(int(v) for v in b), ref.X) == 1 + 5


# ---------------------------------------------------------------------------------------------------
# Malformed input has a defined result


def test_malformed_boards_and_players():
    bad = np.stack(
        [
            board_of((0, 3)),  # value out of range
            board_of((0, -1)),  # negative value
            board_of((0, 1), (1, 1), (2, 1)),  # #X - #O = 3
            board_of((0, 1), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2)),  # both have a line
        ]
    )
    out = analyse(jnp.asarray(bad), jnp.full((4,), ttt.O))
    assert not np.asarray(out["valid"]).any()
    assert not np.asarray(out["optimal"]).any()
    assert (np.asarray(out["value"]) == 0).all()
    idx = np.asarray(out["index"])
    assert ((idx >= 0) & (idx < 3**9)).all()
    assert not np.asarray(out["legal"])[0, 0] and not np.asarray(out["legal"])[1, 0]
    moves = np.asarray(batched_opponent(jnp.asarray(bad), jnp.zeros(4, jnp.uint32), jnp.zeros(4)))
    assert (moves == -1).all()
    # A player other than X or O: nothing optimal, value 0.
    out = analyse(jnp.zeros((3, 9), jnp.int8), jnp.array([0, 3, -1]))
    assert not np.asarray(out["optimal"]).any() and (np.asarray(out["value"]) == 0).all()
    # Finished board: the opponent has no move.
    full = board_of(*[(c, v) for c, v in enumerate([1, 2, 1, 1, 2, 2, 2, 1, 1])])
    assert int(opponent_j(jnp.asarray(full), jnp.uint32(3), 0.5)) == -1


def test_step_on_malformed_board_counts_invalid():
    state = reset_j(jnp.uint32(7), jnp.float32(0.0))
    state = state._replace(board=jnp.asarray(board_of((0, 1), (1, 1), (2, 1))))
    new = host(step_j(state, jnp.int32(5)))
    assert new["invalid_moves"] == 1 and new["status"] == ttt.STATUS_INVALID and not new["done"]
    np.testing.assert_array_equal(new["board"], np.asarray(state.board))
    new = host(step_j(state, jnp.int32(-1)))
    assert new["missing_moves"] == 1 and new["invalid_moves"] == 0


def test_step_on_decided_board_of_live_state_counts_invalid():
    state = reset_j(jnp.uint32(7), jnp.float32(0.0))
    decided = board_of((0, 2), (1, 2), (2, 2), (3, 1), (4, 1))  # O has a line, state says not done
    state = state._replace(board=jnp.asarray(decided))
    new = host(step_j(state, jnp.int32(8)))
    assert new["invalid_moves"] == 1 and new["status"] == ttt.STATUS_INVALID and not new["done"]
    np.testing.assert_array_equal(new["board"], decided)


@pytest.mark.parametrize("move", [9, 42, -2, -1000, 2**31 - 1])
def test_out_of_range_moves_are_invalid(move):
    state = reset_j(jnp.uint32(11), jnp.float32(0.3))
    new = host(step_j(state, jnp.int32(move)))
    assert new["invalid_moves"] == 1 and new["missing_moves"] == 0 and new["status"] == ttt.STATUS_INVALID
    np.testing.assert_array_equal(new["board"], np.asarray(state.board))


# ---------------------------------------------------------------------------------------------------
# Property tests over random games, against the reference


def check_contract_dtypes(s: dict) -> None:
    expected = dict(
        board=np.int8, to_play=np.int8, turns=np.int32, invalid_moves=np.int32, missing_moves=np.int32,
        done=np.bool_, outcome=np.int8, last_opponent_move=np.int8, status=np.int8, seed=np.uint32,
        random_move_prob=np.float32,
    )  # fmt: skip
    for name, dtype in expected.items():
        assert s[name].dtype == dtype, name
    assert s["board"].shape == (9,)


@settings(max_examples=60)
@given(
    seed=st.integers(0, 2**32 - 1),
    p=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
    format_score=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_random_games_follow_the_reference(seed, p, format_score, data):
    state = reset_j(jnp.uint32(seed), jnp.float32(p))
    s = host(state)
    check_contract_dtypes(s)
    assert s["turns"] == 0 and not s["done"] and s["to_play"] == 1
    if s["status"] == ttt.STATUS_START_OPP_FIRST:
        assert (s["board"] != 0).sum() == 1 and s["board"][s["last_opponent_move"]] == ttt.O
    else:
        assert s["status"] == ttt.STATUS_START_MODEL_FIRST
        assert (s["board"] == 0).all() and s["last_opponent_move"] == -1
    # Same (seed, p) -> same start.
    again = host(reset_j(jnp.uint32(seed), jnp.float32(p)))
    for k in s:
        np.testing.assert_array_equal(s[k], again[k])

    game = ref.RefGame(board=[int(v) for v in s["board"]], max_turns=NO_LIMIT)
    for _ in range(12):
        free = [int(c) for c in np.flatnonzero(s["board"] == 0)]
        options = st.integers(-3, 12) if not free else st.one_of(st.sampled_from(free), st.integers(-3, 12))
        move = data.draw(options, label="move")
        next_state = step_j(state, jnp.int32(move))
        new = host(next_state)
        check_contract_dtypes(new)
        if s["done"]:  # a finished game never changes
            for k in s:
                np.testing.assert_array_equal(new[k], s[k])
            break
        # Pieces are never overwritten.
        taken = s["board"] != 0
        np.testing.assert_array_equal(new["board"][taken], s["board"][taken])
        assert new["turns"] == s["turns"] + 1

        def opponent_reply(board_after_x):
            cell = int(new["last_opponent_move"])
            # Determinism: the reply is the pure function of (seed, board after X, p).
            assert cell == int(opponent_j(jnp.asarray(board_after_x, jnp.int8), jnp.uint32(seed), jnp.float32(p)))
            if p == 0.0:
                assert ref.ref_optimal(board_after_x, ref.O)[cell]
            return cell

        game.reply(move, opponent_reply)
        np.testing.assert_array_equal(new["board"], np.array(game.board, np.int8))
        assert (new["turns"], new["invalid_moves"], new["missing_moves"]) == (game.turns, game.invalid, game.missing)
        assert bool(new["done"]) == game.done and new["outcome"] == game.outcome
        assert new["status"] == game.status
        assert new["to_play"] == (0 if game.done else 1)
        if new["status"] in (ttt.STATUS_INVALID, ttt.STATUS_NO_MOVE):
            # An unusable reply changes only its counter, turns and status.
            for k in ("board", "last_opponent_move", "seed", "random_move_prob"):
                np.testing.assert_array_equal(new[k], s[k])
        state, s = next_state, new

    win, invalid, total = (float(x) for x in reward_j(state, jnp.float32(format_score)))
    outcome = int(s["outcome"]) if s["done"] else ref.UNFINISHED
    expected = ref.ref_total_reward(outcome, int(s["invalid_moves"]), format_score)
    assert math.isclose(total, expected, abs_tol=1e-5)
    assert math.isclose(invalid, -0.1 if s["invalid_moves"] > 0 else 0.0, abs_tol=1e-7)
    assert win == {ttt.OUTCOME_WIN: 1.0, ttt.OUTCOME_DRAW: 0.5}.get(int(s["outcome"]), 0.0)


def test_unfinished_and_reward_parts():
    state = reset_j(jnp.uint32(1), jnp.float32(0.0))
    state = step_j(state, jnp.int32(-1))
    state = step_j(state, jnp.int32(ttt.INVALID_MOVE))
    s = host(state)
    assert not s["done"] and s["outcome"] == ttt.OUTCOME_ONGOING and s["status"] == ttt.STATUS_INVALID
    assert s["to_play"] == 1 and s["missing_moves"] == 1 and s["invalid_moves"] == 1 and s["turns"] == 2
    # Stopped there (by the rollout's turn limit): unfinished, the win part is the loss value.
    assert math.isclose(float(reward_j(state, jnp.float32(1.0))[2]), 0.0 + 0.2 - 0.1, abs_tol=1e-6)
    metrics = ENV.metrics(state, _episode(state, 1.0), PARAMS)
    assert {k: float(v) for k, v in metrics.items()} == {"win": 0, "draw": 0, "loss": 0, "unfinished": 1,
                                                        "invalid": 1, "missing": 1}
    custom = ttt.Params(win_value=2.0, draw_value=1.0, loss_value=-1.0, invalid_penalty=-0.5,
                        win_weight=0.5, format_weight=0.0, invalid_weight=2.0)  # fmt: skip
    assert [(p.name, p.weight) for p in ENV.rubric(custom)] == [("win", 0.5), ("format", 0.0), ("invalid", 2.0)]
    for outcome, done, win in [(ttt.OUTCOME_WIN, True, 2.0), (ttt.OUTCOME_DRAW, True, 1.0),
                               (ttt.OUTCOME_LOSS, True, -1.0), (ttt.OUTCOME_ONGOING, False, -1.0)]:  # fmt: skip
        st_ = state._replace(outcome=jnp.int8(outcome), done=jnp.bool_(done))
        w, _, total = reward_j(st_, jnp.float32(0.7), custom)
        assert float(w) == win
        assert math.isclose(float(total), 0.5 * win - 1.0, abs_tol=1e-6)


def test_the_two_halves_of_a_step_compose_to_step():
    """model_move then opponent_move_applied (the person's move in `play`) is `step` with the opponent's own
    choice, and model_move alone is `step` when the game ends or the reply is not a move."""
    rng = np.random.default_rng(5)
    model = jax.jit(ttt.model_move)
    opponent = jax.jit(ttt.opponent_move_applied)
    checked = 0
    for seed in range(60):
        state = reset_j(jnp.uint32(seed), jnp.float32(rng.uniform()))
        for _ in range(7):
            move = int(rng.choice([*np.flatnonzero(np.asarray(state.board) == 0), -1, 9, 4]))
            want = host(step_j(state, jnp.int32(move)))
            half = model(state, jnp.int32(move))
            if bool(half.done) or int(half.status) != ttt.STATUS_OPP_MOVED:
                got = host(half)
            else:
                reply = int(opponent_j(half.board, state.seed, state.random_move_prob))
                got = host(opponent(half, jnp.int32(reply)))
                checked += 1
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            state = step_j(state, jnp.int32(move))
            if bool(state.done):
                break
    assert checked > 50


def test_equal_seed_board_p_meet_equal_replies():
    """Games of a group reaching the same board get the same reply; other seeds differ somewhere."""
    board = board_of((4, ttt.X))
    boards = jnp.asarray(np.tile(board, (64, 1)))
    same = np.asarray(batched_opponent(boards, jnp.full((64,), 123, jnp.uint32), jnp.full((64,), 0.4)))
    assert (same == same[0]).all()
    varied = np.asarray(batched_opponent(boards, jnp.arange(64, dtype=jnp.uint32), jnp.full((64,), 0.4)))
    assert len(set(varied.tolist())) > 1


# ---------------------------------------------------------------------------------------------------
# The opponent's randomness is unbiased (statistical, loose bounds, one vmapped call)


def test_opponent_choices_are_unbiased():
    n = 8000
    cases = [  # (board, p)
        (board_of(), 0.0),  # all 9 optimal
        (board_of((4, ttt.X)), 0.0),  # the 4 corners
        (board_of((4, ttt.X)), 1.0),  # any of the 8 free cells
        (board_of((0, ttt.X)), 0.5),  # 4 optimal; otherwise random
    ]
    boards = jnp.asarray(np.repeat(np.stack([b for b, _ in cases]), n, axis=0))
    p = jnp.asarray(np.repeat([q for _, q in cases], n).astype(np.float32))
    seeds = jnp.asarray(np.tile(np.arange(n, dtype=np.uint32) * 7919 + 5, len(cases)))
    moves = np.asarray(batched_opponent(boards, seeds, p)).reshape(len(cases), n)
    counts = [np.bincount(m, minlength=9) for m in moves]
    assert (counts[0] > 0.8 * n / 9).all() and (counts[0] < 1.2 * n / 9).all()
    corners = [0, 2, 6, 8]
    assert counts[1][corners].sum() == n
    assert (counts[1][corners] > 0.8 * n / 4).all() and (counts[1][corners] < 1.2 * n / 4).all()
    free = [0, 1, 2, 3, 5, 6, 7, 8]
    assert counts[2][4] == 0 and (counts[2][free] > 0.8 * n / 8).all() and (counts[2][free] < 1.2 * n / 8).all()
    # p = 0.5 after X corner: P(4) = 0.5 + 0.5 / 8.
    assert abs(counts[3][4] / n - (0.5 + 0.5 / 8)) < 0.03 and counts[3][0] == 0


def test_first_mover_and_opening_are_fair():
    n = 4000
    states = jax.jit(jax.vmap(ttt.reset))(jnp.arange(n, dtype=jnp.uint32), jnp.full((n,), 0.0))
    opp_first = np.asarray(states.status) == ttt.STATUS_START_OPP_FIRST
    assert abs(opp_first.mean() - 0.5) < 0.05
    openings = np.bincount(np.asarray(states.last_opponent_move)[opp_first], minlength=9)
    assert (openings > 0.7 * opp_first.sum() / 9).all()


# ---------------------------------------------------------------------------------------------------
# Stratified difficulty


def test_stratified_examples_structure():
    n, g = 16, 4
    fn = jax.jit(ttt.stratified_examples, static_argnums=(1, 2, 3, 4))
    for p_min, p_max in [(0.2, 0.7), (0.0, 0.25), (0.0, 1.0)]:
        seeds, p = fn(jax.random.PRNGKey(3), n, g, p_min, p_max)
        assert seeds.shape == (n * g,) and seeds.dtype == jnp.uint32
        assert p.shape == (n * g,) and p.dtype == jnp.float32
        seeds, p = np.asarray(seeds).reshape(n, g), np.asarray(p).reshape(n, g)
        assert (seeds == seeds[:, :1]).all() and (p == p[:, :1]).all()  # groups repeat one example
        assert len(set(seeds[:, 0].tolist())) == n
        width = (p_max - p_min) / n
        lower = p_min + np.arange(n) * width
        assert (p[:, 0] >= lower - 1e-6).all() and (p[:, 0] <= lower + width + 1e-6).all()
        # Exactly one example per bucket.
        buckets = np.clip(np.floor((p[:, 0] - p_min) / width + 1e-4), 0, n - 1).astype(int)
        assert sorted(buckets.tolist()) == list(range(n))
    seeds2, _ = fn(jax.random.PRNGKey(4), n, g, 0.2, 0.7)
    assert not np.array_equal(np.asarray(seeds2).reshape(n, g), seeds)
    seeds, p = ttt.stratified_examples(jax.random.PRNGKey(0), 3, 2, 0.4, 0.4)  # zero width
    np.testing.assert_allclose(np.asarray(p), 0.4)


# ---------------------------------------------------------------------------------------------------
# Many full games at once


def test_jit_vmap_16384_full_games():
    n = 16_384

    @jax.jit
    def play(key):
        seed_key, p_key, move_key = jax.random.split(key, 3)
        seeds = jax.random.bits(seed_key, (n,), jnp.uint32)
        p = jnp.where(jnp.arange(n) < n // 2, 0.0, jax.random.uniform(p_key, (n,)))
        state = jax.vmap(ttt.reset)(seeds, p)

        def turn(state, key):
            logits = jnp.where(ttt.legal_moves(state.board), 0.0, -jnp.inf)
            moves = jax.random.categorical(key, logits).astype(jnp.int32)
            return jax.vmap(ttt.step)(state, moves), None

        state, _ = jax.lax.scan(turn, state, jax.random.split(move_key, 5))
        return state, p

    state, p = play(jax.random.PRNGKey(0))
    s = host(state)
    assert s["done"].all() and (s["to_play"] == 0).all()
    assert np.isin(s["outcome"], [ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW, ttt.OUTCOME_LOSS]).all()
    assert (s["invalid_moves"] == 0).all() and (s["missing_moves"] == 0).all() and (s["turns"] <= 5).all()
    nx, no = (s["board"] == ttt.X).sum(1), (s["board"] == ttt.O).sum(1)
    assert (np.abs(nx - no) <= 1).all() and (nx == s["turns"]).all()
    w = np.asarray(jax.vmap(ttt.winner)(state.board))
    np.testing.assert_array_equal(w == ttt.X, s["outcome"] == ttt.OUTCOME_WIN)
    np.testing.assert_array_equal(w == ttt.O, s["outcome"] == ttt.OUTCOME_LOSS)
    assert ((nx + no)[s["outcome"] == ttt.OUTCOME_DRAW] == 9).all()
    # The optimal opponent (p = 0) never loses; random models do win against noisier ones.
    outcome = s["outcome"]
    assert not (outcome[: n // 2] == ttt.OUTCOME_WIN).any()
    assert (outcome[n // 2 :] == ttt.OUTCOME_WIN).mean() > 0.05


# ---------------------------------------------------------------------------------------------------
# Host-side validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt="huge"), "prompt"),
        (dict(win_value=float("nan")), "win_value"),
        (dict(draw_value=float("inf")), "draw_value"),
        (dict(loss_value="0"), "loss_value"),
        (dict(invalid_penalty=0.1), "invalid_penalty"),
        (dict(format_weight=-0.2), "format_weight"),
        (dict(win_weight=float("nan")), "win_weight"),
    ],
)
def test_bad_env_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=f"Params.{field}"):
        ttt.Params(**kwargs)


def test_env_params_static_and_hashable():
    a, b = ttt.Params(prompt="tiny"), ttt.Params(prompt="tiny")
    assert a == b and hash(a) == hash(b) and hash(ttt.TicTacToe(a)) == hash(ttt.TicTacToe(b))
    with pytest.raises(Exception):
        a.prompt = "compact"  # frozen


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 2, -0.1, 0.5), "p_min"),
        ((4, 2, 0.1, 1.5), "p_max"),
        ((4, 2, 0.7, 0.2), "p_min must be <= p_max"),
        ((0, 2, 0.1, 0.5), "num_prompts"),
        ((4, 0, 0.1, 0.5), "group_size"),
        ((4, 2, float("nan"), 0.5), "p_min"),
    ],
)
def test_bad_sampler_config_raises(args, match):
    with pytest.raises(ValueError, match=match):
        ttt.stratified_examples(jax.random.PRNGKey(0), *args)


def test_bad_reset_arguments_raise():
    with pytest.raises(ValueError, match="random_move_prob"):
        ttt.reset(1, 1.5)
    with pytest.raises(ValueError, match="random_move_prob"):
        ttt.reset(np.arange(3, dtype=np.uint32), np.array([0.1, -0.2, 0.3]))
    with pytest.raises(ValueError, match="seed"):
        ttt.reset(-1, 0.5)
    with pytest.raises(ValueError, match="seed"):
        ttt.reset(2**32, 0.5)


# ---------------------------------------------------------------------------------------------------
# Internals that the fast path relies on, checked against their plain definitions


def test_draws_are_jax_fold_in_bit_for_bit():
    rng = np.random.default_rng(0)
    seeds = jnp.asarray(rng.integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32))
    data = jnp.asarray(rng.integers(0, 2**20, 256).astype(np.uint32))
    expected = jax.vmap(lambda s, d: jax.random.fold_in(jax.random.PRNGKey(s), d))(seeds, data)
    got = jnp.stack(jax.vmap(game._draw)(seeds, data), axis=-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_bitboard_line_table_matches_reference():
    for mask in range(512):
        board = tuple(ref.X if mask >> c & 1 else 0 for c in range(9))
        assert bool(game._HAS_LINE[mask]) == (ref.ref_winner(board) == ref.X)
