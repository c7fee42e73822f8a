"""An env's reply grammar as a regular expression, written beside an exported model, and a `transformers`
logits processor that decodes under it.

A model trained with constrained replies (`[sampling] constrained = true`) has only ever written its replies
as the constrained sampler writes them: the grammar's fixed text (`text.tables.reply_texts`, e.g.
`<think></think>\\n<move>`, then `</move>`) around a content the sampler restricts (a cell: one of
`str(0)` .. `str(num_cells - 1)`; an integer: `-?[0-9]{1,max_digits}`; text: anything up to the closing
tag). `reply_regex(grammar)` spells exactly that language as a plain regular expression (literals, character
classes, groups, alternation, `?`, `*`, `{m,n}`; no lookarounds, backreferences, anchors or lazy
quantifiers), the subset that structured-generation tools accept (vLLM's guided regex, outlines, xgrammar).
Group 1 of a full match is the content, i.e. the answer. Every reply it matches parses, with the env's own
parser (`text.grammar`), as found, valid and in the format, with that content.

`jaxrl-llm export` writes `reply_grammar.json` ({"env", "regex", "answer_regex", "content", "note", ...},
`grammar_record`) beside the weights. `RegexLogitsProcessor(regex, tokenizer)` enforces such a regex in
`transformers`' `generate` with plain Python (a small regex-to-NFA compiler for the subset above, its
states cached per token): no dependency beyond what the caller already has. This module imports neither
jax nor torch at import time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jaxrl_base.errors import EnvError

__all__ = ["GRAMMAR_FILE", "GrammarRegexError", "RegexSyntaxError", "content_regex", "reply_regex",
           "grammar_record", "write_reply_grammar", "read_reply_grammar", "RegexMatcher", "RegexLogitsProcessor"]

GRAMMAR_FILE = "reply_grammar.json"  # written next to an exported HF checkpoint

_NOTE = ("The model was trained with constrained replies: decode it with this regular expression enforced "
         "(vLLM guided_regex / outlines / xgrammar, or jaxrl_llm.export_grammar.RegexLogitsProcessor in "
         "transformers), or it may write replies the env cannot read. Group 1 of a full match is the answer; "
         "answer_regex (Python re.search, DOTALL) reads it from a free reply as the env does.")


class GrammarRegexError(EnvError):
    """An env's reply grammar that cannot be spelled as a plain regular expression (names the env and why)."""


class RegexSyntaxError(ValueError):
    """A pattern outside the plain subset `RegexMatcher` (and structured-generation tools) accept."""


# ----------------------------------------------------------------------------------------------------------
# The grammar as a regex
# ----------------------------------------------------------------------------------------------------------

_SPECIAL = set("\\.^$*+?{}[]|()")
_ESCAPES = {"\n": r"\n", "\t": r"\t", "\r": r"\r", "\f": r"\f", "\v": r"\v"}


def _literal(text: str) -> str:
    """`text` as a regex that matches exactly it (control characters as escapes, specials backslashed)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch in _SPECIAL:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _digit_class(low: int, high: int) -> str:
    return str(low) if low == high else f"[{low}-{high}]"


def _digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def _below(n: int) -> str:
    """A regex (alternatives joined by '|', no group) for exactly {str(i) for i in range(n)}, n >= 1: no
    leading zeros, no sign, no space."""
    top = str(n - 1)
    size = len(top)
    alts = [_digit_class(0, 9 if size > 1 else int(top))]
    for length in range(2, size):
        alts.append("[1-9]" + _digits(length - 1))
    if size > 1:  # the numbers of top's length up to top: a smaller digit after top's own prefix, or top itself
        for i, ch in enumerate(top):
            low = 1 if i == 0 else 0
            if int(ch) > low:
                alts.append(top[:i] + _digit_class(low, int(ch) - 1) + _digits(size - i - 1))
        alts.append(top)
    return "|".join(alts)


def _avoiding(word: str) -> str:
    """A regex for exactly the strings that do not contain `word` (whose first character occurs in it only
    there, as '<' in a closing tag): runs of other characters, each occurrence of the first character
    followed by a proper prefix of the rest that then breaks off (or ends the string)."""
    head, rest = word[0], word[1:]
    other = f"[^{_class_char(head)}]"
    alts = []
    for j in range(len(rest)):
        alts.append(f"{_literal(rest[:j])}(?:[^{_class_char(rest[j])}{_class_char(head)}]{other}*)?")
    return f"{other}*(?:{_literal(head)}(?:{'|'.join(alts)}))*"


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else _literal(ch)


def _grammar_error(env: str, why: str) -> GrammarRegexError:
    return GrammarRegexError(f"env {env!r}: reply_grammar cannot be written as a regular expression for "
                             f"structured generation: {why}")


def content_regex(grammar: Any, env: str = "?") -> str:
    """The content the constrained sampler writes for `grammar`, as a regex without a group: cell
    `_below(num_cells)`, integer `-?[0-9]{1,max_digits}`, text any string without the closing tag."""
    kind = getattr(grammar, "content", None)
    if kind == "cell":
        return _below(int(grammar.num_cells))
    if kind == "integer":
        n = int(grammar.max_digits)
        return "-?" + ("[0-9]" if n == 1 else f"[0-9]{{1,{n}}}")
    if kind == "text":
        return _avoiding(f"</{grammar.tag}>")
    raise _grammar_error(env, f"its content kind {kind!r} has no regex (known: 'cell', 'integer', 'text')")


def reply_regex(grammar: Any, env: str = "?") -> str:
    """The whole reply the constrained sampler writes for `grammar` (an `envs.core.ReplyGrammar`): the fixed
    prefix, the content as group 1, the fixed suffix. Raises GrammarRegexError when there is none."""
    from envs.core import ReplyGrammar  # lazy: jax
    from jaxrl_llm.text.tables import reply_texts  # lazy: jax

    if not isinstance(grammar, ReplyGrammar):
        raise _grammar_error(env, f"it is a {type(grammar).__name__}, not an envs.ReplyGrammar")
    content = content_regex(grammar, env)
    try:
        prefix, suffix = reply_texts(grammar)
    except ValueError as e:  # e.g. the answer tag twice in format_tags: not one content slot
        raise _grammar_error(env, f"its format tags {grammar.format_tags} do not give one reply template "
                                  f"around the answer tag {grammar.tag!r} ({e})") from None
    regex = f"{_literal(prefix)}({content}){_literal(suffix)}"
    _check_sample(grammar, env, prefix, suffix, regex)
    return regex


def _check_sample(grammar: Any, env: str, prefix: str, suffix: str, regex: str) -> None:
    """The regex's own sample reply must read back, with the grammar's semantics, as valid and in the format
    (else the template the regex spells is not one the env reads: refuse rather than export it)."""
    sample = {"cell": "0", "integer": "-7", "text": "x"}[grammar.content]
    reply = prefix + sample + suffix
    m = re.search(rf"<{grammar.tag}>\s*(.*?)\s*</{grammar.tag}>", reply, re.DOTALL)
    fmt = ".*?".join(f"<{t}>.*?</{t}>" for t in grammar.format_tags)
    ok = (m is not None and m.group(1) == sample and re.search(fmt, reply, re.DOTALL) is not None
          and re.fullmatch(regex, reply) is not None)
    if not ok:
        raise _grammar_error(env, f"its reply template {reply!r} does not read back as a valid reply in the format")


def grammar_record(grammar: Any, env: str) -> dict[str, Any]:
    """What `reply_grammar.json` holds: the env, the reply regex, how to read the answer, the grammar."""
    record: dict[str, Any] = {"env": env, "regex": reply_regex(grammar, env)}
    tag = re.escape(grammar.tag)
    record["answer_regex"] = rf"<{tag}>\s*(.*?)\s*</{tag}>"
    record["content"] = grammar.content
    if grammar.content == "cell":
        record["num_cells"] = int(grammar.num_cells)
    elif grammar.content == "integer":
        record["max_digits"] = int(grammar.max_digits)
    record["tag"] = grammar.tag
    record["format_tags"] = list(grammar.format_tags)
    record["note"] = _NOTE
    return record


def write_reply_grammar(folder: str | Path, grammar: Any, env: str) -> Path:
    """Writes `reply_grammar.json` (see `grammar_record`) into `folder`; returns its path."""
    path = Path(folder) / GRAMMAR_FILE
    path.write_text(json.dumps(grammar_record(grammar, env), indent=1) + "\n")
    return path


def read_reply_grammar(folder: str | Path) -> dict[str, Any]:
    """The record `write_reply_grammar` wrote into an exported folder."""
    return json.loads((Path(folder) / GRAMMAR_FILE).read_text())


# ----------------------------------------------------------------------------------------------------------
# A plain-Python matcher for the subset (Thompson NFA, states cached)
# ----------------------------------------------------------------------------------------------------------

_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_MAX_REPEAT = 1000


class _Parser:
    """Recursive descent over the subset, building NFA states: each state is ("char", ranges, negated,
    next), ("split", [next, ...]) or ("accept",)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0
        self.states: list[list[Any]] = []

    def error(self, why: str) -> RegexSyntaxError:
        return RegexSyntaxError(f"regex {self.p!r} at {self.i}: {why} (plain regexes only: no lookarounds, "
                                "backreferences, anchors or lazy quantifiers)")

    def new(self, *state: Any) -> int:
        self.states.append(list(state))
        return len(self.states) - 1

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    # A fragment is (start state, list of (state, slot) holes to patch with the next state).
    def parse(self) -> tuple[list[list[Any]], int]:
        start, holes = self.alternation()
        if self.i != len(self.p):
            raise self.error("unbalanced ')'")
        accept = self.new("accept")
        self.patch(holes, accept)
        return self.states, start

    def patch(self, holes, target: int) -> None:
        for state, slot in holes:
            if slot is None:
                self.states[state][1].append(target)
            else:
                self.states[state][slot] = target

    def alternation(self):
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        if len(branches) == 1:
            return branches[0]
        split = self.new("split", [s for s, _ in branches])
        return split, [h for _, hs in branches for h in hs]

    def chain(self, pieces):
        """Fragments in sequence (none: the empty string)."""
        if not pieces:
            empty = self.new("split", [])
            return empty, [(empty, None)]
        start, holes = pieces[0]
        for s, hs in pieces[1:]:
            self.patch(holes, s)
            holes = hs
        return start, holes

    def concatenation(self):
        pieces = []
        while self.peek() is not None and self.peek() not in "|)":
            pieces.append(self.repetition())
        return self.chain(pieces)

    def repetition(self):
        src = self.atom_source()
        if self.peek() not in ("*", "+", "?", "{"):
            return self.build(src)
        low, high = self.quantifier()
        if self.peek() in ("?", "+"):
            raise self.error("a lazy or possessive quantifier")
        pieces = [self.build(src) for _ in range(low)]
        if high is None:
            body_start, body_holes = self.build(src)
            split = self.new("split", [body_start])
            self.patch(body_holes, split)
            pieces.append((split, [(split, None)]))
        else:
            for _ in range(high - low):
                s, hs = self.build(src)
                split = self.new("split", [s])
                pieces.append((split, hs + [(split, None)]))
        return self.chain(pieces)

    def quantifier(self) -> tuple[int, int | None]:
        ch = self.p[self.i]
        self.i += 1
        if ch == "*":
            return 0, None
        if ch == "+":
            return 1, None
        if ch == "?":
            return 0, 1
        m = re.match(r"(\d+)(,(\d*))?\}", self.p[self.i:])
        if m is None:
            raise self.error("a '{' that is no {m}, {m,} or {m,n}")
        self.i += m.end()
        low = int(m.group(1))
        high = low if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if (high is not None and high < low) or max(low, high or 0) > _MAX_REPEAT:
            raise self.error(f"repeat {{{m.group(0)}")
        return low, high

    # An atom is parsed once into a source tree and built into fresh NFA states for each copy a
    # counted repetition needs.
    def atom_source(self):
        ch = self.peek()
        if ch == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("a group other than (...) or (?:...)")
            start = self.i
            depth = 1
            # parse the group's inside as a sub-pattern (its own source string)
            while depth:
                if self.i >= len(self.p):
                    raise self.error("unbalanced '('")
                c = self.p[self.i]
                if c == "\\":
                    self.i += 2
                    continue
                if c == "[":
                    self.char_class()
                    continue
                depth += {"(": 1, ")": -1}.get(c, 0)
                self.i += 1
            return ("group", self.p[start:self.i - 1], start)
        if ch == "[":
            return ("class",) + self.char_class()
        if ch == "\\":
            return ("class",) + self.escape()
        if ch == ".":
            self.i += 1
            return ("class", [("\n", "\n")], True)
        if ch in ("^", "$"):
            raise self.error("an anchor")
        if ch in ("*", "+", "?", "{"):
            raise self.error("a quantifier with nothing to repeat")
        self.i += 1
        return ("class", [(ch, ch)], False)

    def build(self, src):
        if src[0] == "class":
            _, ranges, negated = src
            s = self.new("char", ranges, negated, None)
            return s, [(s, 3)]
        _, inner, offset = src
        sub = _Parser(inner)
        sub.states = self.states
        try:
            start, holes = sub.alternation()
        except RegexSyntaxError as e:
            raise self.error(f"in the group at {offset}: {e}") from None
        if sub.i != len(inner):
            raise self.error("unbalanced ')'")
        return start, holes

    def escape(self) -> tuple[list[tuple[str, str]], bool]:
        self.i += 1
        if self.i >= len(self.p):
            raise self.error("a trailing backslash")
        ch = self.p[self.i]
        self.i += 1
        if ch.isdigit() and ch != "0":
            raise self.error("a backreference")
        if ch in "bBAZ":
            raise self.error("an anchor")
        if ch == "d":
            return [("0", "9")], False
        if ch == "D":
            return [("0", "9")], True
        if ch in "sSwW":
            raise self.error(f"\\{ch} (spell the class out)")
        if ch in _CHAR_ESCAPES:
            c = _CHAR_ESCAPES[ch]
            return [(c, c)], False
        if ch in "xu":
            width = 2 if ch == "x" else 4
            code = self.p[self.i:self.i + width]
            if len(code) != width or not all(c in "0123456789abcdefABCDEF" for c in code):
                raise self.error(f"a \\{ch} escape without {width} hex digits")
            self.i += width
            c = chr(int(code, 16))
            return [(c, c)], False
        if ch.isalnum():
            raise self.error(f"an unknown escape \\{ch}")
        return [(ch, ch)], False

    def class_char(self) -> str:
        ch = self.p[self.i]
        if ch == "\\":
            ranges, negated = self.escape()
            if negated or len(ranges) != 1 or ranges[0][0] != ranges[0][1]:
                raise self.error("a class escape inside [...] (spell the range out)")
            return ranges[0][0]
        self.i += 1
        return ch

    def char_class(self) -> tuple[list[tuple[str, str]], bool]:
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.error("an unclosed '['")
            if self.p[self.i] == "]" and not first:
                self.i += 1
                return ranges, negated
            first = False
            if self.p[self.i] == "[":
                raise self.error("a nested '[' (escape it)")
            low = self.class_char()
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                high = self.class_char()
                if high < low:
                    raise self.error(f"a bad range {low}-{high}")
                ranges.append((low, high))
            else:
                ranges.append((low, low))


class RegexMatcher:
    """A plain regex (the subset `reply_regex` writes) as an NFA, run one character at a time.

    `start` is a state (a frozenset of NFA states; empty: dead); `step(state, text)` the state after
    `text`; `accepts(state)`; `fullmatch(text)`. Raises RegexSyntaxError for anything outside the subset."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.states, start = _Parser(pattern).parse()
        self._cache: dict[tuple[frozenset, str], frozenset] = {}
        self.start = self._closure([start])

    def _closure(self, ids) -> frozenset:
        seen: set[int] = set()
        stack = list(ids)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            if self.states[s][0] == "split":
                stack.extend(self.states[s][1])
        return frozenset(seen)

    def _char(self, state: frozenset, ch: str) -> frozenset:
        key = (state, ch)
        out = self._cache.get(key)
        if out is None:
            nxt = []
            for s in state:
                node = self.states[s]
                if node[0] == "char":
                    inside = any(lo <= ch <= hi for lo, hi in node[1])
                    if inside != node[2]:
                        nxt.append(node[3])
            out = self._cache[key] = self._closure(nxt)
        return out

    def step(self, state: frozenset, text: str) -> frozenset:
        for ch in text:
            if not state:
                break
            state = self._char(state, ch)
        return state

    def accepts(self, state: frozenset) -> bool:
        return any(self.states[s][0] == "accept" for s in state)

    def fullmatch(self, text: str) -> bool:
        return self.accepts(self.step(self.start, text))


# ----------------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------------


def _token_texts(tokenizer) -> list[str | None]:
    """Each id's text (None for special tokens, which never appear inside a reply)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    texts: list[str | None] = []
    for i in range(len(tokenizer)):
        if i in special:
            texts.append(None)
            continue
        token = tokenizer.convert_ids_to_tokens(i)
        texts.append(None if token is None else tokenizer.convert_tokens_to_string([token]))
    return texts


class RegexLogitsProcessor:
    """A `transformers` logits processor that makes `generate` write a reply fully matching `regex`, then the
    end of turn: at each step only the tokens whose text keeps the reply a prefix of a match are allowed,
    and the end-of-turn token (`tokenizer.eos_token_id`) once it is a whole match.

    The reply is what follows the prompt: `prompt_length` tokens of `input_ids` (None: the length at the
    first call, so use one processor per `generate` call). Rows that already ended are left alone. Plain
    Python: per reply-state, the allowed ids are computed once over the vocabulary and cached."""

    def __init__(self, regex: str, tokenizer, prompt_length: int | None = None):
        self.matcher = RegexMatcher(regex)
        self.eos_id = int(tokenizer.eos_token_id)
        self.texts = _token_texts(tokenizer)
        self.prompt_length = prompt_length
        self._allowed: dict[frozenset, list[int]] = {}
        self._states: dict[tuple[int, ...], frozenset | None] = {(): self.matcher.start}

    def _state(self, reply: tuple[int, ...]) -> frozenset | None:
        """The matcher's state after the reply's ids (None once the end of turn was written)."""
        if reply in self._states:
            return self._states[reply]
        parent = self._state(reply[:-1])
        token = reply[-1]
        if parent is None or token == self.eos_id:
            state = None
        else:
            text = self.texts[token] if 0 <= token < len(self.texts) else None
            state = self.matcher.step(parent, text) if text else frozenset()
        self._states[reply] = state
        return state

    def allowed_ids(self, state: frozenset) -> list[int]:
        """The ids allowed after a reply in `state`."""
        out = self._allowed.get(state)
        if out is None:
            out = [i for i, text in enumerate(self.texts) if text and self.matcher.step(state, text)]
            if self.matcher.accepts(state):
                out.append(self.eos_id)
            self._allowed[state] = out
        return out

    def __call__(self, input_ids, scores):
        """input_ids int64[B, T] (prompt then reply), scores float[B, V] -> scores with -inf where disallowed."""
        if self.prompt_length is None:
            self.prompt_length = int(input_ids.shape[1])
        keep = scores.new_zeros(scores.shape, dtype=bool)
        for row, ids in enumerate(input_ids[:, self.prompt_length:].tolist()):
            state = self._state(tuple(ids))
            if state is None:  # the row has ended: transformers pads it
                keep[row] = True
                continue
            allowed = [i for i in self.allowed_ids(state) if i < scores.shape[1]]
            if not allowed:  # a dead reply cannot happen under this processor; leave the end of turn
                allowed = [self.eos_id]
            keep[row, allowed] = True
        return scores.masked_fill(~keep, float("-inf"))
