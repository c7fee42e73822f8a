"""The arithmetic env (envs/arithmetic) against an independent pure-Python reference (tests/reference_arithmetic.py):
the draw on the same seeds, the messages, the reply reading (hypothesis vs Python `re`), the rubric and metrics
through a scripted rollout, stage / level / config validation, the text bridge, and a tiny model's rollout."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs import arithmetic as ar
from envs.arithmetic import task
from envs.prng import fold_in_words
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.config import load_config
from jaxrl_llm.generate import SamplingConfig
from jaxrl_llm.text.grammar import parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
import reference_arithmetic as ref  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "arithmetic_cpu.toml"
ENV = envs.make("arithmetic", prompt="tiny")
GRAMMAR = ENV.reply_grammar(ENV.params)
problems_of = jax.jit(jax.vmap(task.problem))


@pytest.fixture(scope="module")
def tok():
    return text.load_tokenizer()


def host_problems(seeds, levels) -> dict:
    p = jax.device_get(problems_of(jnp.asarray(seeds, jnp.uint32), jnp.asarray(levels, jnp.int32)))
    return {k: np.asarray(v) for k, v in p._asdict().items()}


# ---------------------------------------------------------------------------------------------------------
# The draw
# ---------------------------------------------------------------------------------------------------------


def test_draw_matches_the_reference_on_the_same_seeds():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([[0, 1, 2**31, 2**32 - 1], rng.integers(0, 2**32, 296, dtype=np.uint64)]).astype(np.uint32)
    s, lv = np.repeat(seeds, task.NUM_LEVELS), np.tile(np.arange(task.NUM_LEVELS), len(seeds))
    got = host_problems(s, lv)
    for i in range(len(s)):
        want = ref.problem(int(s[i]), int(lv[i]))
        assert (got["a"][i], got["b"][i], "+-x"[got["op"][i]], got["digits"][i], got["answer"][i]) == (
            want["a"], want["b"], want["op"], want["digits"], want["answer"]), (int(s[i]), int(lv[i]))
    assert [task.level_name(i) for i in range(task.NUM_LEVELS)] == [ref.level_name(i) for i in range(task.NUM_LEVELS)]
    assert all(task.level_index(d, op) == ref.level(d, op) for d in range(1, 5) for op in "+-x")


def test_shared_draw_is_jax_fold_in_bit_for_bit():
    seeds = jax.random.bits(jax.random.PRNGKey(1), (512,), jnp.uint32)
    data = jax.random.bits(jax.random.PRNGKey(2), (512,), jnp.uint32)
    want = jax.vmap(lambda s, d: jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(s), d)))(seeds, data)
    got = jnp.stack(jax.jit(jax.vmap(fold_in_words))(seeds, data), axis=-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert ref.fold_in_words(int(seeds[0]), int(data[0])) == tuple(int(x) for x in want[0])


def test_operands_have_exactly_the_level_digits_and_cover_the_range():
    n = 20_000
    seeds = np.asarray(jax.random.bits(jax.random.PRNGKey(3), (n,), jnp.uint32))
    for level in range(task.NUM_LEVELS):
        p = host_problems(seeds, np.full(n, level))
        d = level // 3 + 1
        lo, hi = (0, 9) if d == 1 else (10 ** (d - 1), 10**d - 1)
        for x in (p["a"], p["b"]):
            assert x.min() >= lo and x.max() <= hi
            if d <= 2:
                assert len(np.unique(x)) == hi - lo + 1  # every operand occurs
        a, b = p["a"].astype(np.int64), p["b"].astype(np.int64)
        want = [a + b, a - b, a * b][level % 3]
        np.testing.assert_array_equal(p["answer"], want)
        assert (p["level"] == level).all() and (p["digits"] == d).all()
    # the same seed at two levels: unrelated operands (not, e.g., the same a)
    p1, p2 = host_problems(seeds[:1000], np.zeros(1000)), host_problems(seeds[:1000], np.ones(1000))
    assert (p1["a"] == p2["a"]).mean() < 0.3


def test_stage_levels_are_stratified_over_a_batch_and_groups_repeat():
    stage = ar.Stage(digits=(1, 2, 3), operators=("+", "-"))
    assert [task.level_name(i) for i in stage.levels] == ["add1", "sub1", "add2", "sub2", "add3", "sub3"]
    sample = jax.jit(ENV.sample_examples, static_argnums=(1, 2, 3))
    for k in range(4):
        ex = jax.device_get(sample(jax.random.PRNGKey(k), 12, 3, stage))
        seeds, levels = np.asarray(ex.seed).reshape(12, 3), np.asarray(ex.level).reshape(12, 3)
        assert (seeds == seeds[:, :1]).all() and (levels == levels[:, :1]).all()
        counts = np.bincount(levels[:, 0], minlength=task.NUM_LEVELS)
        assert sorted(np.nonzero(counts)[0].tolist()) == list(stage.levels) and set(counts[list(stage.levels)]) == {2}
    # 7 prompts over 6 levels: each level once or twice, the one twice varies with the key
    twice = set()
    for k in range(12):
        ex = jax.device_get(sample(jax.random.PRNGKey(k), 7, 2, stage))
        counts = np.bincount(np.asarray(ex.level)[::2], minlength=task.NUM_LEVELS)[list(stage.levels)]
        assert sorted(counts.tolist()) == [1, 1, 1, 1, 1, 2]
        twice.add(int(np.argmax(counts)))
    assert len(twice) > 1
    settings_ = ENV.eval_settings()
    assert [s.name for s in settings_] == list(task.LEVEL_NAMES)
    for s in settings_:
        ex = jax.device_get(ENV.eval_examples(jax.random.PRNGKey(0), 5, s.stage))
        assert [task.level_name(int(v)) for v in ex.level] == [s.name] * 5


# ---------------------------------------------------------------------------------------------------------
# Messages, the teacher, the text bridge
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["tiny", "reference", "aligned"])
def test_messages_match_an_independent_rendering(prompt):
    env = envs.make("arithmetic", prompt=prompt)
    seeds = np.arange(40, dtype=np.uint32) * 7919
    levels = np.arange(40) % task.NUM_LEVELS
    states = jax.jit(jax.vmap(lambda s, lv: env.reset(ar.Example(s, lv), env.params)))(jnp.asarray(seeds), jnp.asarray(levels))
    for i in range(40):
        want = ref.problem(int(seeds[i]), int(levels[i]))
        state = jax.tree.map(lambda x: x[i], states)
        assert env.render_message(state, env.params) == ref.message(prompt, want["a"], want["b"], want["op"])
        assert not bool(env.done(state))
        info = env.example_info(ar.Example(seeds[i], levels[i]))
        assert info == {"seed": int(seeds[i]), "level": ref.level_name(int(levels[i])), "a": want["a"],
                        "b": want["b"], "op": want["op"], "answer": want["answer"]}


def test_teacher_rows_are_the_reference_worked_answers():
    teacher = ar.Teacher(num_problems=24, digits=(1, 3), operators=("-", "x"), check_problems=3)
    rows = ENV.demonstrations(teacher, jax.random.PRNGKey(5), ENV.params, max_turns=1)
    assert len(rows) == 24
    names = [r["info"]["level"] for r in rows]
    assert sorted(set(names)) == ["mul1", "mul3", "sub1", "sub3"] and all(names.count(n) == 6 for n in set(names))
    for r in rows:
        i = r["info"]
        want = ref.problem(i["seed"], ref.level(int(i["level"][3:]), i["op"]))
        assert (i["a"], i["b"], i["answer"]) == (want["a"], want["b"], want["answer"]) and i["check_group"] == ""
        assert r["prompt"][1]["content"] == ref.message("tiny", want["a"], want["b"], want["op"])
        assert r["completion"][0]["content"] == ref.worked(want["answer"])
        assert ref.score(r["completion"][0]["content"], want["answer"])["reward"] == pytest.approx(1.2)
    assert ar.teacher.worked_answer(-305, "none") == ref.worked(-305, "none") == "<answer>-305</answer>"
    assert ar.teacher.worked_answer(-305) == "<think>-503</think><answer>-305</answer>"
    check = ENV.check_rows(teacher, ENV.params)
    assert check == ENV.check_rows(teacher, ENV.params) and len(check) == 3 * 4  # fixed problems, per level
    assert [r["info"]["check_group"] for r in check] == [n for n in ("sub1", "mul1", "sub3", "mul3") for _ in range(3)]
    assert ENV.has_check_rows(teacher) and not ENV.has_check_rows(dataclasses.replace(teacher, check_problems=0))


@pytest.mark.parametrize("prompt", ["tiny", "reference", "aligned"])
def test_text_bridge_renders_exactly_the_chat_template(tok, prompt):
    env = envs.make("arithmetic", prompt=prompt)
    tables = text.tables_for_env(tok, env)  # verifies every adjacent pair of pieces against the template
    seeds = np.asarray(jax.random.bits(jax.random.PRNGKey(7), (24,), jnp.uint32))
    levels = np.arange(24) % task.NUM_LEVELS
    states = jax.jit(jax.vmap(lambda s, lv: env.reset(ar.Example(s, lv), env.params)))(jnp.asarray(seeds), jnp.asarray(levels))
    codes = jax.jit(jax.vmap(lambda s: env.message_codes(s, env.params)))(states)
    toks, lens = jax.device_get(jax.vmap(lambda c: text.render_turn(tables, c, True, False))(codes))
    prefix = np.asarray(tables.prefix).tolist()
    for i in range(24):
        p = ref.problem(int(seeds[i]), int(levels[i]))
        messages = [{"role": "system", "content": env.system_prompt(env.params)},
                    {"role": "user", "content": ref.message(prompt, p["a"], p["b"], p["op"])}]
        want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert prefix + toks[i, : lens[i]].tolist() == list(want)


# ---------------------------------------------------------------------------------------------------------
# Reading the reply: on device vs Python `re`
# ---------------------------------------------------------------------------------------------------------

WIDTH, BATCH = 160, 24
_parse_batch = jax.jit(jax.vmap(lambda d, v: parse_bytes(GRAMMAR, d, v)))


def device_parse(replies: list[str]) -> list[dict]:
    data = np.zeros((BATCH, WIDTH), np.uint8)
    valid = np.zeros((BATCH, WIDTH), bool)
    for i, r in enumerate(replies):
        b = r.encode("utf-8")
        assert len(b) <= WIDTH and len(replies) <= BATCH
        data[i, : len(b)] = np.frombuffer(b, np.uint8)
        valid[i, : len(b)] = True
    p = jax.device_get(_parse_batch(jnp.asarray(data), jnp.asarray(valid)))
    return [{"found": bool(p.found[i]), "valid": bool(p.valid[i]), "value": int(p.value[i]),
             "format_ok": bool(p.format_ok[i])} for i in range(len(replies))]


EDGE_CASES = {  # reply -> (found, valid, value): the documented choices
    "<answer>42</answer>": (True, True, 42),
    "<answer> 42 </answer>": (True, True, 42),
    "<answer>\n\u00a042\u3000</answer>": (True, True, 42),  # Unicode spaces around the number are stripped
    "<answer>+7</answer>": (True, True, 7),
    "<answer>-7</answer>": (True, True, -7),
    "<answer>-0</answer>": (True, True, 0),
    "<answer>007</answer>": (True, True, 7),  # leading zeros allowed, and they count as digits
    "<answer>00000042</answer>": (True, True, 42),  # 8 digits: the most
    "<answer>000000042</answer>": (True, False, 0),  # 9 digits
    "<answer>-99999999</answer>": (True, True, -99_999_999),
    "<answer>123456789</answer>": (True, False, 0),  # longer than any answer's range
    "<answer>4 2</answer>": (True, False, 0),
    "<answer>- 7</answer>": (True, False, 0),
    "<answer>--7</answer>": (True, False, 0),
    "<answer>+-7</answer>": (True, False, 0),
    "<answer>1,000</answer>": (True, False, 0),
    "<answer>7.0</answer>": (True, False, 0),
    "<answer>1e3</answer>": (True, False, 0),
    "<answer>\u0663</answer>": (True, False, 0),  # Arabic-Indic three: not an ASCII digit
    "<answer>\uff11</answer>": (True, False, 0),  # fullwidth one
    "<answer></answer>": (True, False, 0),
    "<answer>5</answer><answer>6</answer>": (True, True, 5),  # the first tag counts
    "<answer>x</answer><answer>6</answer>": (True, False, 0),  # ... even when it is invalid
    "<answer><answer>5</answer>": (True, False, 0),  # the content is "<answer>5"
    "<answer>5": (False, False, 0),
    "answer: 5": (False, False, 0),
    "<think>9</think>5</answer>": (False, False, 0),
    "It is <answer>12</answer>, I think.": (True, True, 12),
}


def test_documented_edge_cases():
    replies = list(EDGE_CASES)
    got = device_parse(replies[:BATCH]) + device_parse(replies[BATCH:])
    for reply, g in zip(replies, got):
        want = ref.parse(reply)
        assert (want["found"], want["valid"], want["value"]) == EDGE_CASES[reply], reply
        assert g == want, reply


PIECES = ["<answer>", "</answer>", "<answer", "</answer", "answer>", "<think>", "</think>", "<", ">", "/", "+", "-",
          "0", "7", "42", "1234", "99999999", " ", "\n", "\t", "\u00a0", "\u3000", "\u2028", "\u0663", "\uff11", ",",
          ".", "e", "x", "\u00e9", "\u20ac", "\ufffd"]
reply_text = st.lists(st.sampled_from(PIECES), max_size=18).map("".join).filter(lambda s: len(s.encode()) <= WIDTH)


@settings(max_examples=40, deadline=None)
@given(st.lists(reply_text, min_size=1, max_size=BATCH))
def test_device_parse_matches_python_re(replies):
    for reply, got in zip(replies, device_parse(replies)):
        assert got == ref.parse(reply), reply


# ---------------------------------------------------------------------------------------------------------
# The rubric and metrics, through a scripted rollout
# ---------------------------------------------------------------------------------------------------------


def scripted_rollout(tok, env, tables, replies, seeds, levels):
    """The trajectory (on the host) of one scripted reply per problem (seeds, levels), jitted."""
    reply_tokens, reply_lengths = ro.script_replies(tok, [[r] for r in replies], 1, 32)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    run = jax.jit(lambda ex, k: ro.rollout(env, policy, None, None, None, tables, ex, k,
                                           ro.RolloutConfig(context_length=128, max_turns=1),
                                           SamplingConfig(max_new_tokens=32)))
    return jax.device_get(run(ar.Example(jnp.asarray(seeds), jnp.asarray(levels)), jax.random.PRNGKey(0)))


def test_scripted_rollout_rubric_and_metrics(tok):
    tables = text.tables_for_env(tok, ENV)
    seeds = np.asarray(jax.random.bits(jax.random.PRNGKey(11), (16,), jnp.uint32))
    levels = np.array([0, 1, 3, 4, 6, 7, 2, 5, 8, 9, 10, 11, 3, 4, 6, 7], np.int32)
    answers = [ref.problem(int(s), int(lv))["answer"] for s, lv in zip(seeds, levels)]
    replies = [ref.worked(answers[0]), f"<answer>{answers[1]}</answer>", f"<answer>{answers[2] + 1}</answer>",
               "<answer>seven</answer>", "no tags at all", f"<answer> +{abs(answers[5])} </answer>",
               f"<think>x</think><answer>{answers[6]}</answer><answer>0</answer>", f"<answer>0{answers[7]}</answer>",
               f"The answer is {answers[8]}.", ref.worked(answers[9]), f"<answer>{answers[10]}", ref.worked(answers[11]),
               f"<answer>{answers[12]}</answer>", f"<answer>-{answers[13]}</answer>", "<answer>1 2</answer>",
               ref.worked(answers[15])]
    traj = scripted_rollout(tok, ENV, tables, replies, seeds, levels)
    assert [p.name for p in ENV.rubric(ENV.params)] == ["exact", "format"]
    for i, reply in enumerate(replies):
        want = ref.score(reply, answers[i])
        assert traj.reward[i] == pytest.approx(want["reward"], abs=1e-6), reply
        assert traj.reward_parts["exact"][i] == want["exact"] and traj.reward_parts["format"][i] == want["format"]
        for outcome in ("exact", "wrong", "invalid", "missing"):
            assert traj.metrics[outcome][i] == float(want["outcome"] == outcome), (reply, outcome)
        for lv, name in enumerate(task.LEVEL_NAMES):
            value = traj.metrics[f"exact_{name}"][i]
            assert np.isnan(value) if lv != levels[i] else value == want["exact"]
        assert int(traj.turns[i]) == 1 and not traj.truncated[i] and bool(traj.final_state.done[i])
    assert [ref.score(r, a)["outcome"] for r, a in zip(replies, answers)][:6] == [
        "exact", "exact", "wrong", "invalid", "missing", "exact" if answers[5] >= 0 else "wrong"]
    # a done state comes back from step unchanged
    state = jax.tree.map(lambda x: x[0], traj.final_state)
    again = ENV.step(state, envs.ParsedReply.of(answers[0] + 1), ENV.params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.all(np.asarray(a) == np.asarray(b))), state, again))


@settings(max_examples=60, deadline=None)
@given(answer=st.integers(-9999, 19998), value=st.integers(-99999, 99999), shape=st.sampled_from(["plain", "sign", "bad"]))
def test_digit_credit_matches_string_arithmetic(answer, value, shape):
    """The optional partial credit (`Params.digits_weight`) against the reference's string computation."""
    reply = {"plain": f"<answer>{value}</answer>", "sign": f"<answer>{'+' if value >= 0 else ''}{value}</answer>",
             "bad": f"<answer>{value}x</answer>"}[shape]
    p = ref.parse(reply)
    state = ar.State(problem=_problem_with_answer(answer), seed=jnp.uint32(0), done=jnp.bool_(True),
                     found=jnp.bool_(p["found"]), valid=jnp.bool_(p["valid"]),
                     value=jnp.int32(p["value"] if p["valid"] else 0))
    assert float(_digit_credit(state)) == pytest.approx(ref.digit_credit(reply, answer), abs=1e-6)


_digit_credit = jax.jit(ar.digit_credit)


def _problem_with_answer(answer: int) -> task.Problem:
    """A problem whose result is `answer` (only the answer matters to the credit)."""
    return _PROBLEM._replace(answer=jnp.int32(answer))


_PROBLEM = jax.jit(task.problem)(jnp.uint32(0), jnp.int32(0))


def test_digits_credit_is_a_rubric_part_only_when_weighted(tok):
    """digits_weight = 0 (the default) leaves the rubric as it was; > 0 adds `digits` to it and to the reward."""
    env = envs.make("arithmetic", prompt="aligned", digits_weight=0.5)
    assert [p.name for p in env.rubric(env.params)] == ["exact", "format", "digits"]
    assert [p.name for p in ENV.rubric(ENV.params)] == ["exact", "format"]
    tables = text.tables_for_env(tok, env)
    seeds = np.asarray(jax.random.bits(jax.random.PRNGKey(3), (4,), jnp.uint32))
    levels = np.array([6, 7, 6, 7], np.int32)
    answers = [ref.problem(int(s), int(lv))["answer"] for s, lv in zip(seeds, levels)]
    replies = [f"<answer>{answers[0]}</answer>", f"<answer>{answers[1] + 1}</answer>", "<answer>5</answer>", "none"]
    traj = scripted_rollout(tok, env, tables, replies, seeds, levels)
    for i, reply in enumerate(replies):
        want = ref.score(reply, answers[i])
        credit = ref.digit_credit(reply, answers[i])
        assert traj.reward_parts["digits"][i] == pytest.approx(credit, abs=1e-6)
        assert traj.reward[i] == pytest.approx(want["reward"] + 0.5 * credit, abs=1e-6), reply


# ---------------------------------------------------------------------------------------------------------
# Validation: stages, teachers, params, the whole config
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"digits": (5,)}, r"digits.*1\.\.4.*5"),
    ({"digits": (0, 1)}, r"digits.*1\.\.4"),
    ({"digits": ()}, r"digits.*non-empty"),
    ({"digits": (2, 2)}, r"digits.*twice"),
    ({"digits": (True,)}, r"digits"),
    ({"digits": (1.5,)}, r"digits"),
    ({"operators": ("*",)}, r"operators.*'x'"),
    ({"operators": ("/", "+")}, r"operators"),
    ({"operators": ()}, r"operators.*non-empty"),
    ({"operators": ("+", "+")}, r"operators.*twice"),
])
def test_bad_levels_raise_named_errors(kwargs, match):
    for cls in (ar.Stage, ar.Teacher):
        with pytest.raises(ConfigError, match=match):
            cls(**kwargs)


def test_bad_teacher_and_params_raise():
    with pytest.raises(ConfigError, match="work"):
        ar.Teacher(work="long")
    with pytest.raises(ConfigError, match="num_problems"):
        ar.Teacher(num_problems=0)
    with pytest.raises(ConfigError, match="check_problems"):
        ar.Teacher(check_problems=-1)
    with pytest.raises(ValueError, match="prompt"):
        ar.Params(prompt="huge")
    with pytest.raises(ValueError, match="format_weight"):
        ar.Params(format_weight=-0.2)
    with pytest.raises(ValueError, match="digits must be an integer in 1..4"):
        task.level_index(5, "+")
    with pytest.raises(ValueError, match="unknown level 'add5'"):
        task.level_of_name("add5")


@pytest.mark.parametrize("override, key", [
    ("grpo.0.curriculum.digits=[2, 5]", "grpo.0.curriculum.digits"),
    ('grpo.0.curriculum.operators=["+", "/"]', "grpo.0.curriculum.operators"),
    ("grpo.0.curriculum.levels=3", "grpo.0.curriculum"),
    ("sft.teacher.digits=[]", "sft.teacher.digits"),
    ('sft.teacher.work="long"', "sft.teacher.work"),
    ('env.params.prompt="huge"', "env.params"),
    ('eval.settings=["add2", "add5"]', "eval.settings.1"),
])
def test_preset_loads_and_bad_values_name_their_key(override, key):
    config = load_config(PRESET)
    assert config.env.name == "arithmetic" and isinstance(config.grpo[0].curriculum, ar.Stage)
    assert config.eval.num_games >= 1000 and isinstance(config.sft.teacher, ar.Teacher)
    with pytest.raises(ConfigError) as e:
        load_config(PRESET, [override])
    assert str(e.value).startswith(key), str(e.value)


# ---------------------------------------------------------------------------------------------------------
# End to end: a tiny model's rollout
# ---------------------------------------------------------------------------------------------------------


def test_tiny_model_rollout_scores_its_own_replies(tok):
    from models.family import cached_call
    from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache

    config = dataclasses.replace(PRESETS["tiny"], vocab_size=len(tok), num_hidden_layers=2,
                                 layer_types=("conv", "full_attention"))
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    tables = text.tables_for_env(tok, ENV)
    run = ro.make_rollout(ENV, cached_call(module), lambda b, n: init_cache(config, b, n), tables,
                          ro.RolloutConfig(context_length=96, max_turns=1), SamplingConfig(temperature=1.0, max_new_tokens=16))
    examples = ENV.sample_examples(jax.random.PRNGKey(1), 4, 2, ar.Stage())
    traj = jax.device_get(run(params, examples, jax.random.PRNGKey(2)))
    byte_table, byte_lengths = np.asarray(tables.byte_table), np.asarray(tables.byte_lengths)
    for b in range(8):
        conversation = ro.decode_game(tok, traj, b)
        info = ENV.example_info(jax.tree.map(lambda x: x[b], examples))
        assert ref.message("tiny", info["a"], info["b"], info["op"]) + "<|im_end|>" in conversation
        reply_ids = np.asarray(traj.tokens[b])[np.asarray(traj.loss_mask[b]) > 0].tolist()
        assert int(traj.reply_lengths[b, 0]) == len(reply_ids)
        reply = b"".join(byte_table[t, : byte_lengths[t]].tobytes() for t in reply_ids).decode("utf-8", "replace")
        want = ref.score(reply, info["answer"])
        assert traj.reward[b] == pytest.approx(want["reward"], abs=1e-6)
        assert traj.metrics[want["outcome"]][b] == 1.0


def test_a_model_may_go_on_with_other_rubric_weights_but_not_another_prompt():
    """`reward_params` (the rubric weights) are not part of what a checkpoint fixes: an SFT model trained
    without partial credit may start a GRPO run with it; another prompt preset is refused, naming the key."""
    from jaxrl_llm.checkpoint import CheckpointMismatchError
    from jaxrl_llm.compat import check_meta, config_meta

    preset = Path(__file__).resolve().parents[1] / "experiments" / "presets" / "arithmetic_rl.toml"
    saved = config_meta(load_config(preset, ["env.params.digits_weight=0.0"]))
    check_meta(saved, load_config(preset, ["env.params.digits_weight=0.5", "env.params.format_weight=0.1"]), "sft")
    with pytest.raises(CheckpointMismatchError, match="env.params.prompt"):
        check_meta(saved, load_config(preset, ["env.params.prompt=tiny"]), "sft")
