"""The tokenizer side of the text bridge: the chat template cut into pieces, and the bytes of every token.

`chat_pieces(tokenizer)` renders the tokenizer's own chat template with sentinel messages and cuts out
the text around messages: the system head and tail, the opening of the first and of a later user turn,
and the user turn's close with and without the generation prompt. A template that does not have the
ChatML layout (`[<bos>]<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n...`: LFM2's with a bos, Qwen3's
without) is refused with the layout it should have.

`token_bytes(tokenizer)` gives the bytes of every token id (byte-level BPE through the GPT-2 byte alphabet,
SentencePiece byte fallback `<0x..>` and `\u2581` spaces; special tokens have none); the parser turns
sampled ids into bytes with a table of them.
"""

from __future__ import annotations

import functools
import json

def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(text, add_special_tokens=False)` gives them."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Like _encode, through the Rust backend directly when there is one (the bulk of the verification)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return encode(tokenizer, texts)
    fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in fast(texts, add_special_tokens=False)]


def chat_pieces(tokenizer) -> dict[str, str]:
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
            f"renders ({what}); expected ChatML like LFM2's or Qwen3's: [<bos>]<|im_start|>system\\n...<|im_end|>\\n"
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
