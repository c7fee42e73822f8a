"""The text bridge: prompt presets, token tables, on-device rendering and parsing.

Rendering. Every environment message is a concatenation of pieces drawn from finite sets. A user turn (the
tokens between the end of one assistant reply, `<|im_end|>` included, and the start of the next reply) is
eight slots, each one row of a padded piece table:

    open    "<|im_start|>user\\n" (first turn, after the system prefix) or "\\n<|im_start|>user\\n"
    status  the status line with its `{k}` + the status/board separator            (9 statuses x 9 k)
    row0    "a | b | c" + "\\n---------\\n"                                          (27 values)
    row1    "d | e | f" + "\\n---------\\n"                                          (27 values)
    row2    "g | h | i" + the newlines that follow the board (none when final)     (27 values x 2)
    free    "Available positions: [..]" + the newlines that follow it (empty when final)   (512 masks)
    turn    "Your turn." (empty when final)
    close   "<|im_end|>\\n<|im_start|>assistant\\n" (generation prompt) or "<|im_end|>\\n" (final status)

The chat-template pieces (open, close, the system prefix) are cut out of the tokenizer's own chat template
rendered with sentinel messages. Text pieces are cut as lines: each piece ends with the run of newlines after
it, so every cut lies after a newline and before a non-space character, where byte-level pre-tokenizers split
(GPT-2's regex, Llama-3 style regexes, LFM2's). `build_text_tables` VERIFIES exactness: for every pair of
adjacent slots and every pair of their values, the message with the two values in context (other slots at a
default) must tokenize to the concatenation of the pieces' tokens; otherwise it raises naming the boundary.
Rendering on device is then gathers: 8 piece ids -> rows -> one output buffer by cumulative lengths.

Parsing. A `[vocab, max_bytes]` uint8 table turns token ids into bytes (special tokens, and ids outside the
tokenizer, are zero bytes). A byte automaton scanned with `lax.scan` reproduces, exactly, Python's `re` on
`bytes.decode("utf-8", errors="replace")` of the reply:
    move   : first `re.search(r"<move>\\s*(.*?)\\s*</move>", text, re.DOTALL)`, `.group(1).strip()`;
             -1 no match, d if the content is exactly str(d) for d in 0..8, else 9 (INVALID_MOVE).
    format : `re.search(r"<think>.*?</think>.*?<move>.*?</move>", text, re.DOTALL) is not None`
             (the reference environment uses `.search`, so text before `<think>` is allowed).
Why a byte automaton is exact: the tags are ASCII and Python's UTF-8 decoder (errors="replace") never
swallows an ASCII byte, so tags match in bytes iff they match in text; `\\s` and `str.strip()` are
`str.isspace()`, whose characters are ASCII bytes or fixed multi-byte sequences starting with a lead byte
(C2, E1, E2, E3), which always start a fresh character, so they are recognised by a small byte trie; any
other character, U+FFFD from a broken sequence included, makes the tag content "not a single digit".
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Status ids (docs/CONTRACTS.md, envs.tictactoe). Kept here as plain ints: this module does not import envs.
STATUS_START_MODEL_FIRST = 0
STATUS_START_OPP_FIRST = 1
STATUS_OPP_MOVED = 2
STATUS_INVALID = 3
STATUS_NO_MOVE = 4
STATUS_WIN = 5
STATUS_DRAW = 6
STATUS_LOSS = 7
STATUS_OPP_DRAW = 8
NUM_STATUS = 9
FIRST_FINAL_STATUS = STATUS_WIN  # statuses >= this end the game: message without free cells / "Your turn."
NO_MOVE = -1
INVALID_MOVE = 9


# ----------------------------------------------------------------------------------------------------------
# Prompt presets (data)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptPreset:
    """The strings of one prompt style. `{board}` in the system prompt is the empty board; `{k}` a cell."""

    name: str
    system_prompt: str
    status_start_model_first: str = "Game started. You are X."
    status_start_opp_first: str = "Game started. Opponent (O) played at position {k}."
    status_opp_moved: str = "Opponent (O) played at position {k}."
    status_invalid: str = "Invalid move."
    status_no_move: str = "Please provide a move inside <move>...</move> tags."
    status_win: str = "You win!"
    status_draw: str = "It's a draw!"
    status_loss: str = "Opponent (O) played at position {k}. You lose!"
    status_opp_draw: str = "Opponent (O) played at position {k}. It's a draw!"
    # Message layout: {status}{status_board_sep}{board}[{board_free_sep}{free_prefix}{free}{free_turn_sep}{turn}]
    status_board_sep: str = "\n\n"
    board_free_sep: str = "\n\n"
    free_prefix: str = "Available positions: "
    free_turn_sep: str = "\n\n"
    your_turn: str = "Your turn."
    # Board: a cell shows X, O or its index; cells joined by cell_sep, rows by row_sep.
    cell_sep: str = " | "
    row_sep: str = "\n---------\n"
    x_mark: str = "X"
    o_mark: str = "O"

    def status_text(self, status: int, k: int) -> str:
        """The status line for status id `status` and opponent move `k`."""
        templates = (
            self.status_start_model_first,
            self.status_start_opp_first,
            self.status_opp_moved,
            self.status_invalid,
            self.status_no_move,
            self.status_win,
            self.status_draw,
            self.status_loss,
            self.status_opp_draw,
        )
        if not 0 <= int(status) < NUM_STATUS:
            raise ValueError(f"status id {status} out of range 0..{NUM_STATUS - 1}")
        return templates[int(status)].replace("{k}", str(int(k)))


_REFERENCE_SYSTEM = (
    "You are playing a game of Tic-Tac-Toe as X.\n"
    "Your opponent will play as O.\n"
    "\n"
    "Initial board:\n"
    "{board}\n"
    "\n"
    "Your objective is to achieve three X in a row (horizontally, vertically, or diagonally) before the "
    "opponent does.\n"
    "You can only choose one position each turn, and it must be an empty square.\n"
    "\n"
    "You may include a short reasoning process inside <think>...</think> tags.\n"
    "Your final answer must include the position you choose inside <move>...</move> tags.\n"
)

_COMPACT_SYSTEM = (
    "Tic-Tac-Toe. You are X, the opponent is O. Cells:\n"
    "{board}\n"
    "Reply with <think>...</think> then <move>cell</move>.\n"
)

_TINY_SYSTEM = "Tic-Tac-Toe. You are X. Reply <think></think><move>cell</move>.\n{board}\n"

# `tiny`: the shortest messages, for models trained from scratch (a game is about half the tokens of
# `compact`). A board is three 3-character rows (`XO2`, one token a cell with the project tokenizer).
_TINY = PromptPreset(
    name="tiny", system_prompt=_TINY_SYSTEM,
    status_start_model_first="You start.",
    status_start_opp_first="O played {k}.",
    status_opp_moved="O played {k}.",
    status_invalid="Invalid move.",
    status_no_move="No <move> tag.",
    status_win="You win!",
    status_draw="Draw!",
    status_loss="O played {k}. You lose!",
    status_opp_draw="O played {k}. Draw!",
    status_board_sep="\n", board_free_sep="\n", free_prefix="Free: ", free_turn_sep="\n",
    your_turn="Your move.", cell_sep="", row_sep="\n",
)

PRESETS: dict[str, PromptPreset] = {
    "reference": PromptPreset(name="reference", system_prompt=_REFERENCE_SYSTEM),
    "compact": PromptPreset(name="compact", system_prompt=_COMPACT_SYSTEM),
    "tiny": _TINY,
}


# ----------------------------------------------------------------------------------------------------------
# Host rendering
# ----------------------------------------------------------------------------------------------------------


def _cell_text(preset: PromptPreset, index: int, value: int) -> str:
    return str(index) if value == 0 else (preset.x_mark if value == 1 else preset.o_mark)


def _row_text(preset: PromptPreset, row: int, values: Sequence[int]) -> str:
    return preset.cell_sep.join(_cell_text(preset, 3 * row + c, int(values[c])) for c in range(3))


def _row_values(code: int) -> tuple[int, int, int]:
    """Base-3 row code (cell c has weight 3**c) -> the three cell values."""
    return (code % 3, (code // 3) % 3, (code // 9) % 3)


def _free_text(mask: int) -> str:
    """Free-cell bitmask (bit i: cell i empty) -> the Python-list text, e.g. `[0, 1, 3]`."""
    return "[" + ", ".join(str(i) for i in range(9) if mask >> i & 1) + "]"


def _split_leading_ws(s: str) -> tuple[str, str]:
    n = len(s) - len(s.lstrip())
    return s[:n], s[n:]


def _status_piece_text(preset: PromptPreset, status: int, k: int) -> str:
    return preset.status_text(status, k) + preset.status_board_sep


def _row_piece_text(preset: PromptPreset, row: int, code: int, final: bool) -> str:
    text = _row_text(preset, row, _row_values(code))
    if row < 2:
        return text + preset.row_sep
    if final:
        return text
    lead, _ = _split_leading_ws(preset.board_free_sep + preset.free_prefix)
    return text + lead


def _free_piece_text(preset: PromptPreset, mask: int, final: bool) -> str:
    if final:
        return ""
    _, rest = _split_leading_ws(preset.board_free_sep + preset.free_prefix)
    lead, _ = _split_leading_ws(preset.free_turn_sep + preset.your_turn)
    return rest + _free_text(mask) + lead


def _turn_piece_text(preset: PromptPreset, final: bool) -> str:
    return "" if final else _split_leading_ws(preset.free_turn_sep + preset.your_turn)[1]


def _board_codes(board: Sequence[int]) -> tuple[list[int], int]:
    cells = [int(v) for v in np.asarray(board).reshape(-1)]
    if len(cells) != 9 or any(v not in (0, 1, 2) for v in cells):
        raise ValueError(f"board must be 9 cells of 0 (empty), 1 (X), 2 (O); got {cells}")
    rows = [cells[3 * r] + 3 * cells[3 * r + 1] + 9 * cells[3 * r + 2] for r in range(3)]
    mask = sum(1 << i for i in range(9) if cells[i] == 0)
    return rows, mask


def _message_pieces(preset: PromptPreset, board: Sequence[int], status: int, k: int) -> list[str]:
    """The text pieces (status, row0, row1, row2, free, turn) of one environment message."""
    rows, mask = _board_codes(board)
    final = int(status) >= FIRST_FINAL_STATUS
    return [
        _status_piece_text(preset, status, max(int(k), 0)),
        *(_row_piece_text(preset, r, rows[r], final) for r in range(3)),
        _free_piece_text(preset, mask, final),
        _turn_piece_text(preset, final),
    ]


def render_board(preset: PromptPreset, board: Sequence[int]) -> str:
    """The board as text: rows `a | b | c` separated by `---------` (empty cells show their index)."""
    rows, _ = _board_codes(board)
    return preset.row_sep.join(_row_text(preset, r, _row_values(rows[r])) for r in range(3))


def render_message(preset: PromptPreset, board: Sequence[int], status: int, last_opponent_move: int) -> str:
    """The environment message for a state: `{status}\\n\\n{board}` (+ free cells and `Your turn.` unless final)."""
    return "".join(_message_pieces(preset, board, status, last_opponent_move))


def system_prompt(preset: PromptPreset) -> str:
    """The system prompt with the empty board filled in."""
    return preset.system_prompt.replace("{board}", render_board(preset, [0] * 9))


# ----------------------------------------------------------------------------------------------------------
# Token tables
# ----------------------------------------------------------------------------------------------------------

_DATA_FIELDS = [
    "prefix",
    "piece_tokens",
    "piece_lengths",
    "open_piece",
    "status_piece",
    "row_piece",
    "free_piece",
    "turn_piece",
    "close_piece",
    "byte_table",
    "byte_lengths",
]
_META_FIELDS = ["max_msg", "pad_id", "eos_id", "vocab_size", "max_token_bytes", "prefix_length"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA_FIELDS, meta_fields=_META_FIELDS)
@dataclasses.dataclass(frozen=True)
class TextTables:
    """Token tables of one (tokenizer, preset): a pytree of arrays plus static ints."""

    prefix: jax.Array  # int32[prefix_length]: bos + system message, exactly as the chat template tokenizes it
    piece_tokens: jax.Array  # int32[P, W]: every piece, padded with pad_id (row 0 is the empty piece)
    piece_lengths: jax.Array  # int32[P]
    open_piece: jax.Array  # int32[2]: piece id of the turn opening, [after a reply, first turn]
    status_piece: jax.Array  # int32[NUM_STATUS, 9]: [status, k] (k = last opponent move, -1 read as 0)
    row_piece: jax.Array  # int32[3, 2, 27]: [row, final, base-3 row code]
    free_piece: jax.Array  # int32[2, 512]: [final, free-cell bitmask]
    turn_piece: jax.Array  # int32[2]: [final]
    close_piece: jax.Array  # int32[2]: [final]: end of the user message (+ generation prompt unless final)
    byte_table: jax.Array  # uint8[vocab_size, max_token_bytes]: bytes of each token id (special: none)
    byte_lengths: jax.Array  # int32[vocab_size]
    max_msg: int  # static: length of a rendered user turn buffer
    pad_id: int
    eos_id: int
    vocab_size: int
    max_token_bytes: int
    prefix_length: int


SLOT_NAMES = ("open", "status", "row0", "row1", "row2", "free", "turn", "close")


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(text, add_special_tokens=False)` gives them."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Like _encode, through the Rust backend directly when there is one (the bulk of the verification)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return _encode(tokenizer, texts)
    fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in fast(texts, add_special_tokens=False)]


def _chat_pieces(tokenizer) -> dict[str, str]:
    """Cut the chat template into the pieces around messages (rendered with sentinel contents)."""
    s, u, a, u2 = "SYSTEMSENTINEL", "USERSENTINEL", "REPLYSENTINEL", "SECONDUSERSENTINEL"
    eos = tokenizer.eos_token

    def render(messages, gen):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    sys_msg = {"role": "system", "content": s}
    only_sys = render([sys_msg], False)
    one = render([sys_msg, {"role": "user", "content": u}], True)
    one_final = render([sys_msg, {"role": "user", "content": u}], False)
    two = render(
        [sys_msg, {"role": "user", "content": u}, {"role": "assistant", "content": a}, {"role": "user", "content": u2}],
        True,
    )

    def fail(what):
        raise ValueError(
            f"chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not have the layout the text bridge "
            f"renders ({what}); expected ChatML like LFM2: <bos><|im_start|>system\\n...<|im_end|>\\n"
            "<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n{reply}<|im_end|>\\n..."
        )

    if only_sys.count(s) != 1 or not one.startswith(only_sys) or not one_final.startswith(only_sys):
        fail("the system prefix is not a prefix of the conversation")
    pre_sys, post_sys = only_sys.split(s)
    rest = one[len(only_sys):]
    if rest.count(u) != 1:
        fail("user content not found")
    open_first, close_gen = rest.split(u)
    rest_f = one_final[len(only_sys):]
    if rest_f.count(u) != 1 or rest_f.split(u)[0] != open_first:
        fail("final user turn differs")
    close_final = rest_f.split(u)[1]
    if not close_gen.startswith(close_final):
        fail("the generation prompt does not follow the end of the user message")
    expected_head = only_sys + open_first + u + close_gen + a
    if not two.startswith(expected_head) or two.count(u2) != 1:
        fail("an assistant reply is not written verbatim right after the generation prompt")
    between, tail = two[len(expected_head):].split(u2)
    if not between.startswith(eos):
        fail(f"an assistant reply is not closed by the eos token {eos!r}")
    open_next = between[len(eos):]
    if tail != close_gen:
        fail("the second user turn is closed differently from the first")
    return dict(
        sys_head=pre_sys,
        sys_tail=post_sys,
        open_first=open_first,
        open_next=open_next,
        close_gen=close_gen,
        close_final=close_final,
    )


@functools.lru_cache(maxsize=1)
def _ws_trie() -> np.ndarray:
    """Byte trie of the UTF-8 encodings of str.isspace() characters: int16[nodes, 256].

    Entry -1: the byte cannot continue a whitespace character; 0: it completes one (back to the root);
    n > 0: a whitespace character is pending at node n. Row 0 is the root."""
    seqs = [chr(c).encode("utf-8") for c in range(0x110000) if chr(c).isspace()]
    nodes: dict[bytes, int] = {b"": 0}
    for seq in seqs:
        for i in range(1, len(seq)):
            nodes.setdefault(seq[:i], len(nodes))
    table = np.full((len(nodes), 256), -1, np.int16)
    for seq in seqs:
        for i in range(len(seq)):
            table[nodes[seq[:i]], seq[i]] = 0 if i == len(seq) - 1 else nodes[seq[: i + 1]]
    return table


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode_inverse() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable character -> byte (the mapping ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(tokenizer) -> str:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - a slow tokenizer has no backend
        return "unknown"
    kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        return "sentencepiece"
    return "unknown"


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes of every token id 0..len(tokenizer)-1 (special tokens: b"", unknown ids: b"")."""
    size = len(tokenizer)
    out = [b""] * size
    kind = _decoder_kind(tokenizer)
    inv = _bytes_to_unicode_inverse()
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    for token, i in tokenizer.get_vocab().items():
        if i >= size or i < 0:
            continue
        if i in special_ids:
            out[i] = b""
        elif i in added:
            out[i] = added[i].content.encode("utf-8")
        elif kind == "bytelevel":
            try:
                out[i] = bytes(inv[ch] for ch in token)
            except KeyError:
                out[i] = token.encode("utf-8")
        elif kind == "sentencepiece" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[i] = bytes([int(token[3:5], 16)])
        else:
            out[i] = token.replace("\u2581", " ").encode("utf-8")
    return out


def _boundary_error(tokenizer, preset, left, right, texts, whole, parts) -> ValueError:
    return ValueError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}, preset {preset.name!r}: the piece boundary "
        f"{left!r} | {right!r} is not a tokenization boundary, so exact piecewise rendering is impossible: "
        f"with the pieces {texts!r} in context, the turn tokenizes as {whole} as a whole but as {parts} piece "
        "by piece. Use a tokenizer whose "
        "pre-tokenizer splits after newlines (byte-level BPE with a GPT-2 / Llama-3 style regex), or change the "
        "preset's separators."
    )


def build_text_tables(tokenizer, preset: PromptPreset) -> TextTables:
    """Tokenize every piece of `preset`'s messages with `tokenizer` (host, once) and verify exactness."""
    from jaxrl_llm.tokenizer import check_tokenizer

    check_tokenizer(tokenizer)
    chat = _chat_pieces(tokenizer)
    pad_id = int(tokenizer.pad_token_id)
    eos_id = int(tokenizer.eos_token_id)

    # -- collect pieces ------------------------------------------------------------------------------------
    texts: list[str] = [""]
    index: dict[str, int] = {"": 0}

    def pid(text: str) -> int:
        if text not in index:
            index[text] = len(texts)
            texts.append(text)
        return index[text]

    open_piece = np.array([pid(chat["open_next"]), pid(chat["open_first"])], np.int32)
    close_piece = np.array([pid(chat["close_gen"]), pid(chat["close_final"])], np.int32)
    status_piece = np.array(
        [[pid(_status_piece_text(preset, s, k)) for k in range(9)] for s in range(NUM_STATUS)], np.int32
    )
    row_piece = np.array(
        [[[pid(_row_piece_text(preset, r, c, bool(f))) for c in range(27)] for f in range(2)] for r in range(3)],
        np.int32,
    )
    free_piece = np.array([[pid(_free_piece_text(preset, m, bool(f))) for m in range(512)] for f in range(2)], np.int32)
    turn_piece = np.array([pid(_turn_piece_text(preset, bool(f))) for f in range(2)], np.int32)

    piece_ids = _encode(tokenizer, texts)
    piece_ids[0] = []

    prefix_text = chat["sys_head"] + system_prompt(preset) + chat["sys_tail"]
    prefix = _encode(tokenizer, [prefix_text])[0]
    templated = tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt(preset)}], tokenize=True, return_dict=False
    )
    if list(templated) != prefix:
        raise ValueError(
            f"the chat template renders preset {preset.name!r}'s system prompt differently from the sentinel "
            "layout (does it trim or rewrite message content?); the system prefix cannot be rendered exactly"
        )

    # -- verify exactness ----------------------------------------------------------------------------------
    _verify(tokenizer, preset, texts, piece_ids, prefix_text, prefix, eos_id,
            open_piece, status_piece, row_piece, free_piece, turn_piece, close_piece)

    # -- pad -----------------------------------------------------------------------------------------------
    width = max(1, max(len(p) for p in piece_ids))
    piece_tokens = np.full((len(texts), width), pad_id, np.int32)
    for i, ids in enumerate(piece_ids):
        piece_tokens[i, : len(ids)] = ids
    piece_lengths = np.array([len(p) for p in piece_ids], np.int32)
    slot_tables = (open_piece, status_piece, row_piece[0], row_piece[1], row_piece[2], free_piece, turn_piece,
                   close_piece)
    max_msg = int(sum(piece_lengths[t.reshape(-1)].max() for t in slot_tables))

    tb = token_bytes(tokenizer)
    max_token_bytes = max(1, max(len(b) for b in tb))
    byte_table = np.zeros((len(tb), max_token_bytes), np.uint8)
    for i, b in enumerate(tb):
        byte_table[i, : len(b)] = np.frombuffer(b, np.uint8)
    byte_lengths = np.array([len(b) for b in tb], np.int32)

    return TextTables(
        prefix=jnp.asarray(np.array(prefix, np.int32)),
        piece_tokens=jnp.asarray(piece_tokens),
        piece_lengths=jnp.asarray(piece_lengths),
        open_piece=jnp.asarray(open_piece),
        status_piece=jnp.asarray(status_piece),
        row_piece=jnp.asarray(row_piece),
        free_piece=jnp.asarray(free_piece),
        turn_piece=jnp.asarray(turn_piece),
        close_piece=jnp.asarray(close_piece),
        byte_table=jnp.asarray(byte_table),
        byte_lengths=jnp.asarray(byte_lengths),
        max_msg=max_msg,
        pad_id=pad_id,
        eos_id=eos_id,
        vocab_size=len(tb),
        max_token_bytes=max_token_bytes,
        prefix_length=len(prefix),
    )


def _verify(tokenizer, preset, texts, piece_ids, prefix_text, prefix, eos_id,
            open_piece, status_piece, row_piece, free_piece, turn_piece, close_piece) -> None:
    """Every adjacent pair of slots, every pair of their values, in a full user turn: whole == pieces."""
    eos_text = tokenizer.eos_token
    cases: list[tuple[str, str, list[int]]] = []  # (left slot, right slot, piece ids of the 8 slots)
    for final in (0, 1):
        statuses = range(FIRST_FINAL_STATUS, NUM_STATUS) if final else range(FIRST_FINAL_STATUS)
        values = [
            sorted({int(open_piece[0]), int(open_piece[1])}),
            sorted({int(status_piece[s, k]) for s in statuses for k in range(9)}),
            sorted(set(row_piece[0, final].tolist())),
            sorted(set(row_piece[1, final].tolist())),
            sorted(set(row_piece[2, final].tolist())),
            sorted(set(free_piece[final].tolist())),
            [int(turn_piece[final])],
            [int(close_piece[final])],
        ]
        default = [v[0] for v in values]
        for i in range(len(SLOT_NAMES) - 1):
            for a in values[i]:
                for b in values[i + 1]:
                    ids = list(default)
                    ids[i], ids[i + 1] = a, b
                    cases.append((SLOT_NAMES[i], SLOT_NAMES[i + 1], ids))
    by_boundary: dict[tuple[str, str], list[list[int]]] = {}
    for left, right, ids in cases:
        by_boundary.setdefault((left, right), []).append(ids)
    for (left, right), group in by_boundary.items():
        whole_texts, expected = [], []
        for ids in group:
            first = ids[0] == int(open_piece[1]) and int(open_piece[0]) != int(open_piece[1])
            head_text, head_ids = (prefix_text, list(prefix)) if first else (eos_text, [eos_id])
            whole_texts.append(head_text + "".join(texts[i] for i in ids))
            expected.append(head_ids + [t for i in ids for t in piece_ids[i]])
        for ids, g, e in zip(group, _encode_many(tokenizer, whole_texts), expected):
            if g != e:
                first = ids[0] == int(open_piece[1]) and int(open_piece[0]) != int(open_piece[1])
                names = ("system prefix" if first else "eos",) + SLOT_NAMES
                parts = [list(prefix) if first else [eos_id]] + [piece_ids[i] for i in ids]
                strings = [prefix_text if first else eos_text] + [texts[i] for i in ids]
                # the first differing token lies in piece p: the merge crosses its start or its end
                d = next((j for j, (x, y) in enumerate(zip(g, e)) if x != y), min(len(g), len(e)))
                ends = np.cumsum([len(q) for q in parts])
                p = int(min(np.searchsorted(ends, d, side="right"), len(parts) - 1))
                start = int(ends[p] - len(parts[p]))
                a = p - 1 if (d == start and p > 0) or p == len(parts) - 1 else p
                a = next((q for q in range(a, -1, -1) if strings[q]), a)  # skip empty pieces
                b = next((q for q in range(a + 1, len(parts)) if strings[q]), min(a + 1, len(parts) - 1))
                raise _boundary_error(tokenizer, preset, names[a], names[b], (strings[a], strings[b]), g, e)
    # the generation prompt must end at a boundary for replies in the format the model is asked for
    gen = texts[int(close_piece[0])]
    gen_ids = piece_ids[int(close_piece[0])]
    replies = ["<think>I can win at 2.</think>\n<move>2</move>", "<move>4</move>", "I must block at 6."]
    for reply, g in zip(replies, _encode(tokenizer, [gen + r + eos_text for r in replies])):
        e = gen_ids + _encode(tokenizer, [reply])[0] + [eos_id]
        if g != e:
            raise _boundary_error(tokenizer, preset, "close", "reply", [gen, reply, eos_text], g, e)


# ----------------------------------------------------------------------------------------------------------
# On-device rendering
# ----------------------------------------------------------------------------------------------------------

_ROW_WEIGHTS = np.array([1, 3, 9], np.int32)


def render_user_turn(
    tables: TextTables, board: jax.Array, status: jax.Array, last_opponent_move: jax.Array, first: Any
) -> tuple[jax.Array, jax.Array]:
    """Tokens of one user turn, from after the previous reply's `<|im_end|>` to the start of the next reply.

    board int8[9] (0 empty, 1 X, 2 O), status int (STATUS_*), last_opponent_move int (-1: none), first bool
    (True: the turn follows the system prefix). Returns (tokens int32[max_msg] padded with pad_id, length
    int32). Jittable and vmappable."""
    board = jnp.asarray(board).astype(jnp.int32).reshape(9)
    status = jnp.clip(jnp.asarray(status).astype(jnp.int32), 0, NUM_STATUS - 1)
    k = jnp.clip(jnp.asarray(last_opponent_move).astype(jnp.int32), 0, 8)
    first = jnp.asarray(first).astype(jnp.int32)
    final = (status >= FIRST_FINAL_STATUS).astype(jnp.int32)
    codes = (board.reshape(3, 3) * _ROW_WEIGHTS).sum(axis=1)
    mask = jnp.sum(jnp.where(board == 0, 1 << jnp.arange(9, dtype=jnp.int32), 0))
    ids = jnp.stack(
        [
            tables.open_piece[first],
            tables.status_piece[status, k],
            tables.row_piece[0, final, codes[0]],
            tables.row_piece[1, final, codes[1]],
            tables.row_piece[2, final, codes[2]],
            tables.free_piece[final, mask],
            tables.turn_piece[final],
            tables.close_piece[final],
        ]
    )
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


# ----------------------------------------------------------------------------------------------------------
# On-device parsing
# ----------------------------------------------------------------------------------------------------------

_MAX_TAG = 8
_TAGS = (b"<think>", b"</think>", b"<move>", b"</move>")


def _tag_table() -> tuple[np.ndarray, np.ndarray]:
    t = np.zeros((len(_TAGS), _MAX_TAG), np.int32)
    for i, tag in enumerate(_TAGS):
        t[i, : len(tag)] = np.frombuffer(tag, np.uint8)
    return t, np.array([len(tag) for tag in _TAGS], np.int32)


_LT = ord("<")
# content classifier kinds for the text after <move>
_LEAD, _DIGIT, _GARBAGE = 0, 1, 2


def _kmp(j, b, tag_bytes):
    """One step of a matcher for a tag whose only '<' is its first byte: new count of matched bytes."""
    return jnp.where(b == tag_bytes[j], j + 1, jnp.where(b == _LT, 1, 0))


def reply_bytes(tables: TextTables, tokens: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token ids int32[N] (first `length` real) -> (bytes uint8[N*max_token_bytes], valid bool[N*max_token_bytes])."""
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    n = tokens.shape[0]
    rows = tables.byte_table.at[tokens].get(mode="fill", fill_value=0)  # [N, B]
    lens = tables.byte_lengths.at[tokens].get(mode="fill", fill_value=0)
    valid = (jnp.arange(tables.max_token_bytes)[None, :] < lens[:, None]) & (jnp.arange(n) < length)[:, None]
    return rows.reshape(-1), valid.reshape(-1)


def parse_bytes(data: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Run the reply automaton over bytes uint8[L] (bytes where `valid` is False are skipped).

    Returns (move int32: -1 no tag, 0..8 a cell, 9 a tag whose content is not a cell; format_ok bool)."""
    tags, tag_lens = (jnp.asarray(a) for a in _tag_table())
    trie = jnp.asarray(_ws_trie().astype(np.int32))
    open_tag, close_tag = tags[2], tags[3]

    def cls_step(kind, digit, node, b):
        t = trie[node, b]
        pending = node != 0
        is_digit = (b >= ord("0")) & (b <= ord("8"))
        new_kind = jnp.where(
            pending,
            jnp.where(t < 0, _GARBAGE, kind),
            jnp.where(t >= 0, kind, jnp.where(is_digit & (kind == _LEAD), _DIGIT, _GARBAGE)),
        )
        new_digit = jnp.where(~pending & (t < 0) & is_digit & (kind == _LEAD), b - ord("0"), digit)
        new_node = jnp.where(t > 0, t, 0)
        garbage = kind == _GARBAGE
        return (
            jnp.where(garbage, kind, new_kind),
            jnp.where(garbage, digit, new_digit),
            jnp.where(garbage | (new_kind == _GARBAGE), 0, new_node),
        )

    def step(state, inp):
        b, ok = inp
        b = b.astype(jnp.int32)
        (phase, oj, cj, kind, digit, node, s_kind, s_digit, s_node, move, fstage, fj) = state
        # move: phase 0 looks for <move>, phase 1 classifies the content and looks for </move>, 2 done
        oj_new = _kmp(oj, b, open_tag)
        opened = (phase == 0) & (oj_new == 6)
        is_lt = b == _LT
        in1 = phase == 1
        s_kind = jnp.where(in1 & is_lt, kind, s_kind)
        s_digit = jnp.where(in1 & is_lt, digit, s_digit)
        s_node = jnp.where(in1 & is_lt, node, s_node)
        k2, d2, n2 = cls_step(kind, digit, node, b)
        cj_new = _kmp(cj, b, close_tag)
        closed = in1 & (cj_new == 7)
        result = jnp.where((s_kind == _DIGIT) & (s_node == 0), s_digit, INVALID_MOVE)
        new_state_move = (
            jnp.where(opened, 1, jnp.where(closed, 2, phase)),
            jnp.where(phase == 0, oj_new, oj),
            jnp.where(opened, 0, jnp.where(in1, cj_new, cj)),
            jnp.where(opened, _LEAD, jnp.where(in1, k2, kind)),
            jnp.where(opened, 0, jnp.where(in1, d2, digit)),
            jnp.where(opened, 0, jnp.where(in1, n2, node)),
            s_kind,
            s_digit,
            s_node,
            jnp.where(closed, result, move),
        )
        # format: four tags in order, each searched after the end of the previous one
        stage_tag = tags[jnp.minimum(fstage, 3)]
        fj_new = _kmp(fj, b, stage_tag)
        done_tag = (fstage < 4) & (fj_new == tag_lens[jnp.minimum(fstage, 3)])
        new_fstage = jnp.where(done_tag, fstage + 1, fstage)
        new_fj = jnp.where(done_tag | (fstage >= 4), 0, fj_new)
        new_state = new_state_move + (new_fstage, new_fj)
        return tuple(jnp.where(ok, n, o) for n, o in zip(new_state, state)), None

    z = jnp.int32(0)
    init = (z, z, z, z, z, z, z, z, z, jnp.int32(NO_MOVE), z, z)
    data = jnp.asarray(data).astype(jnp.int32)
    final, _ = jax.lax.scan(step, init, (data, jnp.asarray(valid)), unroll=8)
    move = jnp.where(final[0] == 2, final[9], NO_MOVE)
    return move.astype(jnp.int32), final[10] == 4


def parse_reply(tables: TextTables, tokens: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Move and format flag of a reply: tokens int32[N], the first `length` real -> (move int32, format_ok bool).

    move: -1 no `<move>...</move>`, 0..8 the cell, 9 a tag whose content is not a single cell digit.
    Jittable and vmappable."""
    data, valid = reply_bytes(tables, tokens, length)
    return parse_bytes(data, valid)
