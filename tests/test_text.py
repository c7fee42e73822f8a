"""The text bridge with Tic-Tac-Toe's messages: presets match the spec, on-device rendering equals the chat
template, parsing equals re (the generic grammars: tests/test_grammar.py)."""

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_text as ref
from envs import tictactoe as ttt
from envs.tictactoe import text as ttt_text
from jaxrl_llm import text
from jaxrl_llm.text import grammar
from jaxrl_llm.text.tokenizer import CHAT_TEMPLATE, load_tokenizer


def env_of(preset: str) -> ttt.TicTacToe:
    return ttt.TicTacToe(ttt.Params(prompt=preset))


GRAMMAR = env_of("reference").reply_grammar(ttt.Params())


def parse_bytes(data, valid):
    """Tic-Tac-Toe's view of the generic parser: (move -1 / 0..8 / 9, format_ok)."""
    reply = grammar.parse_bytes(GRAMMAR, data, valid)
    return ttt.move_of(reply), reply.format_ok


def parse_reply(tables, tokens, length):
    reply = grammar.parse_reply(tables, GRAMMAR, tokens, length)
    return ttt.move_of(reply), reply.format_ok

LFM2_SPECIALS = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                 "<|im_start|>", "<|im_end|>"]

OTHER_TEXT = [
    "The quick brown fox jumps over the lazy dog; it was 1234 metres away!",
    "Numbers like 10, 250 and 3.14159 appear in reports (see table 2).",
    "Players take turns. Each turn, a player marks one empty square with their symbol.",
    "It's a fine day: the river runs, the birds sing, and we're all here at position zero.",
    "Available rooms: [101, 102, 205] -- please choose one before noon.",
    "Lines of text\nwith newlines\n\nand blank lines | pipes | and ---- dashes.",
]


def _wrap(raw):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE,
    )


def gpt2_style_tokenizer():
    """A second byte-level BPE with LFM2's special-token layout: GPT-2 regex, other text, another size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=LFM2_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(OTHER_TEXT * 20, trainer=trainer)
    return _wrap(raw)


def hostile_tokenizer():
    """Byte-level BPE without a splitting regex, trained on the messages: merges run across line breaks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=LFM2_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    corpus = []
    for _ in range(200):
        messages, _ = ref.random_game(rng)
        corpus += [ref.message(*m) for m in messages]
    raw.train_from_iterator(corpus, trainer=trainer)
    return _wrap(raw)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tok2():
    return gpt2_style_tokenizer()


@pytest.fixture(scope="module")
def tables(tok):
    return text.tables_for_env(tok, env_of("reference"))


# ---------------------------------------------------------------------------------------------------------
# presets and host rendering
# ---------------------------------------------------------------------------------------------------------


def test_reference_preset_is_the_spec():
    preset = ttt_text.PRESETS["reference"]
    assert ttt_text.system_prompt(preset) == ref.SYSTEM_PROMPT
    rng = random.Random(0)
    for _ in range(300):
        board = [rng.choice([0, 0, 1, 2]) for _ in range(9)]
        status, k = rng.randrange(9), rng.randrange(9)
        assert ttt_text.render_message(preset, board, status, k) == ref.message(board, status, k)
        # the slots' pieces at the codes of that state are the same text
        codes = np.asarray(ttt_text.message_codes(_state(board, status, k)))
        assert ttt_text.message_spec(preset).render(codes.tolist()) == ref.message(board, status, k)
    assert set(ttt_text.PRESETS) >= {"reference", "compact"}
    compact = ttt_text.PRESETS["compact"]
    assert len(ttt_text.system_prompt(compact)) < len(ttt_text.system_prompt(preset))
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.name = "x"


# ---------------------------------------------------------------------------------------------------------
# on-device rendering == apply_chat_template of the host-rendered conversation
# ---------------------------------------------------------------------------------------------------------


def _state(board, status, k) -> ttt.State:
    """A game state showing `board` with status `status` and last opponent move k (what a message reads)."""
    n = np.shape(status)
    z = np.zeros(n, np.int32)
    return ttt.State(board=np.asarray(board, np.int8), to_play=np.ones(n, np.int8), turns=z, invalid_moves=z,
                     missing_moves=z, done=np.asarray(status) >= ttt_text.FIRST_FINAL_STATUS, outcome=z.astype(np.int8),
                     last_opponent_move=np.asarray(k, np.int8), status=np.asarray(status, np.int8),
                     seed=z.astype(np.uint32), random_move_prob=z.astype(np.float32))


@functools.partial(jax.jit, static_argnames="preset")
def _render(tables, state, first, preset=None):
    codes = jax.vmap(lambda s: ttt_text.message_codes(s, preset))(state)
    return jax.vmap(text.render_turn, in_axes=(None, 0, 0, 0))(tables, codes, first, state.done)


def _render_batch(tables, turns, preset=None):
    state = _state(np.array([t[0] for t in turns], np.int8), np.array([t[1] for t in turns], np.int32),
                   np.array([t[2] for t in turns], np.int32))
    tokens, lengths = _render(tables, state, jnp.asarray(np.array([t[3] for t in turns], bool)), preset=preset)
    return np.asarray(tokens), np.asarray(lengths)


def _check_conversations(tokenizer, preset, tables, n_games, seed, render=ref.message):
    rng = random.Random(seed)
    games = [ref.random_game(rng) for _ in range(n_games)]
    turns = [(m[0], m[1], m[2], i == 0) for messages, _ in games for i, m in enumerate(messages)]
    tokens, lengths = _render_batch(tables, turns, preset)
    assert tokens.shape[1] == tables.max_msg
    seen_status, seen_first, cursor = set(), set(), 0
    prefix = list(np.asarray(tables.prefix))
    for messages, replies in games:
        device = list(prefix)
        for i in range(len(messages)):
            if i:
                device += tokenizer(replies[i - 1], add_special_tokens=False)["input_ids"] + [tables.eos_id]
            device += tokens[cursor, : lengths[cursor]].tolist()
            assert (tokens[cursor, lengths[cursor]:] == tables.pad_id).all()
            cursor += 1
            seen_status.add(messages[i][1])
        seen_first.add(messages[0][1])
        conv = ref.conversation(messages, replies, len(messages) - 1, system=ttt_text.system_prompt(preset),
                                render=render)
        final = messages[-1][1] in ref.FINAL
        expected = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=not final,
                                                 return_dict=False)
        assert device == list(expected)
    assert seen_status == set(range(9)) and seen_first == {ref.START_MODEL_FIRST, ref.START_OPP_FIRST}


def test_device_conversation_equals_chat_template(tok, tables):
    _check_conversations(tok, ttt_text.PRESETS["reference"], tables, n_games=120, seed=1)


def test_device_conversation_compact_preset(tok):
    preset = ttt_text.PRESETS["compact"]
    _check_conversations(tok, preset, text.tables_for_env(tok, env_of("compact")), n_games=60, seed=2)


def test_tiny_preset_texts_equal_the_independent_ones():
    preset = ttt_text.PRESETS["tiny"]
    assert ttt_text.system_prompt(preset) == ref.TINY_SYSTEM
    rng = random.Random(4)
    for _ in range(300):
        board = [rng.choice([0, 0, 1, 2]) for _ in range(9)]
        status, k = rng.randrange(9), rng.randrange(9)
        assert ttt_text.render_message(preset, board, status, k) == ref.tiny_message(board, status, k)


@pytest.mark.parametrize("which", ["project", "lfm2-like"])
def test_device_conversation_tiny_preset(tok, tok2, which):
    preset = ttt_text.PRESETS["tiny"]
    tokenizer = tok if which == "project" else tok2
    _check_conversations(tokenizer, preset, text.tables_for_env(tokenizer, env_of("tiny")), n_games=60, seed=5,
                         render=ref.tiny_message)


def test_device_conversation_second_tokenizer(tok2):
    preset = ttt_text.PRESETS["reference"]
    tables2 = text.tables_for_env(tok2, env_of("reference"))
    assert tables2.eos_id == 7 and tables2.pad_id == 0
    _check_conversations(tok2, preset, tables2, n_games=80, seed=3)


def test_prefix_is_the_system_message(tok, tables):
    conv = [{"role": "system", "content": ref.SYSTEM_PROMPT}]
    assert np.asarray(tables.prefix).tolist() == list(tok.apply_chat_template(conv, return_dict=False))
    assert tables.prefix_length == len(tables.prefix)


def test_hostile_tokenizer_is_detected():
    with pytest.raises(ValueError, match="piece boundary"):
        text.tables_for_env(hostile_tokenizer(), env_of("reference"))


def test_render_turn_jits_with_scalar_first(tables, tok):
    board = np.array([2, 0, 0, 0, 1, 0, 0, 0, 0], np.int8)
    codes = ttt_text.message_codes(_state(board, 2, 0))
    toks, n = jax.jit(text.render_turn, static_argnums=(2, 3))(tables, codes, False, False)
    got = tok.decode(np.asarray(toks[:n]).tolist(), skip_special_tokens=False)
    assert got == "\n<|im_start|>user\n" + ref.message(board.tolist(), 2, 0) + "<|im_end|>\n<|im_start|>assistant\n"
    assert tables.slot_names == ttt_text.SLOT_NAMES


# ---------------------------------------------------------------------------------------------------------
# parsing == Python re
# ---------------------------------------------------------------------------------------------------------

L = 64
B = 16
_parse_bytes = jax.jit(jax.vmap(parse_bytes))


def _run_bytes(items):
    items = [bytes(x[:L]) for x in items]
    for start in range(0, len(items), B):
        _run_batch(items[start : start + B])


def _run_batch(items):
    data = np.zeros((B, L), np.uint8)
    valid = np.zeros((B, L), bool)
    for i, x in enumerate(items):
        data[i, : len(x)] = np.frombuffer(x, np.uint8)
        valid[i, : len(x)] = True
    move, fmt = _parse_bytes(jnp.asarray(data), jnp.asarray(valid))
    move, fmt = np.asarray(move), np.asarray(fmt)
    for i, x in enumerate(items):
        assert (int(move[i]), bool(fmt[i])) == ref.parse_bytes(x), x


UNICODE_WS = ["\u00a0", "\u2003", "\x1c", "\x1f", "\x85", "\u3000", "\u1680", "\u2028", "\u205f", "\u202f"]
FRAGMENTS = [s.encode() for s in [
    "<move>", "</move>", "<move", "</ move>", "<Move>", "</Move>", "move>", "</move", "<think>", "</think>",
    "<think", "</ think>", "<", ">", "/", "0", "1", "4", "8", "9", "10", "42", "x", "a", " ", "\n", "\t", "\r",
    "\x0b", "\x0c", "I can win at 2.", "\u200b", "\ufeff", "é", "\u2003", "\u00a0", *UNICODE_WS,
]] + [b"\xe2\x80", b"\xc2", b"\xe2", b"\xe1\x9a", b"\xe3\x80", b"\x80", b"\xff", b"\xc2\x20", b"\xe2\x80\x8b"]

fragment_text = st.tuples(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.integers(0, L)).map(
    lambda t: b"".join(t[0])[: t[1]]
)


WS_BYTES = [w.encode() for w in [" ", "\n", "\t", "\r", "\x0b", "\x0c", *UNICODE_WS, "\u2000", "\u200a", "\u2029",
                                  "\u200b", "\ufeff", "\u180e"]] + [b"\xc2", b"\xe2\x80", b"\xe1\x9a", b"\xe3\x80"]
tag_reply = st.builds(
    lambda pre, o, w1, c, w2, cl, post, cut: (b"".join(pre) + o + b"".join(w1) + c + b"".join(w2) + cl
                                              + b"".join(post))[:cut],
    st.lists(st.sampled_from([b"<think>", b"</think>", b"x", b" ", b"<move>", b"</move>", b"<", b"I can win."]),
             max_size=3),
    st.sampled_from([b"<move>", b"<move", b"<Move>", b"<move >", b"<<move>", b"<move><move>"]),
    st.lists(st.sampled_from(WS_BYTES), max_size=3),
    st.sampled_from([b"", b"9", b"10", b"x", b"4 4", b"-1", b"\xe2\x80\x8b", b"</move>"] + [str(d).encode() for d in range(9)] * 3),
    st.lists(st.sampled_from(WS_BYTES), max_size=3),
    st.sampled_from([b"</move>", b"</move>", b"</ move>", b"</Move>", b"</move", b"", b"<</move>", b"</move></move>"]),
    st.lists(st.sampled_from([b"</think>", b"<move>5</move>", b" ", b"</move>", b"x"]), max_size=2),
    st.one_of(st.just(L), st.integers(0, L)),
)


@settings(max_examples=100)
@given(st.lists(tag_reply, min_size=B, max_size=B))
def test_parse_structured_replies(items):
    _run_bytes(items)


def test_parse_every_character_around_a_digit():
    """Exhaustive: every code point below U+3100 (all of str.isspace() but none above it) and a few beyond,
    before and after the digit inside the tag, plus every pair of whitespace characters."""
    big = jax.jit(jax.vmap(parse_bytes))
    chars = [chr(c) for c in range(0x3100) if not 0xD800 <= c < 0xE000] + ["\ufeff", "\ufffd", "\U0001f600"]
    ws = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    assert max(map(ord, ws)) < 0x3100
    items = [f"<move>4{c}</move>".encode() for c in chars] + [f"<move>{c}4</move>".encode() for c in chars]
    items += [f"<move>{a}{b}</move>".encode() for a in ws for b in ws]
    items += [f"<move>{a}7{b}</move>".encode() for a in ws for b in ws]
    n = 2048
    for start in range(0, len(items), n):
        chunk = items[start : start + n]
        data = np.zeros((n, 24), np.uint8)
        valid = np.zeros((n, 24), bool)
        for i, x in enumerate(chunk):
            data[i, : len(x)] = np.frombuffer(x, np.uint8)
            valid[i, : len(x)] = True
        move, fmt = (np.asarray(a) for a in big(jnp.asarray(data), jnp.asarray(valid)))
        for i, x in enumerate(chunk):
            assert (int(move[i]), bool(fmt[i])) == ref.parse_bytes(x), x


def test_parse_examples():
    cases = [b"<move>4</move>", b"<think>a</think><move> 4 </move>", "<move>\u00a04\u2003</move>".encode(),
             b"<move>10</move>", b"<move></move>", b"<move>4", b"</move><move>4</move>", b"<move><move>4</move>",
             b"<move>4</move><move>5</move>", b"<Move>4</Move>", b"<move>4</ move>", b"x<think></think><move>9</move>",
             "<move>\x1c3\x85</move>".encode(), b"<move>\xc24</move>", b"<think><move>1</move></think>",
             b"<move>4\xe2\x80</move>", "<move>\u200b4</move>".encode()]
    _run_bytes(cases)
    assert ref.parse_bytes(b"<move>4</move>") == (4, False)
    assert ref.parse_bytes(b"<think>a</think><move> 4 </move>") == (4, True)
    assert ref.parse_bytes("<move>\u00a04\u2003</move>".encode()) == (4, False)
    assert ref.parse_bytes(b"<move>\xc24</move>")[0] == 9


@settings(max_examples=60)
@given(st.lists(st.binary(max_size=L), min_size=B, max_size=B))
def test_parse_random_bytes(items):
    _run_bytes(items)


@settings(max_examples=150)
@given(st.lists(fragment_text, min_size=B, max_size=B))
def test_parse_tag_fragments(items):
    _run_bytes(items)


@settings(max_examples=60)
@given(st.lists(st.text(alphabet=st.sampled_from(list("<>/movethink 0123456789\n") + UNICODE_WS), max_size=30),
                min_size=B, max_size=B))
def test_parse_tag_alphabet_text(items):
    _run_bytes([s.encode() for s in items])


N_TOK = 24
_parse_reply = jax.jit(jax.vmap(parse_reply, in_axes=(None, 0, 0)))


@pytest.fixture(scope="module")
def token_pool(tok):
    pool = set()
    for s in ["<move>", "</move>", "<think>", "</think>", " 4 ", "\u00a0", "\u2003", "<move> 5\n</move>",
              "<think>I can win at 2.</think>\n<move>2</move>", "10", "Corner is strong."]:
        pool.update(tok(s, add_special_tokens=False)["input_ids"])
    pool.update([tok.eos_token_id, tok.pad_token_id, tok.bos_token_id])
    return sorted(pool)


def test_parse_random_token_sequences(tok, tables, token_pool):
    fn = _parse_reply
    tb = text.token_bytes(tok)
    specials = set(tok.all_special_ids)
    v = len(tok)

    @settings(max_examples=60)
    @given(st.lists(st.tuples(st.lists(st.one_of(st.integers(0, v + 3), st.sampled_from(token_pool)),
                                       max_size=N_TOK), st.integers(0, N_TOK)), min_size=B, max_size=B))
    def check(items):
        ids = np.zeros((B, N_TOK), np.int32)
        lengths = np.zeros((B,), np.int32)
        for i, (seq, cut) in enumerate(items):
            ids[i, : len(seq)] = seq
            lengths[i] = min(cut, len(seq))
        move, fmt = fn(tables, jnp.asarray(ids), jnp.asarray(lengths))
        for i, (seq, cut) in enumerate(items):
            real = seq[: lengths[i]]
            data = b"".join(tb[t] if t < v else b"" for t in real)
            assert (int(move[i]), bool(fmt[i])) == ref.parse_bytes(data), real
            in_vocab = [t for t in real if t < v]
            # the byte table agrees with the tokenizer's own decoding (special tokens skipped)
            assert tok.decode(in_vocab, skip_special_tokens=True) == data.decode("utf-8", errors="replace")
            assert all(tb[t] == b"" for t in in_vocab if t in specials)

    check()


def test_parse_reply_jits_and_vmaps(tables, tok):
    replies = ["<think>I can win at 2.</think>\n<move>2</move>", "<move> 7 </move>", "no tag", "<move>x</move>"]
    ids = np.full((B, N_TOK), tok.pad_token_id, np.int32)
    lengths = np.zeros((B,), np.int32)
    for i, r in enumerate(replies):
        t = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids[i, : len(t)] = t
        lengths[i] = len(t)
    move, fmt = _parse_reply(tables, jnp.asarray(ids), jnp.asarray(lengths))
    assert np.asarray(move).tolist()[:4] == [2, 7, -1, 9]
    assert np.asarray(fmt).tolist()[:4] == [True, False, False, False]
    assert (np.asarray(move)[4:] == -1).all()
