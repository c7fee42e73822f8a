"""Per-turn credit (issue 30, part 2): `algos.advantages` against an independent pure-Python computation, the
option off changing nothing, the env's per-turn protocol (`turn_reward`, `state_key`) and the rollout's per-turn
fields on a real (scripted) Tic-Tac-Toe rollout, checked against a host replay of the same games."""

from __future__ import annotations

import random
import re
import statistics
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs import tictactoe as ttt
from envs.core import Env, hash_leaves
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.algos.advantages import (advantage_inputs, advantage_metrics, step_metrics, token_advantages,
                                         turn_returns)
from jaxrl_llm.algos.grpo import GrpoConfig, group_advantages
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.generate import SamplingConfig
from jaxrl_llm.text import load_tokenizer
from reference_tictactoe import RefGame

# ----------------------------------------------------------------------------------------------------------
# The independent reference (plain Python, the definitions of the module docstring)
# ----------------------------------------------------------------------------------------------------------


def _normalise(values: list[float], scale: str, eps: float) -> list[float]:
    if len(values) < 2 or all(v == values[0] for v in values):
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    if scale == "none":
        return [v - mean for v in values]
    std = statistics.stdev(values)  # sample std, ddof 1
    return [(v - mean) / (std + eps) for v in values]


def ref_token_advantages(mode, rewards, turn_rewards, keys, played, token_turn, group_size, discount=0.95,
                         scale="group", eps=1e-4, episode_weight=1.0, step_weight=1.0):
    """Nested lists in, nested lists out: the advantage of every token."""
    batch, turns = len(rewards), len(turn_rewards[0])
    episode = []
    for g in range(0, batch, group_size):
        episode += _normalise([float(r) for r in rewards[g:g + group_size]], scale, eps)
    returns = {}
    for b in range(batch):
        n = sum(bool(p) for p in played[b])
        for t in range(n):
            returns[b, t] = (sum(discount ** (k - t) * float(turn_rewards[b][k]) for k in range(t, n))
                             + discount ** (n - 1 - t) * float(rewards[b]))
    groups: dict = {}
    for (b, t) in returns:
        groups.setdefault((b // group_size, int(keys[b][t])), []).append((b, t))
    step = {}
    for members in groups.values():
        for m, a in zip(members, _normalise([returns[m] for m in members], scale, eps)):
            step[m] = a
    out = []
    for b in range(batch):
        row = []
        for t in token_turn[b]:
            s = step.get((b, int(t)), 0.0) if t >= 0 else 0.0
            row.append({"episode": episode[b], "step": s,
                        "mix": episode_weight * episode[b] + step_weight * s}[mode])
        out.append(row)
    return out


def random_batch(rng: np.random.Generator, groups=3, group_size=4, turns=4, length=40, num_keys=3):
    """Hand-made trajectories: turn prefixes of 1..T turns, keys from a few states (repeats inside a game and
    across games), invalid-move penalties on some turns, replies at random positions of the row."""
    batch = groups * group_size
    n = rng.integers(1, turns + 1, batch)
    played = np.arange(turns)[None, :] < n[:, None]
    keys = np.where(played, rng.integers(1, num_keys + 1, (batch, turns)), 0).astype(np.uint32)
    turn_rewards = np.where(played & (rng.random((batch, turns)) < 0.3), -0.1, 0.0).astype(np.float32)
    rewards = rng.choice([0.0, 0.5, 1.0, 1.2, -0.1], batch).astype(np.float32)
    token_turn = np.full((batch, length), -1, np.int32)
    for b in range(batch):
        pos = int(rng.integers(0, 3))
        for t in range(n[b]):
            pos += int(rng.integers(1, 4))  # a message
            size = int(rng.integers(1, 5))
            token_turn[b, pos:pos + size] = t
            pos += size
    return rewards, turn_rewards, keys, played, token_turn


_jitted = jax.jit(token_advantages, static_argnums=(0, 6))

# ----------------------------------------------------------------------------------------------------------
# Advantages against the reference
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["episode", "step", "mix"])
@pytest.mark.parametrize("discount,scale", [(0.95, "group"), (1.0, "none"), (0.0, "group"), (0.5, "none")])
def test_token_advantages_equal_the_python_reference(mode, discount, scale):
    rng = np.random.default_rng(zlib.crc32(repr((mode, discount, scale)).encode()))
    config = GrpoConfig(advantage=mode, step_discount=discount, scale_rewards=scale,
                        episode_weight=0.7, step_weight=1.5)
    for _ in range(5):
        rewards, turn_rewards, keys, played, token_turn = random_batch(rng)
        got = np.asarray(_jitted(config, rewards, turn_rewards, keys, played, token_turn, 4))
        want = np.asarray(ref_token_advantages(mode, rewards.tolist(), turn_rewards.tolist(), keys.tolist(),
                                               played.tolist(), token_turn.tolist(), 4, discount, scale, 1e-4,
                                               0.7, 1.5), np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if mode == "step":
            assert (got[token_turn < 0] == 0).all()  # off the replies: exactly 0


def test_a_hand_computed_example():
    """One group of two games from the same opening; the first plays an invalid move, then both win."""
    # Game 0: turn 0 invalid (state a), turn 1 from a again, wins (R = 1 - 0.1 rubric). Game 1: turn 0 from a,
    # turn 1 from c, wins (R = 1).
    rewards = np.array([0.9, 1.0], np.float32)
    turn_rewards = np.array([[-0.1, 0.0], [0.0, 0.0]], np.float32)
    keys = np.array([[7, 7], [7, 9]], np.uint32)
    played = np.ones((2, 2), bool)
    gamma = 0.5
    returns = np.asarray(turn_returns(rewards, turn_rewards, played, gamma))
    np.testing.assert_allclose(returns, [[-0.1 + 0.5 * 0.9, 0.9], [0.5 * 1.0, 1.0]], rtol=1e-6)
    # Step group of key 7: returns 0.35, 0.9, 0.5 (game 1's turn 1 is alone: advantage 0).
    g = np.array([0.35, 0.9, 0.5])
    a = (g - g.mean()) / (g.std(ddof=1) + 1e-4)
    token_turn = np.array([[-1, 0, 0, -1, 1], [-1, 0, -1, 1, 1]], np.int32)
    config = GrpoConfig(advantage="step", step_discount=gamma)
    got = np.asarray(token_advantages(config, rewards, turn_rewards, keys, played, token_turn, 2))
    np.testing.assert_allclose(got, [[0, a[0], a[0], 0, a[1]], [0, a[2], 0, 0, 0]], rtol=1e-5)
    metrics = jax.device_get(step_metrics(config, rewards, turn_rewards, keys, played, 2))
    assert metrics["step_shared_frac"] == pytest.approx(0.75)
    assert metrics["step_advantage_nonzero_frac"] == pytest.approx(0.75)


def test_step_groups_stay_inside_their_grpo_group():
    """Equal keys in different GRPO groups do not meet: every game alone in its group gets 0."""
    rewards = np.array([0.0, 1.0, 0.5, 1.0], np.float32)
    keys = np.full((4, 1), 5, np.uint32)
    played = np.ones((4, 1), bool)
    config = GrpoConfig(advantage="step")
    token_turn = np.zeros((4, 3), np.int32)
    got = np.asarray(token_advantages(config, rewards, np.zeros((4, 1), np.float32), keys, played, token_turn, 2))
    want = np.asarray(group_advantages(rewards, 2))  # one turn, one state per group: the episode advantage
    np.testing.assert_allclose(got, np.broadcast_to(want[:, None], (4, 3)), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The option off changes nothing; the settings are checked
# ----------------------------------------------------------------------------------------------------------


def test_episode_advantage_is_todays_group_advantage_on_every_token():
    assert GrpoConfig().advantage == "episode"
    rng = np.random.default_rng(0)
    for scale in ("group", "none"):
        rewards, turn_rewards, keys, played, token_turn = random_batch(rng)
        config = GrpoConfig(scale_rewards=scale)
        got = np.asarray(_jitted(config, rewards, turn_rewards, keys, played, token_turn, 4))
        want = np.asarray(group_advantages(rewards, 4, scale))
        np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


def test_advantage_settings_are_validated():
    for kwargs, field in [({"advantage": "gigpo"}, "advantage"), ({"step_discount": 1.5}, "step_discount"),
                          ({"step_discount": -0.1}, "step_discount"), ({"episode_weight": -1.0}, "episode_weight"),
                          ({"step_weight": float("nan")}, "step_weight"),
                          ({"advantage": "mix", "episode_weight": 0.0, "step_weight": 0.0}, "step_weight")]:
        with pytest.raises(ConfigError) as err:
            GrpoConfig(**kwargs)
        assert err.value.path == (field,), (kwargs, err.value)
    GrpoConfig(advantage="mix", episode_weight=0.0, step_weight=1.0, step_discount=1.0)


def test_loss_table_reads_the_advantage_settings():
    from jaxrl_llm.config import loads_config

    config = loads_config('[[grpo]]\nsteps = 1\n[grpo.loss]\nadvantage = "mix"\nstep_weight = 0.5\n'
                              'step_discount = 0.9\n')
    loss = config.grpo[0].grpo_config()
    assert (loss.advantage, loss.step_weight, loss.step_discount) == ("mix", 0.5, 0.9)
    with pytest.raises(ConfigError) as err:
        loads_config('[[grpo]]\nsteps = 1\n[grpo.loss]\nadvantage = "steps"\n')
    assert "advantage" in str(err.value)


# ----------------------------------------------------------------------------------------------------------
# The env's per-turn protocol
# ----------------------------------------------------------------------------------------------------------


def test_board_keys_separate_every_board_and_ignore_the_rest():
    digits = np.array(np.meshgrid(*[np.arange(3)] * 9, indexing="ij")).reshape(9, -1).T.astype(np.int8)  # 3^9
    env = ttt.TicTacToe()
    start = jax.jit(ttt.reset)(np.uint32(3), np.float32(0.5))
    states = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(digits),) + x.shape), start)
    states = states._replace(board=jnp.asarray(digits))
    keys = np.asarray(jax.jit(jax.vmap(lambda s: env.state_key(s, env.params)))(states))
    assert keys.dtype == np.uint32 and len(np.unique(keys)) == len(digits)
    other = start._replace(seed=np.uint32(99), turns=np.int32(4), status=np.int8(3))
    assert int(env.state_key(start, env.params)) == int(env.state_key(other, env.params))
    # The default key hashes every leaf, so the seed changes it.
    assert int(hash_leaves(start)) != int(hash_leaves(other))
    assert int(hash_leaves((jnp.float32(1.0), jnp.int8(-1)))) == int(hash_leaves((jnp.float32(1.0), jnp.int8(-1))))


def test_board_turn_reward_is_the_weighted_invalid_penalty():
    env = ttt.TicTacToe(ttt.Params(invalid_penalty=-0.25, invalid_weight=2.0))
    state = jax.jit(ttt.reset)(np.uint32(5), np.float32(1.0))
    occupied = int(np.flatnonzero(np.asarray(state.board))[0]) if np.asarray(state.board).any() else None
    free = int(np.flatnonzero(np.asarray(state.board) == 0)[0])
    bad = ttt.step(state, jnp.int32(occupied if occupied is not None else 9))
    good = ttt.step(state, jnp.int32(free))
    assert float(env.turn_reward(state, bad, env.params)) == pytest.approx(-0.5)
    assert float(env.turn_reward(state, good, env.params)) == 0.0
    assert float(Env.turn_reward(env, state, bad, env.params)) == 0.0  # the protocol's default


# ----------------------------------------------------------------------------------------------------------
# The rollout's per-turn fields on a real rollout
# ----------------------------------------------------------------------------------------------------------

MAX_TURNS, MAX_NEW, GROUP = 6, 20, 4
ENV = ttt.TicTacToe(ttt.Params(prompt="compact"))


def _reply(rng: random.Random, board) -> str:
    free = [i for i in range(9) if board[i] == 0]
    taken = [i for i in range(9) if board[i] != 0]
    kind = rng.choices(["valid", "occupied", "garbage", "missing"], [0.6, 0.2, 0.1, 0.1])[0]
    if kind == "valid":
        return f"<think>ok</think><move>{rng.choice(free[:2])}</move>"  # few choices: boards repeat
    if kind == "occupied" and taken:
        return f"<think>ok</think><move>{rng.choice(taken)}</move>"
    if kind in ("occupied", "garbage"):
        return "<move>x</move>"
    return "I play 4."


@pytest.fixture(scope="module")
def played_games():
    tok = load_tokenizer()
    tables = text.tables_for_env(tok, ENV)
    rng = random.Random(7)
    seeds = np.repeat([rng.randrange(2**32) for _ in range(4)], GROUP).astype(np.uint32)
    probs = np.full(len(seeds), 0.0, np.float32)  # the optimal opponent: equal moves meet equal replies
    reset, opponent = jax.jit(ttt.reset), jax.jit(ttt.opponent_move)
    host = []
    for seed, p in zip(seeds, probs):
        start = reset(seed, p)
        game = RefGame(board=[int(v) for v in np.asarray(start.board)], max_turns=MAX_TURNS)
        replies, boards, invalid = [], [], []
        while not game.done and len(replies) < MAX_TURNS:
            reply = _reply(rng, game.board)
            boards.append(tuple(game.board))
            before = game.invalid
            m = re.search(r"<move>(.*?)</move>", reply)
            move = -1 if m is None else (int(m.group(1)) if m.group(1).isdigit() else 99)
            game.reply(move, lambda b: int(opponent(jnp.asarray(b, jnp.int8), seed, p)))
            replies.append(reply)
            invalid.append(game.invalid > before)
        host.append((replies, boards, invalid))
    reply_tokens, reply_lengths = ro.script_replies(tok, [h[0] for h in host], MAX_TURNS, MAX_NEW)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    config = ro.RolloutConfig(context_length=640, max_turns=MAX_TURNS)
    examples = ttt.Example(jnp.asarray(seeds), jnp.asarray(probs))
    run = jax.jit(lambda ex, k: ro.rollout(ENV, policy, None, None, None, tables, ex, k, config,
                                           SamplingConfig(max_new_tokens=MAX_NEW)))
    return tok, host, jax.device_get(run(examples, jax.random.PRNGKey(0)))


def test_rollout_records_each_turns_tokens_reward_key_and_legal_choices(played_games):
    tok, host, traj = played_games
    batch = len(host)
    assert traj.token_turn.shape == traj.tokens.shape and traj.turn_legal.shape == (batch, MAX_TURNS, 9)
    np.testing.assert_array_equal(traj.token_turn >= 0, traj.loss_mask > 0)
    flat_keys, flat_boards = [], []
    for b, (replies, boards, invalid) in enumerate(host):
        n = len(replies)
        assert traj.turns[b] == n and list(np.flatnonzero(traj.reply_kind[b] >= 0)) == list(range(n))
        assert traj.token_turn[b].max() == n - 1
        for t in range(MAX_TURNS):
            ids = traj.tokens[b][traj.token_turn[b] == t]
            assert len(ids) == traj.reply_lengths[b, t]
            if t >= n:
                assert traj.turn_keys[b, t] == 0 and traj.turn_rewards[b, t] == 0 and not traj.turn_legal[b, t].any()
                continue
            assert tok.decode(ids) == replies[t] + "<|im_end|>"
            assert traj.turn_rewards[b, t] == pytest.approx(-0.1 if invalid[t] else 0.0)
            np.testing.assert_array_equal(traj.turn_legal[b, t], np.asarray(boards[t]) == 0)
            assert traj.turn_keys[b, t] != 0
            flat_keys.append(int(traj.turn_keys[b, t]))
            flat_boards.append(boards[t])
        assert (traj.turn_rewards[b] != 0).sum() == traj.final_state.invalid_moves[b]
    same_key = np.array(flat_keys)[:, None] == np.array(flat_keys)[None, :]
    same_board = np.array([[x == y for y in flat_boards] for x in flat_boards])
    np.testing.assert_array_equal(same_key, same_board)
    assert same_board.sum() > 2 * len(flat_boards)  # the games do meet on equal boards


def test_rollout_advantages_equal_the_reference(played_games):
    _, _, traj = played_games
    played = traj.reply_kind >= 0
    for mode in ("step", "mix"):
        config = GrpoConfig(advantage=mode)
        got = np.asarray(token_advantages(config, traj.reward, traj.turn_rewards, traj.turn_keys, played,
                                          traj.token_turn, GROUP))
        want = ref_token_advantages(mode, traj.reward.tolist(), traj.turn_rewards.tolist(), traj.turn_keys.tolist(),
                                    played.tolist(), traj.token_turn.tolist(), GROUP)
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-5, atol=1e-6)
        assert (got[traj.loss_mask > 0] != 0).any()


def test_the_grpo_step_gets_advantages_only_when_the_option_is_on(played_games):
    """`make_grpo_step` passes `advantage_inputs(gcfg, traj, group_size)` to the update: nothing with "episode"
    (today's path, bit for bit), the per-token advantages otherwise; `advantage_metrics` likewise."""
    _, _, traj = played_games
    assert advantage_inputs(GrpoConfig(), traj, GROUP) == {}
    assert advantage_metrics(GrpoConfig(), traj, GROUP) == {}
    config = GrpoConfig(advantage="step", step_discount=0.9)
    got = advantage_inputs(config, traj, GROUP)["advantages"]
    want = token_advantages(config, traj.reward, traj.turn_rewards, traj.turn_keys, traj.reply_kind >= 0,
                            traj.token_turn, GROUP)
    np.testing.assert_array_equal(got, want)
    metrics = jax.device_get(advantage_metrics(config, traj, GROUP))
    assert 0 < metrics["step_advantage_nonzero_frac"] <= metrics["step_shared_frac"] <= 1
