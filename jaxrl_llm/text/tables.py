"""Token tables of an env's messages: built once on the host, verified exact, rendered on device by gathers.

A user turn (the tokens from the end of one assistant reply, `<|im_end|>` included, to the start of the
next reply) is the env's slots between two chat-template pieces:

    open     "<|im_start|>user\\n" (first turn, after the system prefix) or "\\n<|im_start|>user\\n"
    slot 1 .. slot S   the env's pieces (`envs.core.MessageSpec`), one per slot, chosen by code on device
    close    "<|im_end|>\\n<|im_start|>assistant\\n" (generation prompt) or "<|im_end|>\\n" (final message)

`build_text_tables` tokenizes every piece once with the real tokenizer and VERIFIES exactness: for every
family of codes the env declares, every pair of adjacent slots and every pair of their pieces, the turn
with the two pieces in context (other slots at a default) must tokenize as a whole to the concatenation
of the pieces' tokens, after the system prefix (first turn) and after an end of turn; otherwise it
raises naming the boundary. The system prefix must equal `apply_chat_template` of the system message,
and the generation prompt must end at a boundary for the env's example replies. Rendering on device is
then gathers: S + 2 piece ids -> rows -> one output buffer by cumulative lengths (`render_turn`).

With the env's reply grammar (`tables_for_env` passes it), the tables also hold what constrained decoding
needs (`reply_template`): the grammar's fixed reply text around the content as token ids, the tokens a
content step may take, and `choice_tokens` (a cell grammar's choices, one token each). They are verified
like the pieces: after the generation prompt, prefix + content + suffix + end of turn must tokenize as a
whole to the concatenation (cell: for every choice; integer and text: for sample contents). A template that
fails does not stop the tables from being built (unconstrained decoding does not need it): the failure is
kept in `reply_error` and raised by `require_reply_template` when constrained decoding asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import MessageSpec, ReplyGrammar
from jaxrl_llm.text import grammar as reply_grammar
from jaxrl_llm.text.chat import chat_pieces, encode, encode_many, token_bytes

__all__ = ["TextTables", "build_text_tables", "tables_for_env", "render_turn", "gather_pieces", "reply_template",
           "reply_texts", "require_reply_template"]

_DATA_FIELDS = ["prefix", "piece_tokens", "piece_lengths", "open_piece", "close_piece", "slot_piece", "byte_table",
                "byte_lengths", "choice_tokens", "reply_template"]
_META_FIELDS = ["max_msg", "pad_id", "eos_id", "vocab_size", "max_token_bytes", "prefix_length", "slot_names",
                "reply_error"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA_FIELDS, meta_fields=_META_FIELDS)
@dataclasses.dataclass(frozen=True)
class TextTables:
    """Token tables of one (tokenizer, message spec, system prompt): a pytree of arrays plus static fields."""

    prefix: jax.Array  # int32[prefix_length]: bos + system message, exactly as the chat template tokenizes it
    piece_tokens: jax.Array  # int32[P, W]: every piece, padded with pad_id (row 0 is the empty piece)
    piece_lengths: jax.Array  # int32[P]
    open_piece: jax.Array  # int32[2]: piece id of the turn opening, [after a reply, first turn]
    close_piece: jax.Array  # int32[2]: [game on, final]: end of the user turn (+ generation prompt unless final)
    slot_piece: jax.Array  # int32[S, C]: piece id of code c of slot s (C = the most codes of a slot)
    byte_table: jax.Array  # uint8[vocab_size, max_token_bytes]: bytes of each token id (special: none)
    byte_lengths: jax.Array  # int32[vocab_size]
    choice_tokens: jax.Array  # int32[C]: a cell grammar's choice c as its one token (str(c)); [0] otherwise
    reply_template: Any  # text.grammar.ReplyTemplate for constrained decoding, or None (no grammar, or it failed)
    max_msg: int  # static: length of a rendered user turn buffer
    pad_id: int
    eos_id: int
    vocab_size: int
    max_token_bytes: int
    prefix_length: int
    slot_names: tuple[str, ...]
    reply_error: str = ""  # why `reply_template` is None ("" when it was built)


def _boundary_error(tokenizer, name, left, right, texts, whole, parts) -> ValueError:
    return ValueError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}, messages {name!r}: the piece boundary "
        f"{left!r} | {right!r} is not a tokenization boundary, so exact piecewise rendering is impossible: "
        f"with the pieces {texts!r} in context, the turn tokenizes as {whole} as a whole but as {parts} piece "
        "by piece. Use a tokenizer whose pre-tokenizer splits after newlines (byte-level BPE with a GPT-2 / "
        "Llama-3 style regex), or cut the env's pieces elsewhere (after a newline, before a non-space)."
    )


def build_text_tables(tokenizer, spec: MessageSpec, system_prompt: str, example_replies: Sequence[str] = (),
                      name: str = "", grammar: ReplyGrammar | None = None) -> TextTables:
    """Tokenize every piece of `spec` with `tokenizer` (host, once), verify exactness, pad into tables.

    system_prompt: the system message's text; example_replies: replies in the asked-for format (the
    generation prompt must end at a tokenization boundary before them); name: for error messages;
    grammar: the env's reply grammar, for `choice_tokens` and the constrained-decoding `reply_template`
    (None: neither; `choice_tokens` is then int32[0])."""
    from jaxrl_llm.text.tokenizer import check_tokenizer

    check_tokenizer(tokenizer)
    chat = chat_pieces(tokenizer)
    pad_id = int(tokenizer.pad_token_id)
    eos_id = int(tokenizer.eos_token_id)

    texts: list[str] = [""]
    index: dict[str, int] = {"": 0}

    def pid(text: str) -> int:
        if text not in index:
            index[text] = len(texts)
            texts.append(text)
        return index[text]

    open_piece = np.array([pid(chat["open_next"]), pid(chat["open_first"])], np.int32)
    close_piece = np.array([pid(chat["close_gen"]), pid(chat["close_final"])], np.int32)
    width = max(len(slot.pieces) for slot in spec.slots)
    slot_piece = np.zeros((len(spec.slots), width), np.int32)
    for s, slot in enumerate(spec.slots):
        slot_piece[s, : len(slot.pieces)] = [pid(t) for t in slot.pieces]

    piece_ids = encode(tokenizer, texts)
    piece_ids[0] = []

    prefix_text = chat["sys_head"] + system_prompt + chat["sys_tail"]
    prefix = encode(tokenizer, [prefix_text])[0]
    templated = tokenizer.apply_chat_template([{"role": "system", "content": system_prompt}], tokenize=True,
                                              return_dict=False)
    if list(templated) != prefix:
        raise ValueError(
            f"the chat template renders the system prompt of {name!r} differently from the sentinel layout (does "
            "it trim or rewrite message content?); the system prefix cannot be rendered exactly"
        )

    _verify(tokenizer, spec, name, texts, piece_ids, prefix_text, prefix, eos_id, open_piece, close_piece, slot_piece)
    _verify_reply_boundary(tokenizer, name, texts[int(close_piece[0])], piece_ids[int(close_piece[0])],
                           example_replies, eos_id)
    _verify_replies_kept(tokenizer, name, system_prompt, example_replies)

    piece_width = max(1, max(len(p) for p in piece_ids))
    piece_tokens = np.full((len(texts), piece_width), pad_id, np.int32)
    for i, ids in enumerate(piece_ids):
        piece_tokens[i, : len(ids)] = ids
    piece_lengths = np.array([len(p) for p in piece_ids], np.int32)
    used = [open_piece] + [slot_piece[s, : len(slot.pieces)] for s, slot in enumerate(spec.slots)] + [close_piece]
    max_msg = int(sum(piece_lengths[t].max() for t in used))

    tb = token_bytes(tokenizer)
    max_token_bytes = max(1, max(len(b) for b in tb))
    byte_table = np.zeros((len(tb), max_token_bytes), np.uint8)
    for i, b in enumerate(tb):
        byte_table[i, : len(b)] = np.frombuffer(b, np.uint8)
    byte_lengths = np.array([len(b) for b in tb], np.int32)

    choice_tokens, template, reply_error = np.zeros((0,), np.int32), None, "no reply grammar was given"
    if grammar is not None:
        gen = int(close_piece[0])
        try:
            choice_tokens, template = reply_template(tokenizer, grammar, texts[gen], piece_ids[gen], byte_lengths)
            reply_error = ""
        except ValueError as e:
            reply_error = f"messages {name!r}: {e}"
            if grammar.content == "cell":
                try:
                    choice_tokens = choice_token_ids(tokenizer, grammar)
                except ValueError:
                    pass

    return TextTables(
        prefix=jnp.asarray(np.array(prefix, np.int32)), piece_tokens=jnp.asarray(piece_tokens),
        piece_lengths=jnp.asarray(piece_lengths), open_piece=jnp.asarray(open_piece),
        close_piece=jnp.asarray(close_piece), slot_piece=jnp.asarray(slot_piece),
        byte_table=jnp.asarray(byte_table), byte_lengths=jnp.asarray(byte_lengths),
        choice_tokens=jnp.asarray(choice_tokens), reply_template=template, max_msg=max_msg, pad_id=pad_id,
        eos_id=eos_id, vocab_size=len(tb), max_token_bytes=max_token_bytes, prefix_length=len(prefix),
        slot_names=tuple(slot.name for slot in spec.slots), reply_error=reply_error,
    )


def tables_for_env(tokenizer, env: Any, params: Any = None) -> TextTables:
    """`build_text_tables` for an `envs.core.Env` with `params` (default: the env's own)."""
    params = env.params if params is None else params
    grammar = env.reply_grammar(params)
    label = f"{env.name}" + (f" ({params.prompt})" if hasattr(params, "prompt") else "")
    return build_text_tables(tokenizer, env.message_spec(params), env.system_prompt(params),
                             grammar.example_replies, label, grammar=grammar)


# ----------------------------------------------------------------------------------------------------------
# Constrained replies (host, once)
# ----------------------------------------------------------------------------------------------------------


def reply_texts(grammar: ReplyGrammar) -> tuple[str, str]:
    """The fixed text of a reply in `grammar`'s format around its content: (prefix, suffix).

    The format tags in order, each empty, with the answer tag's content in the middle; between two tags the
    whitespace the grammar's example replies put there (the first example holding `</a>` + whitespace +
    `<b>`; none if no example does). Tic-Tac-Toe: ("<think></think>\\n<move>", "</move>"); Connect Four:
    ("<think></think><move>", "</move>"); arithmetic: ("<answer>", "</answer>")."""
    tags = list(grammar.format_tags)
    if grammar.tag not in tags:
        tags.append(grammar.tag)

    def gap(a: str, b: str) -> str:
        for reply in grammar.example_replies:
            m = re.search(rf"</{re.escape(a)}>(\s*)<{re.escape(b)}>", reply)
            if m:
                return m.group(1)
        return ""

    parts: list[str] = []
    for i, t in enumerate(tags):
        if i:
            parts.append(gap(tags[i - 1], t))
        parts.append(f"<{t}>\0</{t}>" if t == grammar.tag else f"<{t}></{t}>")
    prefix, suffix = "".join(parts).split("\0")
    return prefix, suffix


def choice_token_ids(tokenizer, grammar: ReplyGrammar) -> np.ndarray:
    """A cell grammar's choices as token ids: int32[num_cells], entry c the one token of str(c).

    Raises ValueError naming the first choice that is not a single token."""
    if grammar.content != "cell":
        return np.zeros((0,), np.int32)
    if grammar.num_cells > 4096:
        raise ValueError(f"reply grammar {grammar.tag!r}: {grammar.num_cells} choices are too many for choice tokens")
    ids = encode_many(tokenizer, [str(c) for c in range(grammar.num_cells)])
    for c, one in enumerate(ids):
        if len(one) != 1:
            raise ValueError(f"reply grammar {grammar.tag!r}: choice {c} ({str(c)!r}) is not one token but {one}, so "
                             "a constrained reply cannot sample it as one decision")
    return np.array([one[0] for one in ids], np.int32)


def _one_token(tokenizer, grammar: ReplyGrammar, text: str) -> int:
    ids = encode(tokenizer, [text])[0]
    if len(ids) != 1:
        raise ValueError(f"reply grammar {grammar.tag!r}: {text!r} is not one token but {ids}")
    return ids[0]


def reply_template(tokenizer, grammar: ReplyGrammar, gen_text: str, gen_ids: Sequence[int],
                   byte_lengths: np.ndarray) -> tuple[np.ndarray, "reply_grammar.ReplyTemplate"]:
    """(choice_tokens int32[C], ReplyTemplate) of `grammar` with `tokenizer`, verified (host).

    gen_text / gen_ids: the generation prompt's text and ids (the reply follows them); byte_lengths:
    int32[V] bytes of each token (tokens without bytes, the special ones, are never free text).
    Verification: gen + prefix + content + suffix + end of turn tokenizes as a whole to gen_ids + prefix
    ids + content ids + suffix ids + [eos], for every choice of a cell grammar and for sample contents of
    the other kinds. For integers the content ids are the one-character tokens the sampler writes; a
    tokenizer that merges digits ("945" as one token) would tokenize the text differently inside the
    content: that is allowed (only the prefix and suffix must be exact), since the parser reads the
    reply's bytes, which are the same either way. Raises ValueError naming what does not tokenize."""
    eos_text, eos_id = tokenizer.eos_token, int(tokenizer.eos_token_id)
    prefix_text, suffix_text = reply_texts(grammar)
    prefix = encode(tokenizer, [prefix_text])[0] if prefix_text else []
    suffix = encode(tokenizer, [suffix_text])[0] + [eos_id]
    vocab = int(byte_lengths.shape[0])
    kind = grammar.content
    choice_tokens, minus_id = np.zeros((0,), np.int32), -1
    if kind == "cell":
        choice_tokens = choice_token_ids(tokenizer, grammar)
        sets = np.zeros((1, vocab), bool)
        sets[reply_grammar.CELL_CHOICE, choice_tokens] = True
        contents = [(str(c), [int(t)]) for c, t in enumerate(choice_tokens)]
        exact = True
    elif kind == "integer":
        digits = [_one_token(tokenizer, grammar, str(d)) for d in range(10)]
        minus_id = _one_token(tokenizer, grammar, "-")
        if suffix[0] in digits or suffix[0] == minus_id:
            raise ValueError(f"reply grammar {grammar.tag!r}: the suffix {suffix_text!r} starts with a digit token")
        sets = np.zeros((3, vocab), bool)
        sets[reply_grammar.INT_START, digits + [minus_id]] = True
        sets[reply_grammar.INT_DIGIT, digits] = True
        sets[reply_grammar.INT_DIGIT_OR_END, digits + [suffix[0]]] = True
        n = grammar.max_digits
        samples = ["0", "7", "-3", "45", "-" + "9" * n, "1234567890"[:n], "-" + "0" * n]
        contents = [(c, [digits[int(ch)] if ch != "-" else minus_id for ch in c]) for c in samples]
        exact = False
    else:
        sets = (np.asarray(byte_lengths) > 0)[None, :].copy()
        sets[:, eos_id] = False
        contents = [("yes", encode(tokenizer, ["yes"])[0])]
        exact = True
    wholes = encode_many(tokenizer, [gen_text + prefix_text + c + suffix_text + eos_text for c, _ in contents])
    head, tail = list(gen_ids) + prefix, suffix
    for (c, ids), got in zip(contents, wholes):
        want = head + ids + tail
        ok = got == want if exact else (got[: len(head)] == head and got[len(got) - len(tail):] == tail)
        if not ok:
            raise ValueError(
                f"reply grammar {grammar.tag!r}: the constrained reply {prefix_text + c + suffix_text!r} after the "
                f"generation prompt tokenizes as {got} as a whole but as {want} piece by piece (prefix, content, "
                "suffix): its fixed text is not cut at tokenization boundaries")
    template = reply_grammar.ReplyTemplate(
        prefix=jnp.asarray(np.array(prefix, np.int32).reshape(-1)), suffix=jnp.asarray(np.array(suffix, np.int32)),
        sets=jnp.asarray(sets), kind=kind, max_digits=int(grammar.max_digits), minus_id=int(minus_id))
    return choice_tokens, template


def require_reply_template(tables: TextTables) -> "reply_grammar.ReplyTemplate":
    """The tables' reply template for constrained decoding, or ValueError saying why there is none."""
    if tables.reply_template is None:
        raise ValueError(f"constrained replies are not available: {tables.reply_error or 'no reply template'}")
    return tables.reply_template


def _verify(tokenizer, spec: MessageSpec, name, texts, piece_ids, prefix_text, prefix, eos_id, open_piece,
            close_piece, slot_piece) -> None:
    """Every family, every adjacent pair of slots, every pair of their pieces, in a full user turn: whole == pieces."""
    eos_text = tokenizer.eos_token
    slot_names = ("open",) + tuple(slot.name for slot in spec.slots) + ("close",)
    by_boundary: dict[tuple[str, str], list[list[int]]] = {}
    for family in spec.families:
        values = [sorted({int(open_piece[0]), int(open_piece[1])})]
        for s, (slot, codes) in enumerate(zip(spec.slots, family.codes)):
            codes = range(len(slot.pieces)) if codes is None else codes
            values.append(sorted({int(slot_piece[s, c]) for c in codes}))
        values.append([int(close_piece[int(family.final)])])
        default = [v[0] for v in values]
        for i in range(len(slot_names) - 1):
            for a in values[i]:
                for b in values[i + 1]:
                    ids = list(default)
                    ids[i], ids[i + 1] = a, b
                    by_boundary.setdefault((slot_names[i], slot_names[i + 1]), []).append(ids)
    distinct_open = int(open_piece[0]) != int(open_piece[1])
    for group in by_boundary.values():
        whole_texts, expected = [], []
        for ids in group:
            first = ids[0] == int(open_piece[1]) and distinct_open
            head_text, head_ids = (prefix_text, list(prefix)) if first else (eos_text, [eos_id])
            whole_texts.append(head_text + "".join(texts[i] for i in ids))
            expected.append(head_ids + [t for i in ids for t in piece_ids[i]])
        for ids, got, want in zip(group, encode_many(tokenizer, whole_texts), expected):
            if got != want:
                first = ids[0] == int(open_piece[1]) and distinct_open
                names = ("system prefix" if first else "eos",) + slot_names
                parts = [list(prefix) if first else [eos_id]] + [piece_ids[i] for i in ids]
                strings = [prefix_text if first else eos_text] + [texts[i] for i in ids]
                # the first differing token lies in piece p: the merge crosses its start or its end
                d = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
                ends = np.cumsum([len(q) for q in parts])
                p = int(min(np.searchsorted(ends, d, side="right"), len(parts) - 1))
                start = int(ends[p] - len(parts[p]))
                a = p - 1 if (d == start and p > 0) or p == len(parts) - 1 else p
                a = next((q for q in range(a, -1, -1) if strings[q]), a)  # skip empty pieces
                b = next((q for q in range(a + 1, len(parts)) if strings[q]), min(a + 1, len(parts) - 1))
                raise _boundary_error(tokenizer, name, names[a], names[b], (strings[a], strings[b]), got, want)


def _verify_reply_boundary(tokenizer, name, gen_text, gen_ids, replies, eos_id) -> None:
    """The generation prompt must end at a tokenization boundary for replies in the asked-for format."""
    replies = list(replies)
    if not replies:
        return
    eos_text = tokenizer.eos_token
    for reply, got in zip(replies, encode(tokenizer, [gen_text + r + eos_text for r in replies])):
        want = gen_ids + encode(tokenizer, [reply])[0] + [eos_id]
        if got != want:
            raise _boundary_error(tokenizer, name, "close", "reply", [gen_text, reply, eos_text], got, want)


def _verify_replies_kept(tokenizer, name, system_prompt, replies) -> None:
    """A reply of an earlier turn must stay in the conversation as the model wrote it (a rollout appends the
    sampled tokens; SFT renders its rows with the template): a template that rewrites it is refused."""
    for reply in replies:
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "USERSENTINEL"},
                    {"role": "assistant", "content": reply}, {"role": "user", "content": "SECONDUSERSENTINEL"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if reply + tokenizer.eos_token not in text:
            raise ValueError(
                f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} rewrites the reply {reply!r} of "
                f"{name!r} in an earlier turn (it renders {text!r}), so the conversations of rollouts, which keep the "
                "tokens the model sampled, would not be the template's. Qwen3's released template does this (it "
                "moves <think>...</think> out of earlier turns): use a template that writes replies as they are, "
                "Qwen's ChatML: `[tokenizer] chat_template = \"chatml\"` in a preset, or "
                "tok.chat_template = jaxrl_llm.text.tokenizer.CHATML_TEMPLATE")


# ----------------------------------------------------------------------------------------------------------
# On-device rendering
# ----------------------------------------------------------------------------------------------------------


def render_turn(tables: TextTables, codes: jax.Array, first: Any, final: Any) -> tuple[jax.Array, jax.Array]:
    """Tokens of one user turn, from after the previous reply's `<|im_end|>` to the start of the next reply.

    codes int32[S]: the env's piece code per slot (`env.message_codes`); first bool (the turn follows the
    system prefix); final bool (the game is over: no generation prompt). Returns (tokens int32[max_msg]
    padded with pad_id, length int32). Jittable and vmappable."""
    codes = jnp.asarray(codes, jnp.int32).reshape(len(tables.slot_names))
    slots = jnp.arange(len(tables.slot_names), dtype=jnp.int32)
    ids = jnp.concatenate([
        tables.open_piece[jnp.asarray(first).astype(jnp.int32)][None],
        tables.slot_piece[slots, codes],
        tables.close_piece[jnp.asarray(final).astype(jnp.int32)][None],
    ])
    return gather_pieces(tables, ids)


def gather_pieces(tables: TextTables, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Concatenate the table rows `ids` (int32[S]) into (tokens int32[max_msg], length int32)."""
    rows = tables.piece_tokens[ids]  # [S, W]
    lengths = tables.piece_lengths[ids]
    ends = jnp.cumsum(lengths)
    starts = ends - lengths
    pos = jnp.arange(tables.max_msg, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(ends, pos, side="right"), 0, ids.shape[0] - 1)
    offset = jnp.clip(pos - starts[slot], 0, rows.shape[1] - 1)
    total = ends[-1]
    tokens = jnp.where(pos < total, rows[slot, offset], tables.pad_id)
    return tokens.astype(jnp.int32), total.astype(jnp.int32)
