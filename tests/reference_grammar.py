"""An independent host-side implementation of the reply-grammar semantics, with Python's `re`.

Written from the semantics alone (the docstring of `jaxrl_llm.text.grammar` states them; `envs.core.
ReplyGrammar` holds the settings), without importing jaxrl_llm, so tests can compare the on-device parser
against it. `grammar` is anything with the attributes tag, content ("cell", "integer" or "text"),
num_cells, max_digits and format_tags.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

INTEGER_RE = re.compile(r"([+-]?)([0-9]+)")


class Parsed(NamedTuple):
    """What a reply says under a grammar (the fields of envs.core.ParsedReply, as Python values)."""

    found: bool
    valid: bool
    value: int
    format_ok: bool


@functools.lru_cache(maxsize=None)
def answer_re(tag: str) -> re.Pattern:
    """`<tag>\\s*(.*?)\\s*</tag>` (DOTALL)."""
    t = re.escape(tag)
    return re.compile(rf"<{t}>\s*(.*?)\s*</{t}>", re.DOTALL)


@functools.lru_cache(maxsize=None)
def format_re(tags: tuple[str, ...]) -> re.Pattern:
    """`<t1>.*?</t1>.*?<t2>.*?</t2>...` (DOTALL)."""
    return re.compile(".*?".join(f"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags), re.DOTALL)


@functools.lru_cache(maxsize=8)
def cell_strings(num_cells: int) -> frozenset[str]:
    """{str(i) for i in range(num_cells)}."""
    return frozenset(str(i) for i in range(num_cells))


def content_value(grammar, content: str) -> tuple[bool, int]:
    """(valid, value) of the stripped tag content under the grammar's content kind."""
    if grammar.content == "cell":
        if content in cell_strings(grammar.num_cells):
            return True, int(content)
        return False, 0
    if grammar.content == "integer":
        m = INTEGER_RE.fullmatch(content)
        if m is not None and len(m.group(2)) <= grammar.max_digits:
            return True, int(content)
        return False, 0
    if grammar.content == "text":
        return True, 0
    raise ValueError(f"unknown content kind {grammar.content!r}")


def parse_text(grammar, text: str) -> Parsed:
    """Parse a reply's text."""
    m = answer_re(grammar.tag).search(text)
    fmt = format_re(tuple(grammar.format_tags)).search(text) is not None
    if m is None:
        return Parsed(False, False, 0, fmt)
    valid, value = content_value(grammar, m.group(1).strip())
    return Parsed(True, valid, value if valid else 0, fmt)


def parse_bytes(grammar, data: bytes) -> Parsed:
    """Parse a reply's bytes (decoded as UTF-8 with errors='replace')."""
    return parse_text(grammar, bytes(data).decode("utf-8", errors="replace"))
