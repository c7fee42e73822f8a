"""Multi-turn rollouts (of the Tic-Tac-Toe env) against an independent host-side implementation of the spec.

The host side plays the same games with `tests/reference_tictactoe.RefGame` (rules, counters, rubric) and
writes them with `tests/reference_text` (the spec's texts) and the tokenizer's chat template. The only
thing it borrows from the package is the opponent's choice (`envs.tictactoe.reset` / `opponent_move`,
the seeded randomness that the environment's own tests check), used as an oracle.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_text as rt
from envs import tictactoe as ttt
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.generate import SamplingConfig
from models.family import cached_call
from jaxrl_llm.text import load_tokenizer
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache
from reference_tictactoe import RefGame, ref_total_reward

MAX_TURNS = 8
MAX_NEW = 24
CONTEXT = 1152  # reference preset: 126-token prefix + 8 x (message <= 84 + reply <= 24) + final message


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


ENV = ttt.TicTacToe(ttt.Params(prompt="reference"))
COMPACT = ttt.TicTacToe(ttt.Params(prompt="compact"))
SCRIPTED = SamplingConfig(max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def tables(tok):
    return text.tables_for_env(tok, ENV)


_reset = jax.jit(ttt.reset)
_opponent = jax.jit(ttt.opponent_move)


def outcome(traj) -> np.ndarray:
    """The reference's outcome codes (4 = unfinished) from a trajectory's final states."""
    return np.where(np.asarray(traj.final_state.done), np.asarray(traj.final_state.outcome), 4)


def scripted_rollout(tables, policy, seeds, probs, config, env=ENV):
    examples = ttt.Example(jnp.asarray(seeds, jnp.uint32), jnp.asarray(probs, jnp.float32))
    return jax.jit(lambda ex, k: ro.rollout(env, policy, None, None, None, tables, ex, k, config, SCRIPTED))(
        examples, jax.random.PRNGKey(0))


def _reply_text(rng: random.Random, board) -> str:
    """A scripted reply of a random kind: valid, occupied cell, not a cell, no tag, over-long (cut)."""
    free = [i for i in range(9) if board[i] == 0]
    taken = [i for i in range(9) if board[i] != 0]
    kind = rng.choices(["valid", "occupied", "garbage", "missing", "long"], [0.6, 0.1, 0.1, 0.1, 0.1])[0]
    think = rng.choice(["<think>Centre is strongest.</think>", "<think>I must block.</think>\n", ""])
    if kind == "valid":
        return f"{think}<move>{rng.choice(free)}</move>"
    if kind == "occupied" and taken:
        return f"{think}<move> {rng.choice(taken)} </move>"
    if kind in ("garbage", "occupied"):
        return f"{think}<move>{rng.choice(['10', 'x', '', '4 5', '-1'])}</move>"
    if kind == "missing":
        return rng.choice(["I play 4.", "<think>hmm</think>", "<move 4>", "move: 3"])
    # Longer than max_new_tokens: the sampler would cut it, with or without a complete tag.
    return rng.choice([f"<move>{rng.choice(free)}</move>", ""]) + " and then " * 12


def _play_on_host(tok, seed: int, p: float, rng: random.Random):
    """One game on the host: (reply texts as scripted, cut texts as seen, messages, RefGame, last cut?)."""
    start = _reset(np.uint32(seed), np.float32(p))
    board = [int(v) for v in np.asarray(start.board)]
    game = RefGame(board=board, max_turns=MAX_TURNS)
    messages = [(tuple(board), int(start.status), int(start.last_opponent_move))]
    scripted, seen, cut = [], [], []
    opp = lambda b: int(_opponent(jnp.asarray(b, jnp.int8), np.uint32(seed), np.float32(p)))
    while not game.done:
        reply = _reply_text(rng, game.board)
        ids = tok.encode(reply, add_special_tokens=False)
        truncated = len(ids) + 1 > MAX_NEW
        shown = tok.decode(ids[:MAX_NEW]) if truncated else reply
        scripted.append(reply)
        seen.append(shown)
        cut.append(truncated)
        game.reply(rt.parse_move(shown), opp)
        if game.status in rt.FINAL:
            messages.append((tuple(game.board), game.status, game.last_opponent_move))
        elif not game.done:
            messages.append((tuple(game.board), game.status, game.last_opponent_move))
    return scripted, seen, messages, game, cut


def _expected_text(tok, seen, messages, game, cut) -> str:
    """The conversation the chat template writes, ending where the rollout's buffer ends."""
    conv = rt.conversation(messages, seen, len(messages) - 1)
    if len(seen) == len(messages):  # the game ended without a final message (max_turns)
        conv.append({"role": "assistant", "content": seen[-1]})
    whole = tok.apply_chat_template(conv, tokenize=False)
    if len(seen) == len(messages):
        # The buffer stops right after the last reply: no newline, and no end-of-turn if it was cut.
        whole = whole.removesuffix("\n").removesuffix("<|im_end|>" if cut[-1] else "")
    return whole


@pytest.fixture(scope="module")
def scripted_games(tok, tables):
    rng = random.Random(1234)
    n = 96
    seeds = [rng.randrange(2**32) for _ in range(n)]
    probs = [rng.choice([0.0, 0.3, 1.0]) for _ in range(n)]
    host = [_play_on_host(tok, s, p, rng) for s, p in zip(seeds, probs)]
    reply_tokens, reply_lengths = ro.script_replies(tok, [h[0] for h in host], MAX_TURNS, MAX_NEW)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    config = ro.RolloutConfig(context_length=CONTEXT, max_turns=MAX_TURNS)
    return host, jax.device_get(scripted_rollout(tables, policy, seeds, probs, config))


def test_scripted_conversations_equal_the_reference_text(tok, scripted_games):
    host, traj = scripted_games
    statuses = set()
    for b, (scripted, seen, messages, game, cut) in enumerate(host):
        statuses.update(m[1] for m in messages)
        assert ro.decode_game(tok, traj, b) == _expected_text(tok, seen, messages, game, cut), f"game {b}"
    # The sample covers every status kind and both first movers.
    assert statuses == set(range(ttt.NUM_STATUS))


def test_scripted_tokens_equal_the_chat_template_tokens(tok, scripted_games):
    host, traj = scripted_games
    checked = 0
    for b, (scripted, seen, messages, game, cut) in enumerate(host):
        if any(cut):
            continue  # a cut reply's tokens are the sampler's, not a fresh tokenization of its text
        conv = rt.conversation(messages, seen, len(messages) - 1)
        finished_with_message = len(seen) < len(messages)
        if not finished_with_message:
            conv.append({"role": "assistant", "content": seen[-1]})
        ids = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        if not finished_with_message:
            ids = ids[:-1]  # the trailing newline after the last reply is not in the buffer
        n = int(traj.length[b])
        np.testing.assert_array_equal(traj.tokens[b, :n], ids)
        assert (traj.tokens[b, n:] == tok.pad_token_id).all()
        checked += 1
    assert checked > 20


def test_scripted_rewards_outcomes_and_counters_equal_the_reference(scripted_games):
    host, traj = scripted_games
    outcomes = set()
    for b, (scripted, seen, messages, game, cut) in enumerate(host):
        fmt = float(np.mean([rt.format_ok(s) for s in seen]))
        assert int(outcome(traj)[b]) == game.outcome
        assert int(traj.final_state.invalid_moves[b]) == game.invalid
        assert int(traj.final_state.missing_moves[b]) == game.missing
        assert int(traj.turns[b]) == game.turns == len(seen)
        assert bool(traj.truncated[b]) == (game.outcome == 4)  # the reference's UNFINISHED
        np.testing.assert_allclose(traj.reward_parts["format"][b], fmt, rtol=1e-6)
        np.testing.assert_allclose(traj.reward[b], ref_total_reward(game.outcome, game.invalid, fmt), atol=1e-6)
        np.testing.assert_array_equal(traj.reply_truncated[b, : len(seen)], cut)
        assert not traj.context_cut[b]
        outcomes.add(game.outcome)
    assert outcomes >= {ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW, ttt.OUTCOME_LOSS, 4}


def test_scripted_loss_mask_covers_exactly_the_replies(tok, scripted_games):
    host, traj = scripted_games
    for b, (scripted, seen, messages, game, cut) in enumerate(host):
        mask = traj.loss_mask[b].astype(bool)
        expected = [t for t, s in zip(range(len(seen)), scripted) for _ in range(int(traj.reply_lengths[b, t]))]
        assert mask.sum() == len(expected) == traj.reply_lengths[b].sum()
        # The masked tokens, read back in order, are the scripted replies (cut ones without end-of-turn).
        got = traj.tokens[b][mask].tolist()
        want = []
        for s, c in zip(scripted, cut):
            ids = tok.encode(s, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            want += ids[:MAX_NEW]
        assert got == want


def test_context_limit_cuts_games_and_marks_them(tok, tables):
    rng = random.Random(7)
    seeds = [rng.randrange(2**32) for _ in range(8)]
    replies = [["<move>4</move>", "I pass.", "I pass.", "I pass.", "I pass."]] * 8
    reply_tokens, reply_lengths = ro.script_replies(tok, replies, MAX_TURNS, MAX_NEW)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    small = 126 + 3 * (84 + MAX_NEW)  # room for about three turns
    config = ro.RolloutConfig(context_length=small, max_turns=MAX_TURNS)
    traj = scripted_rollout(tables, policy, seeds, np.zeros(8), config)
    assert traj.context_cut.all() and traj.truncated.all()
    assert (outcome(traj) == 4).all() and (traj.metrics["unfinished"] == 1).all()
    assert (traj.length <= small).all() and (traj.turns < 5).all()
    for b in range(8):
        assert ro.decode_game(tok, traj, b).endswith("<|im_end|>")


# ---------------------------------------------------------------------------------------------------
# With a random tiny model


@pytest.fixture(scope="module")
def tiny_model(tok):
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=len(tok))
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return config, module, params


@pytest.fixture(scope="module")
def compact_tables(tok):
    return text.tables_for_env(tok, COMPACT)


MODEL_SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def model_games(tiny_model, compact_tables):
    config, module, params = tiny_model
    rc = ro.RolloutConfig(context_length=448)
    run = ro.make_rollout(COMPACT, cached_call(module), lambda b, n: init_cache(config, b, n), compact_tables, rc,
                          MODEL_SAMPLING, return_cache=True)
    examples = ttt.Example(jnp.asarray(np.repeat(np.arange(4), 4), jnp.uint32), jnp.full((16,), 0.5, jnp.float32))
    traj, cache = run(params, examples, jax.random.PRNGKey(3))
    return run, examples, traj, cache


def test_model_rollout_masks_logprobs_and_cache_match_a_full_forward(tiny_model, model_games, compact_tables):
    config, module, params = tiny_model
    run, examples, traj, cache = model_games
    np.testing.assert_array_equal(cache.lengths, traj.length)
    mask = np.asarray(traj.loss_mask).astype(bool)
    np.testing.assert_array_equal(mask.sum(1), np.asarray(traj.reply_lengths).sum(1))
    # The sampler's log-probs (temperature 1) equal a full forward over the final conversation.
    logits, _ = module.apply({"params": params}, traj.tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    at_token = np.asarray(jnp.take_along_axis(logp, traj.tokens[:, 1:, None], axis=-1)[..., 0])
    np.testing.assert_allclose(np.asarray(traj.logprobs)[:, 1:][mask[:, 1:]], at_token[mask[:, 1:]], atol=1e-4)
    assert (np.asarray(traj.logprobs)[~mask] == 0).all()
    # The cache after the loop continues the conversation exactly like a full forward over it.
    probe = jnp.full((16, 1), 5, jnp.int32)
    cached, _ = module.apply({"params": params}, probe, cache=cache, num_valid=jnp.ones((16,), jnp.int32))
    rows = jnp.arange(16)
    extended = traj.tokens.at[rows, jnp.minimum(traj.length, traj.tokens.shape[1] - 1)].set(5)
    full, _ = module.apply({"params": params}, jnp.pad(extended, ((0, 0), (0, 1))))
    want = full[rows, traj.length]
    np.testing.assert_allclose(np.asarray(cached[:, 0]), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_same_key_same_games(tiny_model, model_games, tok):
    config, module, params = tiny_model
    run, examples, traj, cache = model_games
    again, _ = run(params, examples, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(again.tokens, traj.tokens)
    other, _ = run(params, examples, jax.random.PRNGKey(4))
    assert not np.array_equal(other.tokens, traj.tokens)


def test_cache_stages_change_nothing_but_the_cache_size(tiny_model, model_games, compact_tables):
    """A cache grown in stages gives the same games, tokens and log-probs as one full-size cache."""
    config, module, params = tiny_model
    run, examples, traj, cache = model_games
    rc = ro.RolloutConfig(context_length=448, cache_stages=3)
    plan = ro.cache_stage_plan(rc, MODEL_SAMPLING.max_new_tokens, compact_tables.prefix.shape[0],
                               compact_tables.max_msg + 1)
    assert len(plan) >= 2 and plan[-1] == (rc.max_turns, 448)  # stages that reach 448 merge
    assert [p for _, p in plan] == sorted(p for _, p in plan) and plan[0][1] < 448
    staged = ro.make_rollout(COMPACT, cached_call(module), lambda b, n: init_cache(config, b, n), compact_tables,
                             rc, MODEL_SAMPLING, return_cache=True)
    again, staged_cache = staged(params, examples, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(again.tokens, traj.tokens)
    np.testing.assert_array_equal(outcome(again), outcome(traj))
    np.testing.assert_allclose(again.logprobs, traj.logprobs, atol=1e-5)
    assert staged_cache.max_len == cache.max_len == 448
    np.testing.assert_array_equal(staged_cache.lengths, cache.lengths)


def test_cache_stage_plan_covers_every_turn():
    tables_len, chunk = 60, 80
    for turns in (1, 2, 5, 8):
        for stages in (1, 2, 3, 8, 20):
            rc = ro.RolloutConfig(context_length=1024, max_turns=turns, cache_stages=stages)
            plan = ro.cache_stage_plan(rc, 24, tables_len, chunk)
            ends = [e for e, _ in plan]
            assert ends == sorted(set(ends)) and ends[-1] == turns and plan[-1][1] == 1024
            for end, positions in plan:  # each stage's cache holds what its last turn can reach
                assert positions >= min(1024, tables_len + end * (chunk + 24))
    with pytest.raises(ValueError, match="cache_stages"):
        ro.RolloutConfig(cache_stages=0)
    with pytest.raises(ValueError, match="max_turns"):
        ro.RolloutConfig(max_turns=0)


def _opponent_replies(conversation: str) -> dict[tuple, int]:
    """From a conversation's text alone: board after each model move -> the opponent's reply."""
    board = [0] * 9
    first = re.search(r"Game started\. Opponent \(O\) played at position (\d)\.", conversation)
    if first:
        board[int(first.group(1))] = 2
    replies = {}
    turns = re.split(r"<\|im_start\|>assistant\n", conversation)[1:]
    for turn in turns:
        reply, _, after = turn.partition("<|im_start|>user\n")
        move = rt.parse_move(reply.split("<|im_end|>")[0])
        opp = re.match(r"Opponent \(O\) played at position (\d)\.", after)
        if 0 <= move <= 8 and board[move] == 0 and not after.startswith(("Invalid", "Please")):
            board[move] = 1
            if opp:
                replies[tuple(board)] = int(opp.group(1))
                board[int(opp.group(1))] = 2
    return replies


def test_games_with_equal_seeds_meet_equal_opponent_replies_on_equal_boards(tok, tables):
    """16 games of one example (same seed and p), random scripted moves: equal boards, equal replies."""
    rng = random.Random(5)
    replies = [[f"<move>{rng.randrange(9)}</move>" for _ in range(MAX_TURNS)] for _ in range(32)]
    reply_tokens, reply_lengths = ro.script_replies(tok, replies, MAX_TURNS, MAX_NEW)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    config = ro.RolloutConfig(context_length=CONTEXT, max_turns=MAX_TURNS)
    traj = scripted_rollout(tables, policy, [11] * 16 + [12] * 16, np.full(32, 0.6), config)
    shared = 0
    for group in (range(16), range(16, 32)):
        seen: dict[tuple, int] = {}
        for b in group:
            for board, reply in _opponent_replies(ro.decode_game(tok, traj, b)).items():
                if board in seen:
                    assert seen[board] == reply, (board, seen[board], reply)
                    shared += 1
                seen[board] = reply
    assert shared > 5  # the check had boards in common to compare


def test_jsonl_writer_and_game_records(tok, scripted_games, tmp_path):
    host, traj = scripted_games
    path = ro.write_games_jsonl(tmp_path / "games.jsonl", ENV, tok, traj, indices=[0, 1, 2])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["conversation"] == ro.decode_game(tok, traj, 0)
    names = {ttt.OUTCOME_WIN: "win", ttt.OUTCOME_DRAW: "draw", ttt.OUTCOME_LOSS: "loss", 4: "unfinished"}
    for r, o in zip(rows, outcome(traj)[:3]):
        assert r["outcome"] == names[int(o)] and r["seed"] == int(traj.examples.seed[r["index"]])
        assert set(r["metrics"]) == {"win", "draw", "loss", "unfinished", "invalid", "missing"}
        assert set(r["reward_parts"]) == {"win", "format", "invalid"} and len(r["reply_kinds"]) == r["turns"]


def test_context_too_small_for_one_turn_is_refused(tables):
    config = ro.RolloutConfig(context_length=100, max_turns=MAX_TURNS)
    policy = ro.scripted_policy(jnp.zeros((1, MAX_TURNS, MAX_NEW), jnp.int32), jnp.zeros((1, MAX_TURNS), jnp.int32), tables.eos_id)
    examples = ttt.Example(jnp.zeros((1,), jnp.uint32), jnp.zeros((1,)))
    with pytest.raises(ValueError, match="raise context_length"):
        ro.rollout(ENV, policy, None, None, None, tables, examples, jax.random.PRNGKey(0), config, SCRIPTED)
