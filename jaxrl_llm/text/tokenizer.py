"""Tokenizers: load any Hugging Face tokenizer (or the project's own), check it has what the text bridge needs.

The project's tokenizer is a small byte-level BPE trained on the default env's text (`Env.tokenizer_corpus`),
shipped in `jaxrl_llm/assets/tokenizer/` and rebuilt deterministically by `python -m jaxrl_llm.text.build_tokenizer`.
It carries LFM2's chat special tokens and a ChatML chat template that behaves like LFM2's:

    <|startoftext|><|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n...
    generation prompt: <|im_start|>assistant\\n        end of turn (eos): <|im_end|>

A model's own tokenizer works the same way (`load_tokenizer(folder)` reads its `tokenizer.json` and chat
template): LFM2's, or Qwen3's ChatML, which is the same layout without the bos token.
"""

from __future__ import annotations

from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

BOS = "<|startoftext|>"
EOS = "<|im_end|>"  # end of turn; generation stops here
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
ENDOFTEXT = "<|endoftext|>"

# Qwen's ChatML (the layout of Qwen2.5's and Qwen3's templates): no bos; every message, the system's first, as
# <|im_start|>{role}\n{content}<|im_end|>\n, then the generation prompt; non-string content as JSON. Unlike Qwen3's
# released template it writes every assistant message as it is: that one moves a reply's <think>...</think> out
# of earlier turns, so a conversation would no longer be the tokens the model sampled (the text bridge refuses
# such a template and names this one).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    '    {{- "<|im_start|>" + message["role"] + "\\n" -}}\n'
    '    {%- set content = message["content"] -%}\n'
    "    {%- if content is not string -%}{%- set content = content | tojson -%}{%- endif -%}\n"
    '    {{- content + "<|im_end|>\\n" -}}\n'
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "<|im_start|>assistant\\n" -}}\n'
    "{%- endif -%}\n"
)

# The same behaviour as LFM2's template: bos, then the system message if the first message is one (tools are
# listed in the system message), then the other messages and the generation prompt as ChatML above.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    '{%- set ns = namespace(system_prompt="") -%}\n'
    '{%- if messages[0]["role"] == "system" -%}\n'
    '    {%- set ns.system_prompt = messages[0]["content"] -%}\n'
    "    {%- set messages = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{%- if tools -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "") + "List of tools: [" -%}\n'
    "    {%- for tool in tools -%}\n"
    "        {%- if tool is not string -%}{%- set tool = tool | tojson -%}{%- endif -%}\n"
    "        {%- set ns.system_prompt = ns.system_prompt + tool -%}\n"
    '        {%- if not loop.last -%}{%- set ns.system_prompt = ns.system_prompt + ", " -%}{%- endif -%}\n'
    "    {%- endfor -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + "]" -%}\n'
    "{%- endif -%}\n"
    "{%- if ns.system_prompt -%}\n"
    '    {{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}\n'
    "{%- endif -%}\n"
) + CHATML_TEMPLATE


def chat_template(name: str) -> str:
    """A chat template by name: "chatml" (`CHATML_TEMPLATE`, Qwen's layout) or "lfm2" (`CHAT_TEMPLATE`)."""
    templates = {"chatml": CHATML_TEMPLATE, "lfm2": CHAT_TEMPLATE}
    if name not in templates:
        raise ValueError(f"unknown chat template {name!r}; use one of {', '.join(templates)}")
    return templates[name]


def load_tokenizer(path: str | Path | None = None, template: str | None = None):
    """Load a Hugging Face tokenizer (with its chat template) from a local folder; None: the project's own.
    template: a name of `chat_template` to use instead of the folder's template (None: keep it)."""
    folder = ASSET_DIR if path is None else Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no tokenizer folder at {folder}; pass a local folder holding tokenizer.json / tokenizer_config.json"
            + (" (rebuild the project's own with `python -m jaxrl_llm.text.build_tokenizer`)" if path is None else "")
        )
    if path is None:  # the project's tokenizer.json: the fast class itself (AutoTokenizer would import torch)
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)  # never run a folder's code
    if template is not None:
        tok.chat_template = chat_template(template)
    return tok


def check_tokenizer(tok) -> None:
    """Raise ValueError naming each special token or chat-template piece the text bridge needs and `tok` lacks.

    The ChatML markers `<|im_start|>` and `<|im_end|>` always; the bos token `<|startoftext|>` when the chat
    template writes `bos_token` (LFM2's does; Qwen3's ChatML starts with `<|im_start|>` and has none), or when
    there is no template (the one to set, `CHAT_TEMPLATE`, writes it)."""
    problems = []
    vocab = tok.get_vocab()
    template = getattr(tok, "chat_template", None) or CHAT_TEMPLATE
    needed = (BOS, IM_START, IM_END) if "bos_token" in str(template) else (IM_START, IM_END)
    for name in needed:
        if name not in vocab:
            problems.append(
                f"missing special token {name!r}: add it with tok.add_special_tokens("
                f"{{'additional_special_tokens': [{name!r}]}}) (and resize the model's embeddings)"
            )
    if tok.pad_token is None or tok.pad_token_id is None:
        problems.append(
            "missing pad token: set one, e.g. tok.add_special_tokens({'pad_token': '<|pad|>'}) "
            "or tok.pad_token = tok.eos_token"
        )
    if tok.eos_token is None:
        problems.append(f"missing eos token: set tok.eos_token = {IM_END!r} (the end of an assistant turn)")
    if not getattr(tok, "chat_template", None):
        problems.append(
            "missing chat template: set tok.chat_template (e.g. jaxrl_llm.text.tokenizer.CHAT_TEMPLATE, ChatML like LFM2)"
        )
    if problems:
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        raise ValueError(f"tokenizer {name!r} cannot be used by the text bridge:\n  - " + "\n  - ".join(problems))
