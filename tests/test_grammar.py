"""Reply grammars: the on-device parser (jaxrl_llm.text.grammar) equals Python `re` (reference_grammar).

Every content kind (cell, integer, text), both format layouts ((think, tag) and (tag,)), hypothesis
properties built from fragments, a deterministic fuzz of 10 000+ replies per grammar, Tic-Tac-Toe
equivalence with the spec's parser, and parsing from token ids with the project tokenizer.
"""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_grammar as ref
import reference_text
from envs.core import ReplyGrammar
from jaxrl_llm.text import grammar

L = 64  # bytes per reply (longer replies are cut here)
B = 8  # replies per hypothesis example
N_FUZZ = 10_240  # fuzz replies per grammar (one jitted call)

TTT = ReplyGrammar("move", "cell", num_cells=9, format_tags=("think", "move"))


def _grammars() -> list[ReplyGrammar]:
    kinds = [("move", "cell", dict(num_cells=9)), ("col", "cell", dict(num_cells=7)),
             ("cell", "cell", dict(num_cells=16)), ("pos", "cell", dict(num_cells=100)),
             ("answer", "integer", dict(max_digits=3)), ("th", "integer", dict(max_digits=6)),
             ("guess-2", "integer", dict(max_digits=9)), ("reply_x", "text", {})]
    out = []
    for tag, content, kw in kinds:
        for fmt in (("think", tag), (tag,)):
            out.append(ReplyGrammar(tag, content, format_tags=fmt, **kw))
    return out


GRAMMARS = _grammars()
assert TTT in GRAMMARS


def _gid(g: ReplyGrammar) -> str:
    size = {"cell": f"{g.num_cells}", "integer": f"{g.max_digits}d", "text": ""}[g.content]
    return f"{g.content}{size}-{g.tag}-{'+'.join(g.format_tags)}"


def find(content: str, size: int | None = None, think: bool = True) -> ReplyGrammar:
    """The grammar of GRAMMARS with this content kind, size (num_cells or max_digits) and format layout."""
    for g in GRAMMARS:
        if g.content == content and size in (None, g.num_cells if content == "cell" else g.max_digits) \
                and (len(g.format_tags) == 2) == think:
            return g
    raise LookupError((content, size, think))


# ---------------------------------------------------------------------------------------------------------
# running the parser against the reference
# ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _parser(g: ReplyGrammar):
    return jax.jit(jax.vmap(functools.partial(grammar.parse_bytes, g)))


def _pack(items: list[bytes], rows: int) -> tuple[np.ndarray, np.ndarray]:
    data = np.zeros((rows, L), np.uint8)
    valid = np.zeros((rows, L), bool)
    for i, x in enumerate(items):
        data[i, : len(x)] = np.frombuffer(x, np.uint8)
        valid[i, : len(x)] = True
    return data, valid


def parse_batch(g: ReplyGrammar, items: list[bytes], rows: int | None = None) -> list[ref.Parsed]:
    """Parse replies (each at most L bytes) on device in one call of `rows` (default B) rows."""
    rows = rows or B
    assert len(items) <= rows and all(len(x) <= L for x in items)
    out = [np.asarray(a) for a in _parser(g)(*_pack(items, rows))]
    return [ref.Parsed(bool(out[0][i]), bool(out[1][i]), int(out[2][i]), bool(out[3][i])) for i in range(len(items))]


def check(g: ReplyGrammar, items: list[bytes]) -> None:
    """Assert the device parse of every reply (cut at L bytes) equals the reference (batches of B)."""
    items = [bytes(x)[:L] for x in items]
    for start in range(0, len(items), B):
        for x, p in zip(items[start : start + B], parse_batch(g, items[start : start + B])):
            assert p == ref.parse_bytes(g, x), (g, x)


# ---------------------------------------------------------------------------------------------------------
# fragments
# ---------------------------------------------------------------------------------------------------------

UNICODE_WS = ["\u00a0", "\u2003", "\u3000", "\x85", "\x1c", "\x1f", "\u1680", "\u2028", "\u205f", "\u202f"]
NOT_WS = ["\u200b", "\ufeff", "\u180e", "é", "\ufffd"]  # zero-width space, BOM, Mongolian vowel separator
NON_ASCII_DIGITS = ["٣", "５", "１", "۷", "߃"]
BAD_UTF8 = [b"\xff", b"\x80", b"\xe2\x80", b"\xc2", b"\xe2", b"\xe1\x9a", b"\xe3\x80", b"\xc2\x20", b"\xed\xa0\x80"]
WS = [" ", "\n", "\t", "\r", "\x0b", "\x0c", *UNICODE_WS]


def _enc(items) -> list[bytes]:
    return [x if isinstance(x, bytes) else x.encode() for x in items]


def tag_fragments(tag: str) -> list[bytes]:
    """The grammar's tags and near misses: broken, spaced, case-changed, nested, doubled."""
    up = tag.upper() if tag.upper() != tag else tag.capitalize()
    return _enc([f"<{tag}>", f"</{tag}>", f"<{tag}", f"</ {tag}>", f"<{up}>", f"</{up}>", f"{tag}>", f"</{tag}",
                 f"<{tag} >", f"<<{tag}>", f"<{tag}><{tag}>", f"</{tag}></{tag}>", f"<{tag[:-1]}>", f"<{tag}x>",
                 "<think>", "</think>", "<think", "</ think>", "<th", "<", ">", "/"])


def content_fragments(g: ReplyGrammar) -> list[bytes]:
    """Contents that are (or nearly are) values of the grammar's kind."""
    common = ["", "0", "1", "4", "7", "8", "9", "10", "12", "42", "99", "+", "-", "+4", "04", "-0", "00", "007",
              "4 4", "- 7", "+ 7", "-\u20037", "+-3", "1,000", "1e3", "7.0", "x", "a", ".", "٣", "５", "４２",
              "\u200b4", "4\u200b", "\ufeff7", b"4\xe2\x80", b"\xc24", b"\xff", "</", "<"]
    if g.content == "cell":
        n = g.num_cells
        common += [str(i) for i in range(min(n, 12))]
        common += [str(n - 1), str(n), str(n + 1), "0" + str(n - 1), "+" + str(n - 1), str(n - 1) + "0", str(n // 2)]
    if g.content == "integer":
        m = g.max_digits
        common += ["9" * m, "9" * (m + 1), "-" + "9" * m, "+" + "0" * m, "0" * (m + 1), "1" + "0" * (m - 1),
                   "-" + "1" * (m + 1), "+" + "9" * m, "-" + "0" * m]
    return _enc(common)


def fragments(g: ReplyGrammar) -> list[bytes]:
    return (tag_fragments(g.tag) + content_fragments(g) + _enc(WS + NOT_WS + NON_ASCII_DIGITS) + BAD_UTF8
            + _enc(["I can win at 2.", "-", "+", "3", "5"]))


# ---------------------------------------------------------------------------------------------------------
# hypothesis properties, per content kind
# ---------------------------------------------------------------------------------------------------------


def fragment_replies(g: ReplyGrammar):
    """Soups of fragments, cut anywhere up to L."""
    return st.tuples(st.lists(st.sampled_from(fragments(g)), max_size=16), st.integers(0, L)).map(
        lambda t: b"".join(t[0])[: t[1]])


def structured_replies(g: ReplyGrammar):
    """text, an opening tag (or a near miss), space, a content, space, a closing tag (or not), text; cut."""
    tag = g.tag
    up = tag.upper() if tag.upper() != tag else tag.capitalize()
    ws = st.lists(st.sampled_from(_enc(WS + NOT_WS[:2]) + [b"\xc2", b"\xe2\x80"]), max_size=3).map(b"".join)
    opening = st.sampled_from(_enc([f"<{tag}>"] * 4 + [f"<{tag}", f"<{up}>", f"<{tag} >", f"<<{tag}>",
                                                          f"<{tag}><{tag}>"]))
    closing = st.sampled_from(_enc([f"</{tag}>"] * 4 + [f"</ {tag}>", f"</{up}>", f"</{tag}", "", f"<</{tag}>",
                                                           f"</{tag}></{tag}>"]))
    signed = st.builds(lambda s, d: s + d, st.sampled_from([b"", b"", b"+", b"-"]),
                       st.integers(0, 10 ** (g.max_digits + 1)).map(lambda v: str(v).encode()))
    padded = st.builds(lambda z, d: b"0" * z + d, st.integers(0, 3),
                       st.integers(0, 10**3).map(lambda v: str(v).encode()))
    content = st.one_of(st.sampled_from(content_fragments(g)), signed, padded)
    noise = st.lists(st.sampled_from(_enc(["<think>.</think>", "<think>", "</think>", "I think.", " ", "x", "<",
                                           f"</{tag}>", f"<{tag}>5</{tag}>"]) + BAD_UTF8[:2]), max_size=3)
    noise = noise.map(b"".join)
    return st.builds(lambda a, o, w1, c, w2, cl, z, cut: (a + o + w1 + c + w2 + cl + z)[:cut],
                     noise, opening, ws, content, ws, closing, noise, st.one_of(st.just(L), st.integers(0, L)))


ALL = [pytest.param(g, id=_gid(g)) for g in GRAMMARS]
# hypothesis runs over every size and kind, each kind in both format layouts (the fuzz below runs all 16)
PROPERTY = [pytest.param(g, id=_gid(g)) for g in [
    find("cell", 9), find("cell", 7), find("cell", 16, think=False), find("cell", 100),
    find("integer", 3, think=False), find("integer", 6), find("integer", 9, think=False), find("text"),
    find("text", think=False)]]


@pytest.mark.parametrize("g", PROPERTY)
@settings(max_examples=25)
@given(data=st.data())
def test_fragment_soups(g, data):
    check(g, data.draw(st.lists(fragment_replies(g), min_size=B, max_size=B)))


@pytest.mark.parametrize("g", PROPERTY)
@settings(max_examples=25)
@given(data=st.data())
def test_structured_replies(g, data):
    check(g, data.draw(st.lists(structured_replies(g), min_size=B, max_size=B)))


@settings(max_examples=25)
@given(st.lists(st.binary(max_size=L), min_size=B, max_size=B))
def test_random_bytes(items):
    check(find("cell", 16, think=False), items)


# ---------------------------------------------------------------------------------------------------------
# examples: each decision of the semantics, spelled out
# ---------------------------------------------------------------------------------------------------------

P = ref.Parsed


CELL16 = find("cell", 16, think=False)  # tag "cell"
INT9 = find("integer", 9, think=False)  # tag "guess-2"
INT3 = find("integer", 3, think=False)  # tag "answer"
TEXT = find("text", think=False)  # tag "reply_x"
ONE_CELL = ReplyGrammar("move", "cell", num_cells=1)
MILLION = ReplyGrammar("move", "cell", num_cells=10**6)
PREFIX = ReplyGrammar("a", "cell", format_tags=("ab", "a"))  # a tag that is a prefix of a format tag

EXAMPLES = [
    # (grammar, reply with {t} for the tag, (found, valid, value, format_ok))
    (TTT, "<think>a</think><{t}> 4 </{t}>", P(True, True, 4, True)),
    (TTT, "<{t}>\u00a04\u2003</{t}>", P(True, True, 4, False)),
    (TTT, "<{t}>+4</{t}>", P(True, False, 0, False)),
    (TTT, "<{t}>04</{t}>", P(True, False, 0, False)),
    (TTT, "<{t}>9</{t}>", P(True, False, 0, False)),
    (TTT, "<{t}>٣</{t}>", P(True, False, 0, False)),
    (TTT, "<{t}>4", P(False, False, 0, False)),
    (TTT, "<{t}><{t}>4</{t}>", P(True, False, 0, False)),
    (TTT, "<Move>4</Move>", P(False, False, 0, False)),
    (TTT, "<think><{t}>1</{t}></think>", P(True, True, 1, False)),
    (TTT, "x<think>y</think>z<{t}>0</{t}>w", P(True, True, 0, True)),
    (CELL16, "<{t}>12</{t}>", P(True, True, 12, True)),
    (CELL16, "<{t}>012</{t}>", P(True, False, 0, True)),
    (CELL16, "<{t}>16</{t}>", P(True, False, 0, True)),
    (ONE_CELL, "<{t}>0</{t}>", P(True, True, 0, True)),
    (ONE_CELL, "<{t}>1</{t}>", P(True, False, 0, True)),
    (MILLION, "<{t}>999999</{t}>", P(True, True, 999_999, True)),
    (MILLION, "<{t}>1000000</{t}>", P(True, False, 0, True)),
    (MILLION, "<{t}>99999999999999</{t}>", P(True, False, 0, True)),
    (INT9, "<{t}>+7</{t}>", P(True, True, 7, True)),
    (INT9, "<{t}>007</{t}>", P(True, True, 7, True)),
    (INT9, "<{t}>-0</{t}>", P(True, True, 0, True)),
    (INT9, "<{t}> -17\n</{t}>", P(True, True, -17, True)),
    (INT9, "<{t}>999999999</{t}>", P(True, True, 999_999_999, True)),
    (INT9, "<{t}>-999999999</{t}>", P(True, True, -999_999_999, True)),
    (INT9, "<{t}>1000000000</{t}>", P(True, False, 0, True)),
    (INT9, "<{t}>0000000001</{t}>", P(True, False, 0, True)),
    (INT3, "<{t}>-123</{t}>", P(True, True, -123, True)),
    (INT3, "<{t}>0123</{t}>", P(True, False, 0, True)),
    *[(INT9, f"<{{t}}>{c}</{{t}}>", P(True, False, 0, True)) for c in
      ["٣", "１", "- 7", "+ 7", "+\u00a07", "1,000", "1e3", "7.0", "+", "-", "", "+-1", "7-", "\u200b7", "0x1"]],
    (INT9, "<{t}>5</{t}><{t}>6</{t}>", P(True, True, 5, True)),
    (TEXT, "<{t}> anything at all </{t}>", P(True, True, 0, True)),
    (TEXT, "<{t}></{t}>", P(True, True, 0, True)),
    (TEXT, "<{t}>unclosed", P(False, False, 0, False)),
    (PREFIX, "<ab>x</ab><{t}>3</{t}>", P(True, True, 3, True)),
    (PREFIX, "<{t}>3</{t}><ab>x</ab>", P(True, True, 3, False)),
]


@pytest.mark.parametrize("g, reply, expected", EXAMPLES, ids=[f"{_gid(e[0])}:{e[1]!r}"[:60] for e in EXAMPLES])
def test_examples(g, reply, expected):
    data = reply.replace("{t}", g.tag).encode()
    assert ref.parse_bytes(g, data) == expected
    assert parse_batch(g, [data]) == [expected]


# ---------------------------------------------------------------------------------------------------------
# fuzz: 10 000+ replies per grammar, all grammars parsed in one jitted call
# ---------------------------------------------------------------------------------------------------------


def fuzz_replies(g: ReplyGrammar, seed: int, count: int = N_FUZZ) -> list[bytes]:
    """Deterministic random replies for `g`: fragment soups, structured replies, raw bytes, exact-L ones."""
    rng = random.Random(seed)
    frags = fragments(g)
    contents = content_fragments(g) + [str(rng.randrange(10**k)).encode() for k in range(1, 11) for _ in range(3)]
    tag = g.tag
    opening = _enc([f"<{tag}>"] * 6 + [f"<{tag}", f"<{tag.upper()}>", f"<<{tag}>", f"<{tag}><{tag}>"])
    closing = _enc([f"</{tag}>"] * 6 + [f"</ {tag}>", f"</{tag}", "", f"<</{tag}>"])
    spaces = _enc(WS + NOT_WS[:2]) + [b"\xc2", b"\xe2\x80"]
    noise = _enc(["<think>I think the centre.</think>", "<think>", "</think>", "<think>-</think>\n", "I think.", " ",
                  "\n", "<", f"</{tag}>", f"<{tag}>1</{tag}>"])

    def some(pool, k):
        return b"".join(rng.choice(pool) for _ in range(rng.randrange(k + 1)))

    out = []
    for i in range(count):
        r = rng.random()
        if r < 0.3:
            x = some(frags, 14)
        elif r < 0.9:
            sign = rng.choice([b"", b"", b"", b"+", b"-"])
            sign += rng.choice(spaces) if sign and rng.random() < 0.2 else b""  # "- 7" is no integer
            x = (some(noise, 2) + rng.choice(opening) + some(spaces, 2) + sign + rng.choice(contents)
                 + some(spaces, 2) + rng.choice(closing) + some(noise, 2))
        else:
            x = bytes(rng.randrange(256) if rng.random() < 0.5 else rng.choice(b"<>/0123456789 " + tag.encode())
                      for _ in range(rng.randrange(L + 8)))
        if rng.random() < 0.15:  # exactly L bytes: filler in front, or cut
            filler = rng.choice([b" ", b"x", b"\n", b"<"])
            x = (filler * L + x)[-L:] if rng.random() < 0.5 else (x + filler * L)[:L]
        elif rng.random() < 0.15:
            x = x[: rng.randrange(len(x) + 1)]
        out.append(x[:L])
    return out


@functools.lru_cache(maxsize=1)
def whitespace_characters() -> tuple[str, ...]:
    return tuple(chr(c) for c in range(0x110000) if chr(c).isspace())


def whitespace_replies(g: ReplyGrammar) -> list[bytes]:
    """Every str.isspace() character, and every pair, around contents (and between digits)."""
    ws = list(whitespace_characters())
    items = [f"<{g.tag}>{a}{c}{b}</{g.tag}>".encode() for a in ws for b in ws for c in ("7", "-12", "")]
    return items + [f"<{g.tag}>{a}1{b}2</{g.tag}>".encode() for a in ws for b in ws[:8] + ["\u200b", "٣"]]


def tictactoe_replies() -> list[bytes]:
    """The spec's own examples of Tic-Tac-Toe replies."""
    items = [f"<move>{c}</move>".encode() for c in
             ["4", " 4 ", "\u00a04\u2003", "+4", "04", "9", "10", "٣", "\x1c3\x85", "\u200b4", "4\xe2\x80"]]
    return items + [b"<think>a</think><move>4</move>", b"<move>4</move><move>5</move>",
                    b"<think><move>1</move></think>", b"x<think></think><move>9</move>", b"<move>\xc24</move>"]


WHITESPACE_GRAMMARS = (find("cell", 16), find("integer", 3, think=False), find("text"))


def fuzz_set(g: ReplyGrammar) -> list[bytes]:
    """The replies the fuzz parses for `g`: 10 240 random ones, plus every-whitespace and spec examples."""
    items = fuzz_replies(g, seed=GRAMMARS.index(g))
    items += whitespace_replies(g) if g in WHITESPACE_GRAMMARS else []
    return items + (tictactoe_replies() if g == TTT else [])


@pytest.fixture(scope="module")
def fuzzed() -> dict[ReplyGrammar, tuple[list[bytes], list[ref.Parsed]]]:
    """{grammar: (replies, device parses)} for every grammar of GRAMMARS, from one jitted call."""
    items = {g: [x[:L] for x in fuzz_set(g)] for g in GRAMMARS}
    packed = {g: _pack(x, len(x)) for g, x in items.items()}

    keys = {g: f"g{i:02d}" for i, g in enumerate(GRAMMARS)}  # pytree keys must sort: strings

    @jax.jit
    def parse_all(batches):
        return {k: jax.vmap(functools.partial(grammar.parse_bytes, g))(*batches[k]) for g, k in keys.items()}

    out = parse_all({keys[g]: packed[g] for g in GRAMMARS})
    result = {}
    for g, k in keys.items():
        found, valid, value, fmt = (np.asarray(a) for a in out[k])
        result[g] = (items[g], [ref.Parsed(bool(found[i]), bool(valid[i]), int(value[i]), bool(fmt[i]))
                                for i in range(len(items[g]))])
    return result


@pytest.mark.parametrize("g", ALL)
def test_fuzz_against_reference(g, fuzzed):
    items, got = fuzzed[g]
    expected = [ref.parse_bytes(g, x) for x in items]
    mismatches = [(x, p, e) for x, p, e in zip(items, got, expected) if p != e]
    assert not mismatches, f"{len(mismatches)} of {len(items)} differ, e.g. {mismatches[:3]}"
    # the fuzz reaches every outcome
    exact = sum(len(x) == L for x in items)
    counts = {"found valid": sum(e.found and e.valid for e in expected),
              "found invalid": sum(e.found and not e.valid for e in expected),
              "not found": sum(not e.found for e in expected), "format ok": sum(e.format_ok for e in expected)}
    assert len(items) >= 10_000 and exact >= 500, (len(items), exact)
    if g.content == "text":
        counts.pop("found invalid")
    assert min(counts.values()) >= 300, counts


def test_every_whitespace_character_around_contents(fuzzed):
    """Every str.isspace() character, and every pair, around contents of each kind (parsed in the fuzz)."""
    for g in WHITESPACE_GRAMMARS:
        items, got = fuzzed[g]
        extra = whitespace_replies(g)
        assert items[N_FUZZ : N_FUZZ + len(extra)] == extra
        for x, p in zip(extra, got[N_FUZZ:]):
            assert p == ref.parse_bytes(g, x), x


# ---------------------------------------------------------------------------------------------------------
# Tic-Tac-Toe: the grammar reproduces the spec's move/format parse
# ---------------------------------------------------------------------------------------------------------


def tictactoe_move(p) -> int:
    """ParsedReply (or reference Parsed) -> the Tic-Tac-Toe move code: -1 no tag, 0..8 a cell, 9 invalid."""
    return -1 if not p.found else (p.value if p.valid else 9)


def test_tictactoe_equals_the_spec(fuzzed):
    """ReplyGrammar("move", "cell", 9, ("think", "move")) gives the spec's move code and format flag: those of
    reference_text.parse_bytes (and tests/test_text.py checks the Tic-Tac-Toe parse exhaustively)."""
    items, got = fuzzed[TTT]
    assert items[-len(tictactoe_replies()):] == tictactoe_replies()
    for x, p in zip(items, got):
        assert (tictactoe_move(p), p.format_ok) == reference_text.parse_bytes(x), x
    assert {tictactoe_move(p) for p in got} == set(range(-1, 10))


# ---------------------------------------------------------------------------------------------------------
# from token ids, with the project tokenizer
# ---------------------------------------------------------------------------------------------------------

N_TOK = 24
TOKEN_INT = ReplyGrammar("move", "integer", max_digits=3)


class ByteTables(NamedTuple):
    """What `parse_reply` needs of the text tables: each token id's bytes."""

    byte_table: jax.Array  # uint8[V, max_token_bytes]
    byte_lengths: jax.Array  # int32[V]


def _load_tokenizer():
    from jaxrl_llm.text.tokenizer import load_tokenizer

    return load_tokenizer()


def _token_bytes(tok) -> list[bytes]:
    from jaxrl_llm.text import token_bytes

    return token_bytes(tok)


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


@pytest.fixture(scope="module")
def token_table(tok):
    tb = _token_bytes(tok)
    width = max(1, max(map(len, tb)))
    table = np.zeros((len(tb), width), np.uint8)
    for i, b in enumerate(tb):
        table[i, : len(b)] = np.frombuffer(b, np.uint8)
    return tb, ByteTables(jnp.asarray(table), jnp.asarray(np.array([len(b) for b in tb], np.int32)))


@functools.lru_cache(maxsize=None)
def _reply_parser(g: ReplyGrammar):
    return jax.jit(jax.vmap(grammar.parse_reply, in_axes=(None, None, 0, 0)), static_argnums=1)


def _ids(tok, replies):
    ids = np.full((B, N_TOK), tok.pad_token_id, np.int32)
    lengths = np.zeros((B,), np.int32)
    for i, r in enumerate(replies):
        t = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert len(t) <= N_TOK, r
        ids[i, : len(t)] = t
        lengths[i] = len(t)
    return jnp.asarray(ids), jnp.asarray(lengths)


def test_parse_reply_jits_and_vmaps(tok, token_table):
    _, tables = token_table
    replies = ["<think>I can win at 2.</think>\n<move>2</move>", "<move> 7 </move>", "no tag", "<move>x</move>",
               "<move>12</move>"]
    ids, lengths = _ids(tok, replies)
    for g, expect in [
        (TTT, [(1, 1, 2, 1), (1, 1, 7, 0), (0, 0, 0, 0), (1, 0, 0, 0), (1, 0, 0, 0)]),
        (TOKEN_INT, [(1, 1, 2, 1), (1, 1, 7, 1), (0, 0, 0, 0), (1, 0, 0, 1), (1, 1, 12, 1)]),
        (ReplyGrammar("move", "text"), [(1, 1, 0, 1), (1, 1, 0, 1), (0, 0, 0, 0), (1, 1, 0, 1), (1, 1, 0, 1)]),
    ]:
        out = _reply_parser(g)(tables, g, ids, lengths)
        assert all(a.shape == (B,) for a in out)
        assert out.value.dtype == jnp.int32 and out.found.dtype == jnp.bool_
        rows = np.stack([np.asarray(a).astype(int) for a in out], axis=1).tolist()
        assert [tuple(r) for r in rows[: len(replies)]] == expect, g
        assert all(r == [0, 0, 0, 0] for r in rows[len(replies):])  # empty replies


def test_parse_random_token_sequences(tok, token_table):
    tb, tables = token_table
    v = len(tb)
    pool = set()
    for s in ["<move>", "</move>", "<think>", "</think>", " 4 ", "\u00a0", "<move> 5\n</move>", "+", "-", "10",
              "<think>I can win at 2.</think>\n<move>2</move>", "Corner is strong."]:
        pool.update(tok(s, add_special_tokens=False)["input_ids"])
    pool.update([tok.eos_token_id, tok.pad_token_id, tok.bos_token_id])
    pool = sorted(pool)
    grammars = (TTT, TOKEN_INT)

    @settings(max_examples=30)
    @given(st.lists(st.tuples(st.lists(st.one_of(st.integers(-3, v + 3), st.sampled_from(pool)), max_size=N_TOK),
                              st.integers(0, N_TOK)), min_size=B, max_size=B))
    def run(items):
        ids = np.zeros((B, N_TOK), np.int32)
        lengths = np.zeros((B,), np.int32)
        for i, (seq, cut) in enumerate(items):
            ids[i, : len(seq)] = seq
            lengths[i] = min(cut, len(seq))
        for g in grammars:
            out = [np.asarray(a) for a in _reply_parser(g)(tables, g, jnp.asarray(ids), jnp.asarray(lengths))]
            for i, (seq, _) in enumerate(items):
                data = b"".join(tb[t] if 0 <= t < v else b"" for t in seq[: lengths[i]])
                got = ref.Parsed(bool(out[0][i]), bool(out[1][i]), int(out[2][i]), bool(out[3][i]))
                assert got == ref.parse_bytes(g, data), (g, seq[: lengths[i]])

    run()


# ---------------------------------------------------------------------------------------------------------
# the grammar as a static argument; bad grammars
# ---------------------------------------------------------------------------------------------------------


def test_grammar_is_a_static_argument():
    items = [b"<n> 42 </n>", b"<n>x</n>"]
    data, valid = _pack(items, 2)
    fn = jax.jit(grammar.parse_bytes, static_argnums=0)
    cell, integer = ReplyGrammar("n", "cell", num_cells=50), ReplyGrammar("n", "integer", max_digits=2)
    assert hash(cell) == hash(ReplyGrammar("n", "cell", num_cells=50))
    for g in (cell, integer):
        got = [fn(g, jnp.asarray(data[i]), jnp.asarray(valid[i])) for i in range(2)]
        assert [int(p.value) for p in got] == [42, 0]
        assert [bool(p.valid) for p in got] == [True, False]
    assert not bool(fn(ReplyGrammar("n", "cell", num_cells=42), jnp.asarray(data[0]), jnp.asarray(valid[0])).valid)


def test_padding_bytes_are_skipped():
    """Bytes whose valid flag is False are not part of the reply, wherever they are."""
    g = ReplyGrammar("n", "integer", format_tags=("think", "n"))
    reply = b"<think>.</think><n> -305 </n>"
    rng = np.random.default_rng(0)
    data = np.zeros((B, L), np.uint8)
    valid = np.zeros((B, L), bool)
    for row in range(B):
        keep = np.sort(rng.choice(L, len(reply), replace=False))
        data[row] = rng.integers(0, 256, L)
        data[row, keep] = np.frombuffer(reply, np.uint8)
        valid[row, keep] = True
    out = _parser(g)(jnp.asarray(data), jnp.asarray(valid))
    assert np.asarray(out.found).all() and np.asarray(out.valid).all() and np.asarray(out.format_ok).all()
    assert (np.asarray(out.value) == -305).all()


def test_ids_outside_the_table_are_no_bytes():
    tables = ByteTables(jnp.asarray(np.array([[60, 0], [62, 0], [52, 53], [120, 0]], np.uint8)),
                        jnp.asarray(np.array([1, 1, 2, 1], np.int32)))  # "<", ">", "45", "x"
    data, valid = grammar.reply_bytes(tables, jnp.asarray([2, -1, 4, -4, 3, 0, 0], jnp.int32), 5)
    assert data.dtype == jnp.uint8 and data.shape == valid.shape == (14,)
    kept = np.asarray(data)[np.asarray(valid)]
    assert bytes(kept) == b"45x" and not np.asarray(data)[2:8].any()


@pytest.mark.parametrize("tag", ["mo<ve", "move>", "", "mové", "a b", "a/b", "a.b", "a\n"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(ValueError, match="must be ASCII letters, digits"):
        ReplyGrammar(tag)
    with pytest.raises(ValueError, match="must be ASCII letters, digits"):
        ReplyGrammar("move", format_tags=("think", tag))


def test_parse_bytes_needs_a_reply_grammar():
    with pytest.raises(TypeError, match="ReplyGrammar"):
        grammar.parse_bytes("move", jnp.zeros(4, jnp.uint8), jnp.ones(4, bool))
