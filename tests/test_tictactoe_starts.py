"""Tic-Tac-Toe's two data levers, both off by default: exploring starts (`[grpo.curriculum] start_moves`,
envs.tictactoe.starts) and the board's 8 symmetries (`[sft.teacher] symmetries`, envs.tictactoe.symmetry).
Checked against the reference rules in tests/reference_tictactoe.py and plain NumPy."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs import tictactoe as ttt
from envs.tictactoe import starts, symmetry, text
from envs.tictactoe.expert_games import generate_expert_games
from envs.tictactoe.rows import expert_rows
from jaxrl_base.checks import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
import reference_tictactoe as ref  # noqa: E402

ENV = ttt.TicTacToe()


def _reset_all(stage, num_prompts=64, group_size=4):
    examples = ENV.sample_examples(jax.random.PRNGKey(3), num_prompts, group_size, stage)
    states = jax.jit(jax.vmap(lambda ex: ENV.reset(ex, ENV.params)))(examples)
    return examples, jax.device_get(states)


def test_default_stage_has_no_exploring_start_and_resets_as_the_game():
    examples, states = _reset_all(ttt.Stage(0.0, 1.0))
    assert examples.start_moves is None
    plain = jax.device_get(jax.vmap(ttt.reset)(examples.seed, examples.random_move_prob))
    for a, b in zip(states, plain):
        np.testing.assert_array_equal(a, b)
    assert (np.asarray(states.board) != 0).sum(-1).max() <= 1


def test_exploring_starts_are_live_mid_game_positions_shared_by_a_group():
    examples, states = _reset_all(ttt.Stage(0.0, 0.3, start_moves=3), num_prompts=128)
    boards = np.asarray(states.board)
    xs, os_ = (boards == ttt.X).sum(-1), (boards == ttt.O).sum(-1)
    assert set((os_ - xs).tolist()) <= {0, 1}  # X to move
    for b in boards:
        assert ref.ref_winner(tuple(b.tolist())) == 0 and (b == 0).any()  # live, a free cell left
    pieces = (boards != 0).sum(-1)
    assert pieces.max() >= 5 and pieces.min() <= 1  # rounds 0..3 all happen
    assert np.all(np.asarray(states.turns) == 0) and not np.asarray(states.done).any()
    moved = pieces > (np.asarray(states.status) == ttt.STATUS_START_OPP_FIRST)
    mid = np.asarray(states.status) == ttt.STATUS_OPP_MOVED
    np.testing.assert_array_equal(mid, pieces >= 2)  # a random round was played: a mid-game message
    last = np.asarray(states.last_opponent_move)
    assert np.all(boards[mid, last[mid]] == ttt.O)
    assert moved.any()
    # the games of a group (the same seed) start from the same board; the message renders as mid-game
    groups = boards.reshape(128, 4, 9)
    assert np.all(groups == groups[:, :1])
    i = int(np.flatnonzero(mid)[0])
    msg = text.render_message(ENV.params.preset, boards[i], int(states.status[i]), int(last[i]))
    assert f"played at position {last[i]}" in msg


def test_exploring_start_rounds_follow_the_seed_and_zero_means_the_normal_start():
    seeds = np.arange(2000, dtype=np.uint32)
    n = np.asarray(jax.vmap(lambda s: starts.num_start_rounds(s, jnp.int32(3)))(jnp.asarray(seeds)))
    assert set(n.tolist()) == {0, 1, 2, 3} and abs(np.mean(n == 0) - 0.25) < 0.05
    plain = np.asarray(jax.vmap(lambda s: ttt.reset(s, jnp.float32(0.0)).board)(jnp.asarray(seeds)))
    np.testing.assert_array_equal(starts.start_boards(seeds, 0), plain)
    boards = starts.start_boards(seeds, 3)
    added = (boards != 0).sum(-1) - (plain != 0).sum(-1)
    assert np.all(added <= 2 * n) and np.all(added % 2 == 0)  # whole rounds, never more than asked


@pytest.mark.parametrize("bad", [-1, 4, 1.5, True])
def test_exploring_start_bounds_are_checked(bad):
    with pytest.raises(ConfigError, match="start_moves"):
        ttt.Stage(0.0, 1.0, start_moves=bad)


def test_the_eight_symmetries_are_distinct_and_map_lines_to_lines():
    perms = symmetry.SYMMETRIES
    assert len({tuple(p) for p in perms}) == 8 and all(sorted(p) == list(range(9)) for p in perms)
    lines = {frozenset(line) for line in np.asarray(ttt.LINES).tolist()}
    for p in perms:
        assert {frozenset(p[list(line)].tolist()) for line in lines} == lines
        assert p[4] == 4 and set(p[[0, 2, 6, 8]].tolist()) == {0, 2, 6, 8}


def _kind(board, move):
    """The move kind in plain Python (win, block, centre, corner, other; first that applies)."""
    through = [line for line in ref.WIN_LINES if move in line]
    if any(sum(board[c] == ttt.X for c in line) == 2 for line in through):
        return 0
    if any(sum(board[c] == ttt.O for c in line) == 2 for line in through):
        return 1
    return 2 if move == 4 else (3 if move in (0, 2, 6, 8) else 4)


def test_symmetric_games_are_games_of_the_rules_with_the_same_kinds_and_outcome():
    games = generate_expert_games(jax.random.PRNGKey(1), 16, teacher_random_move_prob=0.3,
                                  opponent_p_range=(0.0, 1.0), max_turns=8, teacher="uniform")
    sym = symmetry.symmetric_games(games)
    assert len(sym.seed) == 8 * 16
    np.testing.assert_array_equal(sym.first_board[:16], games.first_board)
    for i in range(len(sym.seed)):
        board = sym.first_board[i].tolist()
        assert board == sym.boards[i, 0].tolist()
        for t in range(int(sym.num_moves[i])):
            move = int(sym.moves[i, t])
            assert board[move] == ttt.EMPTY
            assert _kind(board, move) == int(sym.kinds[i, t])
            board[move] = ttt.X
            opp = int(sym.last_opp[i, t])
            if sym.after_boards[i, t].tolist() != board:  # O replied
                assert board[opp] == ttt.EMPTY
                board[opp] = ttt.O
            assert board == sym.after_boards[i, t].tolist()
        final = ref.ref_winner(tuple(board))
        want = {ttt.OUTCOME_WIN: ttt.X, ttt.OUTCOME_LOSS: ttt.O, ttt.OUTCOME_DRAW: 0}[int(sym.outcome[i])]
        assert final == want


def test_teacher_symmetries_give_eight_times_the_rows_and_are_off_by_default():
    key = jax.random.PRNGKey(2)
    plain = expert_rows(key, 12, teacher_random_move_prob=0.3, opponent_p_range=(0.0, 1.0), preset="tiny",
                        teacher="uniform", reasoning="none")
    both = expert_rows(key, 12, teacher_random_move_prob=0.3, opponent_p_range=(0.0, 1.0), preset="tiny",
                       teacher="uniform", reasoning="none", symmetries=True)
    assert len(both) == 8 * len(plain)
    assert ttt.Teacher().symmetries is False
    with pytest.raises(ConfigError, match="symmetries"):
        ttt.Teacher(layout="positions", symmetries=True)
