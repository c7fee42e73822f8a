"""An env's reply grammar as a regular expression, written beside an exported model.

A model trained with constrained replies (`[sampling] constrained = true`) has only ever written its replies
as the constrained sampler writes them: the grammar's fixed text (`text.tables.reply_texts`, e.g.
`<think></think>\\n<move>`, then `</move>`) around a content the sampler restricts (a cell: one of
`str(0)` .. `str(num_cells - 1)`; an integer: `-?[0-9]{1,max_digits}`; text: anything up to the closing
tag). `reply_regex(grammar)` spells exactly that language as a plain regular expression (literals, character
classes, plain groups, alternation, `?`, `*`, `{m,n}`; no lookarounds, backreferences, anchors, lazy
quantifiers or `(?...)` groups), the subset that structured-generation tools accept (vLLM's guided regex,
outlines).
Group 1 of a full match is the content, i.e. the answer. Every reply it matches parses, with the env's own
parser (`text.grammar`), as found, valid and in the format, with that content.

`jaxrl-llm export` writes `reply_grammar.json` ({"env", "regex", "answer_regex", "content", "note", ...},
`grammar_record`) beside the weights; `GrammarRegexError` (an EnvError) refuses a grammar with no such
regex. `jaxrl_llm.regex_decoding.RegexLogitsProcessor(regex, tokenizer)` (re-exported here) enforces the
regex in `transformers`' `generate` with plain Python.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jaxrl_base.errors import EnvError
from jaxrl_llm.regex_decoding import RegexLogitsProcessor, RegexMatcher, RegexSyntaxError  # noqa: F401 (re-exported)

__all__ = ["GRAMMAR_FILE", "GrammarRegexError", "RegexSyntaxError", "content_regex", "reply_regex",
           "grammar_record", "write_reply_grammar", "read_reply_grammar", "RegexMatcher", "RegexLogitsProcessor"]

GRAMMAR_FILE = "reply_grammar.json"  # written next to an exported HF checkpoint

_NOTE = ("The model was trained with constrained replies: decode it with this regular expression enforced "
         "(vLLM guided_regex / outlines, or jaxrl_llm.regex_decoding.RegexLogitsProcessor in "
         "transformers), or it may write replies the env cannot read. Group 1 of a full match is the answer; "
         "answer_regex (Python re.search, DOTALL) reads it from a free reply as the env does.")


class GrammarRegexError(EnvError):
    """An env's reply grammar that cannot be spelled as a plain regular expression (names the env and why)."""


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
        alts.append(f"{_literal(rest[:j])}([^{_class_char(rest[j])}{_class_char(head)}]{other}*)?")
    return f"{other}*({_literal(head)}({'|'.join(alts)}))*"


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
