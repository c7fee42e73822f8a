"""Decoding under a plain regular expression in `transformers`, in plain Python: no jax, no new dependency.

`RegexMatcher(pattern)` compiles the plain subset that structured-generation tools accept (literals, escapes,
character classes, groups `(...)` / `(?:...)`, alternation, `?`, `*`, `+`, `{m}`, `{m,}`, `{m,n}`) into a
Thompson NFA run one character at a time, its transitions cached; anything else (lookarounds,
backreferences, anchors, lazy quantifiers, named groups) is a RegexSyntaxError. `RegexLogitsProcessor(regex,
tokenizer)` is a `transformers` logits processor built on it: `generate` then writes a reply that fully
matches the regex, then the end of turn. `jaxrl_llm.export_grammar` writes the regex of an env's reply
grammar beside an exported model (`reply_grammar.json`).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["RegexSyntaxError", "RegexMatcher", "RegexLogitsProcessor"]


class RegexSyntaxError(ValueError):
    """A pattern outside the plain subset `RegexMatcher` (and structured-generation tools) accept."""


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
        self._first = {text[0] for text in self.texts if text}
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
            live = {ch for ch in self._first if self.matcher.step(state, ch)}  # a token starts with one of these
            out = [i for i, text in enumerate(self.texts)
                   if text and text[0] in live and self.matcher.step(state, text)]
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
