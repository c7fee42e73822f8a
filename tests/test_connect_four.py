"""Connect Four (envs/connect_four): the rules against pgx's `connect_four` on 10 000 random games (legal moves,
terminal states, winners and boards at every ply, vmapped), the search against the independent Python negamax
(tests/reference_connect_four.py), the opponent mixture's determinism, and the env on the protocol (messages vs
an independent rendering, a scripted rollout through the rubric and metrics, config errors)."""

from __future__ import annotations

import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.connect_four import game as c4

sys.path.insert(0, os.path.dirname(__file__))
import reference_connect_four as ref  # noqa: E402

import pgx  # noqa: E402  (a test dependency: the `test` extra)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


# ---------------------------------------------------------------------------------------------------------
# The rules vs pgx
# ---------------------------------------------------------------------------------------------------------

NUM_GAMES = 10_000
PGX_ENV = pgx.make("connect_four")


@jax.jit
def _random_games(key):
    """NUM_GAMES random games played ply by ply in our rules and pgx's at once (lax.scan over 42 plies, vmap
    over games). Per ply and game: legal masks, terminal flags, winner (+1 first mover, -1 second, 0 none)
    and the board cells (0 empty, 1 first mover, 2 second; row 0 at the bottom) of both."""
    keys = jax.random.split(key, NUM_GAMES)
    pgx_state = jax.vmap(PGX_ENV.init)(keys)
    empty = jnp.zeros((NUM_GAMES, 2), jnp.uint32)

    def body(carry, ply_key):
        first, second, ps, done, ply = carry
        legal_ours = jax.vmap(c4.legal_columns)(first, second)
        legal_pgx = ps.legal_action_mask
        # a uniformly random legal column (per pgx's mask, so a disagreement shows up in the comparison)
        logits = jnp.where(legal_pgx, 0.0, -jnp.inf)
        column = jax.random.categorical(ply_key, logits).astype(jnp.int32)
        first_moves = ply % 2 == 0
        mover = jnp.where(first_moves, first.T, second.T).T
        other = jnp.where(first_moves, second.T, first.T).T
        new, legal = jax.vmap(c4.play)(mover, other, column)
        new = jnp.where(done[:, None], mover, new)
        first = jnp.where(first_moves, new.T, first.T).T
        second = jnp.where(first_moves, second.T, new.T).T
        ps = jax.vmap(PGX_ENV.step)(ps, jnp.where(done, 0, column))
        won_first = jax.vmap(c4.has_four)(first)
        won_second = jax.vmap(c4.has_four)(second)
        terminal = won_first | won_second | jax.vmap(c4.is_full)(first, second)
        winner = won_first.astype(jnp.int32) - won_second.astype(jnp.int32)
        # pgx: rewards per player id; the first mover is current_player at init
        r = ps.rewards
        pgx_winner = jnp.sign(jnp.take_along_axis(r, pgx_state.current_player[:, None], 1)[:, 0]).astype(jnp.int32)
        board_pgx = ps._x.board.reshape(NUM_GAMES, 6, 7)[:, ::-1]  # row 0 at the bottom, colours 0 / 1
        cells_ours = jax.vmap(c4.cells)(first, second)
        out = dict(active=~done, legal_ours=legal_ours, legal_pgx=legal_pgx, legal_played=legal,
                   terminal_ours=terminal, terminal_pgx=ps.terminated, winner_ours=winner, winner_pgx=pgx_winner,
                   cells_ours=cells_ours.astype(jnp.int32), cells_pgx=board_pgx + 1)
        return (first, second, ps, done | ps.terminated, ply + 1), out

    carry = (empty, empty, pgx_state, jnp.zeros(NUM_GAMES, bool), jnp.int32(0))
    _, out = jax.lax.scan(body, carry, jax.random.split(jax.random.fold_in(key, 1), 42))
    return out


@pytest.fixture(scope="module")
def pgx_games():
    return _host(_random_games(jax.random.PRNGKey(0)))


def test_rules_agree_with_pgx_at_every_ply(pgx_games):
    g = pgx_games
    act = g["active"]  # [42, N]: the ply was played in a live game
    assert act[0].all() and act.sum() > 20 * NUM_GAMES  # every game starts; games are long
    np.testing.assert_array_equal(g["legal_ours"][act], g["legal_pgx"][act])
    assert g["legal_played"][act].all()
    np.testing.assert_array_equal(g["terminal_ours"][act], g["terminal_pgx"][act])
    np.testing.assert_array_equal(g["winner_ours"][act], g["winner_pgx"][act])
    np.testing.assert_array_equal(g["cells_ours"][act], g["cells_pgx"][act])
    # every game ends within 42 plies, with both kinds of wins and some draws
    final = g["terminal_pgx"].any(0)
    assert final.all()
    last = act.sum(0) - 1
    winners = g["winner_ours"][last, np.arange(NUM_GAMES)]
    assert (winners == 1).sum() > 3000 and (winners == -1).sum() > 3000 and (winners == 0).sum() > 0


def test_rules_agree_with_the_python_reference_on_sampled_positions(pgx_games):
    """The cells of a few hundred pgx-played positions: our legal / won / full vs the reference's."""
    g = pgx_games
    rng = np.random.default_rng(1)
    plies, games = np.nonzero(g["active"])
    for i in rng.choice(len(plies), 300, replace=False):
        cells = g["cells_ours"][plies[i], games[i]]
        board = cells.tolist()
        x, o = c4.from_cells(cells)
        assert [bool(v) for v in np.asarray(c4.legal_columns(x, o))] == [c in ref.legal(board) for c in range(7)]
        assert bool(c4.has_four(x)) == (ref.winner(board) == 1)
        assert bool(c4.has_four(o)) == (ref.winner(board) == 2)
        assert bool(c4.is_full(x, o)) == ref.full(board)
        np.testing.assert_array_equal(np.asarray(c4.cells(x, o)), cells)


def test_play_rejects_full_and_off_board_columns():
    board = np.zeros((6, 7), int)
    board[:, 3] = [1, 2, 1, 2, 1, 2]
    x, o = c4.from_cells(board)
    for column in (3, -1, 7, 100):
        new, legal = c4.play(x, o, column)
        assert not bool(legal)
        np.testing.assert_array_equal(np.asarray(new), x)
    new, legal = c4.play(x, o, 0)
    assert bool(legal) and int(c4.cells(new, o)[0, 0]) == c4.X


def test_from_cells_and_cell_bit_reject_bad_input():
    with pytest.raises(ValueError, match="6 x 7"):
        c4.from_cells(np.zeros((7, 6), int))
    with pytest.raises(ValueError, match="holds 3"):
        c4.from_cells(np.full((6, 7), 3))
    with pytest.raises(ValueError, match="off the"):
        c4.cell_bit(6, 0)


# ---------------------------------------------------------------------------------------------------------
# Evaluation and search vs the Python reference
# ---------------------------------------------------------------------------------------------------------


def _positions(n: int, seed: int) -> list[tuple[list[list[int]], int]]:
    """n live positions after 0..20 random plies (X first), with the side to move."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        pos = ref.random_position(rng, rng.randrange(0, 21))
        if pos is not None:
            out.append(pos)
    return out


def _bits(positions):
    """Positions -> (to_move uint32[n, 2], other uint32[n, 2])."""
    tm, ot = [], []
    for board, me in positions:
        x, o = c4.from_cells(np.asarray(board))
        tm.append(x if me == 1 else o)
        ot.append(o if me == 1 else x)
    return jnp.asarray(np.stack(tm)), jnp.asarray(np.stack(ot))


def test_evaluation_matches_the_reference():
    positions = _positions(300, 2)
    tm, ot = _bits(positions)
    got = np.asarray(jax.jit(jax.vmap(c4.evaluate))(tm, ot))
    want = [ref.evaluate(board, me) for board, me in positions]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("depth,count", [(1, 300), (2, 300), (3, 100)])
def test_search_values_match_the_reference(depth, count):
    """Every legal column's negamax value (hence the same best-move set), one compiled max_depth = 3 tree
    for all three depths (the depth is traced)."""
    positions = _positions(count, 10 + depth)
    tm, ot = _bits(positions)
    got = np.asarray(c4.search_values_batch(tm, ot, jnp.full(count, depth, jnp.int32), 3))
    for (board, me), values in zip(positions, got):
        want = ref.root_values(board, me, depth)
        assert {c: int(values[c]) for c in range(7) if values[c] > c4.NEG} == want
        assert all(values[c] == c4.NEG for c in range(7) if c not in want)
        best = {int(c) for c in np.flatnonzero(values == values.max())}
        assert best == ref.best_columns(board, me, depth)


def test_search_finds_wins_and_blocks():
    board = np.zeros((6, 7), int)
    board[0, :3] = 1  # X has three on the bottom row; O elsewhere
    board[1, :2] = 2
    board[0, 6] = 2
    x, o = c4.from_cells(board)
    full = np.where(np.arange(7)[None] % 2 == np.arange(6)[:, None] // 2 % 2, 1, 2)
    fx, fo = c4.from_cells(full)
    values = np.asarray(c4.search_values_batch(jnp.stack([x, o, fx]), jnp.stack([o, x, fo]),
                                               jnp.asarray([1, 2, 2], jnp.int32), 2))
    assert np.flatnonzero(values[0] == values[0].max()).tolist() == [3] and values[0, 3] == c4.WIN - 1  # X wins
    assert np.flatnonzero(values[1] == values[1].max()).tolist() == [3]  # O blocks at 3
    assert (values[2] == c4.NEG).all()  # a finished board
    with pytest.raises(ValueError, match="max_depth"):
        c4.search_values(x, o, 1, c4.MAX_DEPTH + 1)


# ---------------------------------------------------------------------------------------------------------
# The opponent mixture
# ---------------------------------------------------------------------------------------------------------

_opp = jax.jit(jax.vmap(c4.opponent_move, (0, 0, 0, 0, 0, None)), static_argnums=5)


def test_opponent_is_deterministic_per_seed_board_and_p():
    positions = _positions(200, 3)
    tm, ot = _bits(positions)
    xs = jnp.where(jnp.asarray([me == 1 for _, me in positions])[:, None], tm, ot)
    os_ = jnp.where(jnp.asarray([me == 1 for _, me in positions])[:, None], ot, tm)
    n = len(positions)
    seeds = jnp.arange(n, dtype=jnp.uint32) * 7919
    for p in (0.0, 0.3, 1.0):
        probs = jnp.full(n, p, jnp.float32)
        a = np.asarray(_opp(xs, os_, seeds, probs, jnp.full(n, 2, jnp.int32), 2))
        b = np.asarray(_opp(xs, os_, seeds, probs, jnp.full(n, 2, jnp.int32), 2))
        np.testing.assert_array_equal(a, b)
        legal = np.asarray(jax.vmap(c4.legal_columns)(xs, os_))
        assert legal[np.arange(n), a].all()
    # p = 0 plays a best column of O's search; other seeds give other draws among ties / random moves
    a = np.asarray(_opp(xs, os_, seeds, jnp.zeros(n), jnp.full(n, 2, jnp.int32), 2))
    best = np.asarray(jax.jit(jax.vmap(c4.best_columns, (0, 0, 0, None)), static_argnums=3)(
        os_, xs, jnp.full(n, 2, jnp.int32), 2))
    assert best[np.arange(n), a].all()
    r1 = np.asarray(_opp(xs, os_, seeds, jnp.ones(n), jnp.full(n, 2, jnp.int32), 2))
    r2 = np.asarray(_opp(xs, os_, seeds + 1, jnp.ones(n), jnp.full(n, 2, jnp.int32), 2))
    assert (r1 != r2).mean() > 0.5


def test_random_opponent_is_uniform_over_legal_columns():
    n = 14_000
    empty = jnp.zeros((n, 2), jnp.uint32)
    cols = np.asarray(_opp(empty, empty, jnp.arange(n, dtype=jnp.uint32), jnp.ones(n), jnp.ones(n, jnp.int32), 1))
    counts = np.bincount(cols, minlength=7)
    assert counts.sum() == n and (np.abs(counts - n / 7) < 5 * np.sqrt(n / 7)).all()


def test_game_step_against_the_reference_with_a_random_opponent():
    """Our State machine (model moves random legal, the opponent p = 1) replayed on reference boards: the
    same boards after every reply, the same outcomes (the reference's winner / full)."""
    n = 400
    reset = jax.jit(jax.vmap(c4.reset, (0, 0, 0, None)), static_argnums=3)
    step = jax.jit(jax.vmap(c4.step, (0, 0, None)), static_argnums=2)
    state = reset(jnp.arange(n, dtype=jnp.uint32), jnp.ones(n), jnp.ones(n, jnp.int32), 1)
    s = _host(state)
    opp_first = s.status == c4.STATUS_START_OPP_FIRST
    assert 0.4 < opp_first.mean() < 0.6
    boards = np.zeros((n, 6, 7), int)
    heights = np.zeros((n, 7), int)

    def drop(i, col, who):
        boards[i, heights[i, col], col] = who
        heights[i, col] += 1

    for i in np.flatnonzero(opp_first):
        drop(i, s.last_opponent_move[i], c4.O)
    rng = np.random.default_rng(0)
    for _ in range(22):
        s = _host(state)
        np.testing.assert_array_equal(np.asarray(jax.vmap(c4.cells)(state.x, state.o)), boards)
        live = ~s.done
        if not live.any():
            break
        legal = heights < 6
        moves = np.array([rng.choice(np.flatnonzero(legal[i])) if live[i] else 0 for i in range(n)])
        state = step(state, jnp.asarray(moves, jnp.int32), 1)
        t = _host(state)
        for i in np.flatnonzero(live):
            drop(i, moves[i], c4.X)
            if t.status[i] in (c4.STATUS_OPP_MOVED, c4.STATUS_LOSS, c4.STATUS_OPP_DRAW):
                drop(i, t.last_opponent_move[i], c4.O)
            board = boards[i].tolist()
            w = ref.winner(board)
            want = c4.OUTCOME_WIN if w == 1 else c4.OUTCOME_LOSS if w == 2 else (
                c4.OUTCOME_DRAW if ref.full(board) else c4.OUTCOME_ONGOING)
            assert int(t.outcome[i]) == want and bool(t.done[i]) == (want != c4.OUTCOME_ONGOING)
    assert _host(state).done.all()


# ---------------------------------------------------------------------------------------------------------
# The env on the protocol
# ---------------------------------------------------------------------------------------------------------

import envs  # noqa: E402
from envs.connect_four import env as c4env  # noqa: E402
from envs.core import Episode, ParsedReply  # noqa: E402
from jaxrl_llm.checks import ConfigError  # noqa: E402

ENV = envs.make("connect_four", max_depth=2)
_STATUS = {0: "You start.", 1: "O played {k}.", 2: "O played {k}.", 3: "Invalid move.", 4: "No <move> tag.",
           5: "You win!", 6: "Draw!", 7: "O played {k}. You lose!", 8: "O played {k}. Draw!"}


def _independent_message(board, status: int, k: int) -> str:
    """The tiny preset's message written from the spec: status, rows top first (0 / 1 / 2), index line,
    then `Free: <playable columns>` and `Your move.` while the game goes on."""
    lines = [_STATUS[status].replace("{k}", str(k))]
    lines += ["".join(str(board[r][c]) for c in range(7)) for r in range(5, -1, -1)]
    lines.append("0123456")
    if status < 5:
        lines.append("Free: " + "".join(str(c) for c in range(7) if board[5][c] == 0))
        lines.append("Your move.")
    return "\n".join(lines)


_env_reset = jax.jit(lambda ex: ENV.reset(ex, ENV.params))
_env_step = jax.jit(lambda s, r: ENV.step(s, r, ENV.params))


def _scripted_games(num: int, seed: int):
    """num games: the model plays the first legal column from a fixed script; yields (state, message) pairs."""
    examples = ENV.sample_examples(jax.random.PRNGKey(seed), num, 1, c4env.Stage(0.0, 1.0, 2))
    rng = np.random.default_rng(seed)
    for i in range(num):
        ex = jax.tree.map(lambda a: a[i], examples)
        state = _env_reset(ex)
        history = []
        for _ in range(25):
            history.append(state)
            if bool(state.done):
                break
            legal = np.flatnonzero(np.asarray(c4.legal_columns(state.x, state.o)))
            roll = rng.random()
            if roll < 0.05:
                reply = ParsedReply(jnp.bool_(False), jnp.bool_(False), jnp.int32(0), jnp.bool_(False))  # no tag
            elif roll < 0.1:
                reply = ParsedReply.of(7)  # a tag without a column 0..6
            else:
                reply = ParsedReply.of(int(rng.choice(legal)))
            state = _env_step(state, reply)
        yield history


def test_messages_match_an_independent_rendering():
    seen = set()
    for history in _scripted_games(12, 0):
        for state in history:
            s = _host(state)
            board = np.asarray(c4.cells(s.x, s.o)).tolist()
            want = _independent_message(board, int(s.status), max(int(s.last_opponent_move), 0))
            assert ENV.render_message(state, ENV.params) == want
            seen.add(int(s.status))
    assert {0, 1, 2, 3, 4} <= seen and seen & {5, 7}  # starts, moves, invalid, missing and game ends


def test_rubric_and_metrics_on_scripted_games():
    for history in _scripted_games(20, 1):
        s = history[-1]
        ep = Episode(format_score=jnp.float32(0.75), turns=jnp.int32(len(history) - 1), truncated=~s.done,
                     context_cut=jnp.bool_(False))
        parts = {k: float(v) for k, v in ENV.reward_parts(s, ep, ENV.params).items()}
        m = {k: float(v) for k, v in ENV.metrics(s, ep, ENV.params).items()}
        outcome = int(s.outcome) if bool(s.done) else None
        assert parts["win"] == {c4.OUTCOME_WIN: 1.0, c4.OUTCOME_DRAW: 0.5}.get(outcome, 0.0)
        assert parts["format"] == pytest.approx(0.75)
        assert parts["invalid"] == pytest.approx(-0.1 if int(s.invalid_moves) > 0 else 0.0)
        assert float(ENV.reward(s, ep, ENV.params)) == pytest.approx(parts["win"] + 0.2 * 0.75 + parts["invalid"])
        assert m["win"] + m["draw"] + m["loss"] + m["unfinished"] == 1.0
        assert m["invalid"] == float(int(s.invalid_moves) > 0) and m["missing"] == float(int(s.missing_moves) > 0)
        # the board of the last state equals the script replayed on the reference
        assert int(s.turns) == len(history) - 1


def test_text_tables_are_exact_for_the_env():
    from jaxrl_llm import text
    from jaxrl_llm.text.tables import tables_for_env

    tables = tables_for_env(text.load_tokenizer(), ENV)  # raises on any boundary that does not tokenize exactly
    assert tables.max_msg >= 70 and len(tables.slot_names) == 46


def test_config_errors_are_named():
    with pytest.raises(ConfigError, match="board size"):
        envs.make("connect_four", rows=7)
    with pytest.raises(ConfigError, match="max_depth"):
        envs.make("connect_four", max_depth=c4.MAX_DEPTH + 1)
    with pytest.raises(ConfigError, match="depth"):
        c4env.Stage(0.0, 1.0, 0)
    with pytest.raises(ConfigError, match="p_min"):
        c4env.Stage(0.9, 0.1, 2)
    with pytest.raises(ConfigError, match="above the env's max_depth"):
        ENV.sample_examples(jax.random.PRNGKey(0), 4, 2, c4env.Stage(0.0, 1.0, 4))
    with pytest.raises(ConfigError, match="prompt"):
        envs.make("connect_four", prompt="huge")
    from envs.connect_four.teacher import Teacher
    with pytest.raises(ConfigError, match="tie_break"):
        Teacher(tie_break="left")
    assert [s.name for s in ENV.eval_settings()] == ["random", "depth1", "depth2"]


def test_sample_examples_group_and_stratify():
    ex = ENV.sample_examples(jax.random.PRNGKey(3), 8, 4, c4env.Stage(0.0, 1.0, 2))
    seeds, probs = np.asarray(ex.seed).reshape(8, 4), np.asarray(ex.random_move_prob).reshape(8, 4)
    assert (seeds == seeds[:, :1]).all() and (probs == probs[:, :1]).all() and (np.asarray(ex.depth) == 2).all()
    assert sorted(np.floor(probs[:, 0] * 8).astype(int).tolist()) == list(range(8))


@pytest.mark.parametrize("tie_break", ["uniform", "center"])
def test_teacher_rows_replay_on_the_reference(tie_break):
    """Teacher games (depth 2 vs depth 1): every reply is a best column of the reference search at depth 2
    (with tie_break "center", one of the best columns nearest column 3), and every message is the
    independent rendering of the reference board."""
    from envs.connect_four.teacher import Teacher

    teacher = Teacher(num_games=6, depth=2, opponent_depth=1, tie_break=tie_break)
    rows = ENV.demonstrations(teacher, jax.random.PRNGKey(0), ENV.params, 21)
    assert rows
    for row in rows:
        msgs = [row["prompt"][1]] + row["completion"]
        board = ref.new_board()
        first = msgs[0]["content"].splitlines()[0]
        if first.startswith("O played"):
            board = ref.drop(board, int(first.split()[2].rstrip(".")), 2)
        for j in range(0, len(msgs) - 1, 2):
            reply = msgs[j + 1]["content"]
            col = int(reply.split("<move>")[1].split("</move>")[0])
            best = ref.best_columns(board, 1, 2)
            assert col in best
            if tie_break == "center":
                assert abs(col - 3) == min(abs(c - 3) for c in best)
            board = ref.drop(board, col, 1)
            status_line = msgs[j + 2]["content"].splitlines()[0]
            if status_line.startswith("O played"):
                k = int(status_line.split()[2].rstrip("."))
                board = ref.drop(board, k, 2)
            status, k = next((st, k) for st, t in _STATUS.items() for k in range(7)
                             if t.replace("{k}", str(k)) == status_line)
            assert msgs[j + 2]["content"] == _independent_message(board, status, k)
        assert row["info"]["outcome"] in ("win", "draw")


def test_the_cpu_preset_loads_and_binds_the_env():
    from pathlib import Path

    from jaxrl_llm.config import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "experiments" / "presets" / "connect_four_cpu.toml")
    assert config.env.name == "connect_four" and config.env.params.max_depth == 4
    assert config.sft.teacher.depth <= config.env.params.max_depth
    assert config.grpo[0].curriculum.depth == 2
