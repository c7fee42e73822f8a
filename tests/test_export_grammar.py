"""The reply grammar written beside an exported model (`jaxrl_llm.export_grammar`).

- The regex of each built-in env fully matches every reply the constrained sampler can write (the reply
  template's own token tables, exhaustively for cells and short integers; the env's legal choices) and
  rejects malformed replies.
- Python `re.fullmatch` with the regex agrees with the on-device parser (`text.grammar.parse_bytes`) on
  hypothesis-generated replies: every full match parses as found, valid, in the format, with that value;
  a reply in the template's shape matches iff the parser reads a content the sampler could have written.
- The plain-Python matcher equals `re`, refuses what structured-generation tools refuse, and, as a
  `transformers` logits processor, makes a tiny random model write only matching replies.
- A grammar with no regex is a named error; `export_policy` writes `reply_grammar.json`.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.core import ReplyGrammar
from jaxrl_base.errors import EnvError, JaxrlError
from jaxrl_llm import export_grammar as eg
from jaxrl_llm.text import grammar as parser
from jaxrl_llm.text import load_tokenizer, tables_for_env
from jaxrl_llm.text.tables import reply_texts

ROOT = Path(__file__).resolve().parents[1]
ENVS = ("tictactoe", "connect_four", "arithmetic")
TEXT = ReplyGrammar("reply_x", "text", format_tags=("think", "reply_x"),
                    example_replies=("<think>a</think>\n<reply_x>b</reply_x>", "<reply_x>b</reply_x>"))
L = 64  # bytes per reply for the on-device parser


@functools.lru_cache(maxsize=None)
def _env(name: str):
    return envs.make(name)


def _grammar(name: str) -> ReplyGrammar:
    env = _env(name)
    return env.reply_grammar(env.params)


@functools.lru_cache(maxsize=None)
def _tables(name: str):
    return tables_for_env(load_tokenizer(None), _env(name))


def _text(tables, ids) -> str:
    """Token ids as the parser reads them: the concatenated bytes of the byte table, decoded."""
    ids = [int(i) for i in ids]
    return b"".join(bytes(tables.byte_table[i, : tables.byte_lengths[i]]) for i in ids).decode()


def _template_replies(name: str, max_digits: int = 3) -> list[str]:
    """Every reply the constrained sampler can write from the env's reply template (prefix ids, content ids
    drawn from the template's allowed sets, suffix ids without the end of turn); integers up to
    `max_digits` digits (the longer ones: `test_integer_regex_counts_digits`)."""
    tables = _tables(name)
    t = tables.reply_template
    sets = np.asarray(t.sets)
    prefix, suffix = _text(tables, t.prefix), _text(tables, np.asarray(t.suffix)[:-1])
    if t.kind == "cell":
        return [prefix + _text(tables, [c]) + suffix for c in np.flatnonzero(sets[parser.CELL_CHOICE])]
    assert t.kind == "integer"
    digits = [_text(tables, [d]) for d in np.flatnonzero(sets[parser.INT_DIGIT])]
    assert sorted(digits) == [str(d) for d in range(10)] and _text(tables, [t.minus_id]) == "-"
    contents = ["".join(p) for n in range(1, max_digits + 1) for p in itertools.product(digits, repeat=n)]
    return [prefix + sign + c + suffix for sign in ("", "-") for c in contents]


@pytest.mark.parametrize("name", ENVS)
def test_regex_matches_every_constrained_reply(name):
    regex = re.compile(eg.reply_regex(_grammar(name), name))
    assert "(?" not in regex.pattern and eg.RegexMatcher(regex.pattern)  # the plain subset, plain groups only
    prefix, suffix = reply_texts(_grammar(name))
    replies = _template_replies(name)
    assert replies
    for reply in replies:
        m = regex.fullmatch(reply)
        assert m is not None, reply
        assert prefix + m.group(1) + suffix == reply  # group 1 is the content
    if _grammar(name).content == "cell":
        assert len(replies) == _grammar(name).num_cells


def test_tictactoe_regex_and_every_legal_move():
    """Every legal choice of every Tic-Tac-Toe board (all 3^9 cell fillings, through the env's own
    `legal_choices`, which reads the board and `done`) gives a reply the regex matches, its cell in group 1."""
    env, name = _env("tictactoe"), "tictactoe"
    regex = re.compile(eg.reply_regex(_grammar(name), name))
    assert regex.pattern == r"<think></think>\n<move>([0-8])</move>"
    boards = np.array(list(itertools.product(range(3), repeat=9)), np.int8)
    state = types.SimpleNamespace(board=jax.numpy.asarray(boards), done=jax.numpy.zeros(len(boards), bool))
    legal = np.asarray(jax.vmap(lambda b, d: env.legal_choices(types.SimpleNamespace(board=b, done=d), env.params))(
        state.board, state.done))
    assert legal.shape == (3**9, 9) and legal.any(axis=1).sum() == 3**9 - 2**9  # every board with an empty cell
    reply = {c: regex.fullmatch(f"<think></think>\n<move>{c}</move>") for c in range(9)}
    for c in np.unique(np.nonzero(legal)[1]):
        assert reply[c] is not None and reply[c].group(1) == str(c)
    assert set(np.unique(np.nonzero(legal)[1])) == set(range(9))


MALFORMED = {
    "tictactoe": ["", "4", "<move>4</move>", "<think></think>\n<move>9</move>", "<think></think>\n<move>04</move>",
                  "<think></think>\n<move>+4</move>", "<think></think>\n<move></move>", "<think></think>\n<move>4",
                  "<think></think>\n<move>4 4</move>", "<think></think>\n<move>x</move>",
                  "<move>4</move><think></think>", "<think></think>\n<mov>4</mov>", "<think></think>\n<move>٣</move>"],
    "connect_four": ["<think></think><move>7</move>", "<move>3</move>", "<think></think><move>-1</move>",
                     "<think></think><move>03</move>", "<think></think><move>3</move"],
    "arithmetic": ["<answer></answer>", "<answer>-</answer>", "<answer>123456789</answer>", "<answer>1e3</answer>",
                   "<answer>1,000</answer>", "<answer>7.0</answer>", "<answer>- 7</answer>", "answer: 7",
                   "<answer>７</answer>", "<answer>--7</answer>"],
}


@pytest.mark.parametrize("name", ENVS)
def test_regex_rejects_malformed_replies(name):
    regex = re.compile(eg.reply_regex(_grammar(name), name))
    for reply in MALFORMED[name]:
        assert regex.fullmatch(reply) is None, reply


def test_integer_regex_counts_digits():
    g = _grammar("arithmetic")
    regex = re.compile(eg.reply_regex(g, "arithmetic"))
    n = g.max_digits
    for k in range(1, n + 1):
        assert regex.fullmatch(f"<answer>{'9' * k}</answer>") and regex.fullmatch(f"<answer>-{'0' * k}</answer>")
    assert not regex.fullmatch(f"<answer>{'1' * (n + 1)}</answer>")


@pytest.mark.parametrize("n", [1, 2, 7, 9, 10, 11, 16, 99, 100, 101, 123, 999, 1000, 1001, 4096, 10**6])
def test_cell_content_is_exactly_the_cells(n):
    regex = re.compile(eg.content_regex(ReplyGrammar("c", "cell", num_cells=n)))
    limit = min(3 * n, 20_000)
    assert {str(i) for i in range(limit) if regex.fullmatch(str(i))} == {str(i) for i in range(min(n, limit))}
    assert not regex.fullmatch("0" + str(n - 1)) and not regex.fullmatch("+0") and not regex.fullmatch("")


def test_text_content_is_anything_but_the_closing_tag():
    regex = re.compile(eg.reply_regex(TEXT))
    assert "(?" not in regex.pattern
    prefix, suffix = reply_texts(TEXT)
    for content in ["", "hello", "<", "<<", "</reply_", "</reply_x", "x\ny</reply_x y", "<reply_x>", "é"]:
        assert regex.fullmatch(prefix + content + suffix), content
    for content in ["</reply_x>", "a</reply_x>b", "</reply_x></reply_x"]:
        assert not regex.fullmatch(prefix + content + suffix), content


# ---------------------------------------------------------------------------------------------------------
# agreement with the on-device parser
# ---------------------------------------------------------------------------------------------------------

AGREE = {name: _grammar(name) for name in ENVS} | {"text": TEXT}


@functools.lru_cache(maxsize=None)
def _parse(g: ReplyGrammar):
    return jax.jit(jax.vmap(functools.partial(parser.parse_bytes, g)))


def _pack(replies: list[str]) -> tuple[np.ndarray, np.ndarray]:
    data, valid = np.zeros((len(replies), L), np.uint8), np.zeros((len(replies), L), bool)
    for i, r in enumerate(replies):
        b = r.encode()
        data[i, : len(b)], valid[i, : len(b)] = np.frombuffer(b, np.uint8), True
    return data, valid


_ALPHABET = st.sampled_from(list("0123456789+- \n\t<>/xé٣") + ["<move>", "</move>", "<answer>", "</answer>",
                                                                  "<think>", "</think>", "</reply_x>", "\u3000"])
_CONTENT = st.lists(_ALPHABET, max_size=5).map("".join)


@st.composite
def _replies(draw, g: ReplyGrammar):
    """A reply in the template's shape with a random content, a mutated template reply, or free text."""
    prefix, suffix = reply_texts(g)
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return prefix + draw(_CONTENT) + suffix
    if kind == 1:
        content = draw(st.sampled_from(["0", "5", "8", "-12", "007", "-0", "text"]))
        reply = list(prefix + content + suffix)
        for _ in range(draw(st.integers(1, 2))):
            i = draw(st.integers(0, len(reply)))
            if draw(st.booleans()) and i < len(reply):
                del reply[i]
            else:
                reply.insert(i, draw(_ALPHABET))
        return "".join(reply)
    return draw(_CONTENT) + draw(st.sampled_from([prefix, ""])) + draw(_CONTENT) + draw(st.sampled_from([suffix, ""]))


@pytest.mark.parametrize("name", sorted(AGREE))
@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_fullmatch_agrees_with_the_on_device_parser(name, data):
    g = AGREE[name]
    regex = re.compile(eg.reply_regex(g, name))
    matcher = eg.RegexMatcher(regex.pattern)
    prefix, suffix = reply_texts(g)
    replies = [r for r in data.draw(st.lists(_replies(g), min_size=16, max_size=16)) if len(r.encode()) <= L]
    replies += [prefix + ("3" if g.content != "text" else "a") + suffix]
    parsed = _parse(g)(*_pack(replies))
    for i, reply in enumerate(replies):
        found, valid, value, fmt = (np.asarray(x)[i].item() for x in parsed)
        m = regex.fullmatch(reply)
        assert matcher.fullmatch(reply) == (m is not None), reply
        if m is not None:  # every full match is a valid reply in the format, with the match's content
            assert found and valid and fmt, reply
            if g.content != "text":
                assert value == int(m.group(1)), reply
        shaped = reply.startswith(prefix) and reply.endswith(suffix) and len(reply) >= len(prefix) + len(suffix)
        content = reply[len(prefix): len(reply) - len(suffix)] if shaped else None
        if shaped and not any(ch.isspace() or ch == "<" for ch in content):
            # the template's shape: a match iff the parser reads a content the sampler could write
            sampler_could = valid and fmt and not content.startswith("+")
            assert (m is not None) == sampler_could, reply


# ---------------------------------------------------------------------------------------------------------
# the plain-Python matcher and the transformers processor
# ---------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(text=st.lists(st.sampled_from(list("ab-<>/\n") + ["ab", "</x>"]), max_size=8).map("".join))
def test_matcher_equals_re(text):
    patterns = [r"a(b|-)*c?", r"[^<]*(?:<(?:(?:[^/<][^<]*)?|/(?:[^x<][^<]*)?))*", r"(ab){1,2}\n?", r"[a\-]{0,3}",
                r"(?:a|)b*", r"\<\/x>|a.b", eg.reply_regex(TEXT), r"x?[0-9]{2}|ab"]
    for p in patterns:
        assert eg.RegexMatcher(p).fullmatch(text) == (re.fullmatch(p, text) is not None), (p, text)


@pytest.mark.parametrize("pattern", [r"(?=a)b", r"(a)\1", r"a*?", r"^a", r"a$", r"(?P<x>a)", r"\bx", r"a{2", r"(a",
                                     r"a)", r"[a"])
def test_matcher_refuses_what_structured_generation_refuses(pattern):
    with pytest.raises(eg.RegexSyntaxError):
        eg.RegexMatcher(pattern)


def test_a_grammar_with_no_regex_is_a_named_error():
    with pytest.raises(eg.GrammarRegexError, match="'mine'.*not an envs.ReplyGrammar"):
        eg.reply_regex(object(), "mine")
    twice = ReplyGrammar("move", "cell", format_tags=("move", "move"), example_replies=("<move>1</move>",))
    with pytest.raises(eg.GrammarRegexError, match="'mine'.*format tags") as info:
        eg.reply_regex(twice, "mine")
    assert isinstance(info.value, EnvError) and isinstance(info.value, JaxrlError)


@pytest.mark.parametrize("name", ["tictactoe", "arithmetic"])
def test_transformers_processor_writes_only_matching_replies(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                  layer_types=["conv", "full_attention"], pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    regex = eg.reply_regex(_grammar(name), name)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Your turn."}], add_generation_prompt=True,
                                     tokenize=False)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]] * 6)
    processor = eg.RegexLogitsProcessor(regex, tok)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=40,
                         logits_processor=transformers.LogitsProcessorList([processor]),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for row in out[:, ids.shape[1]:].tolist():
        assert tok.eos_token_id in row, row
        reply = tok.decode(row[: row.index(tok.eos_token_id)])
        assert re.fullmatch(regex, reply), reply


def _stub_components(config):
    """What `export_policy` reads of `train.Components` (a tiny LFM2, the project tokenizer, the config's env)
    and zero params of that shape: the real export without building the tables or compiling an init."""
    from models.lfm2 import ATTENTION, CONV, Lfm2Config, init_params

    tok = load_tokenizer(None)
    cfg = Lfm2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, layer_types=(CONV, ATTENTION),
                     max_position_embeddings=64)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
    return types.SimpleNamespace(model_config=cfg, tokenizer=tok, env=config.env.make(), lora=None), params


def test_export_writes_the_reply_grammar(tmp_path):
    from jaxrl_llm.cli.main import export_policy
    from jaxrl_llm.config import load_config

    config = load_config(ROOT / "experiments" / "presets" / "tiny_test.toml")
    comp, params = _stub_components(config)
    names = export_policy(comp, params, config, tmp_path / "model")
    assert eg.GRAMMAR_FILE in names and "config.json" in names
    record = eg.read_reply_grammar(tmp_path / "model")
    assert record["env"] == config.env.name == "tictactoe" and record["content"] == "cell"
    assert record["regex"] == eg.reply_regex(comp.env.reply_grammar(comp.env.params)) == _ttt_regex()
    assert re.search(record["answer_regex"], "<think>x</think>\n<move> 4 </move>", re.DOTALL).group(1) == "4"
    assert "constrained" in record["note"]
    assert json.loads((tmp_path / "model" / eg.GRAMMAR_FILE).read_text()) == record
    # an env whose grammar has no regex: the named error, and nothing written
    twice = ReplyGrammar("move", "cell", format_tags=("move", "move"), example_replies=("<move>1</move>",))
    comp.env = types.SimpleNamespace(reply_grammar=lambda params: twice, params=None)
    with pytest.raises(eg.GrammarRegexError, match="'tictactoe'"):
        export_policy(comp, params, config, tmp_path / "other")
    assert not (tmp_path / "other").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _ttt_regex() -> str:
    return r"<think></think>\n<move>([0-8])</move>"
