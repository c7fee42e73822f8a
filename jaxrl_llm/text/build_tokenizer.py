"""Build the project's tokenizer (deterministic): `python -m jaxrl_llm.text.build_tokenizer [out_dir] [--env NAME ...]`.

A small byte-level BPE trained with `tokenizers` on the text of registered environments, taken through the
protocol (`Env.tokenizer_corpus`; default `envs.DEFAULT_ENV`, whose corpus the shipped tokenizer was trained
on), then the chat role names. The pre-tokenizer is a Llama-3 style regex with single digits (so every cell
index and every digit is one token), then the byte-level alphabet. Special tokens: <|pad|> 0,
<|startoftext|> 1, <|endoftext|> 2, <|im_start|> 3, <|im_end|> 4 (eos). The chat template is ChatML like
LFM2's (jaxrl_llm.text.tokenizer.CHAT_TEMPLATE). The output is the Hugging Face folder
`jaxrl_llm/assets/tokenizer/` (loaded offline by load_tokenizer()).

`--layout qwen` builds the same BPE with Qwen's special tokens instead (<|endoftext|> 0 (pad),
<|im_start|> 1, <|im_end|> 2 (eos), no bos) and Qwen's ChatML (`CHATML_TEMPLATE`): a tokenizer laid out as
Qwen3's, for tests and small experiments without a download (the split regex is already Qwen2's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from jaxrl_llm.text.tokenizer import ASSET_DIR, BOS, CHAT_TEMPLATE, CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, PAD

VOCAB_SIZE = 640
SPECIAL_TOKENS = [PAD, BOS, ENDOFTEXT, IM_START, IM_END]
# The special-token layouts: the tokens (in id order), the bos, the pad, the other specials, the chat template.
LAYOUTS = {
    "lfm2": dict(specials=SPECIAL_TOKENS, bos_token=BOS, pad_token=PAD, additional_special_tokens=[ENDOFTEXT, IM_START],
                 chat_template=CHAT_TEMPLATE),
    "qwen": dict(specials=[ENDOFTEXT, IM_START, IM_END], bos_token=None, pad_token=ENDOFTEXT,
                 additional_special_tokens=[IM_START], chat_template=CHATML_TEMPLATE),
}
# Llama-3 style split, except digits: one digit per pre-token, so moves and cell indices are single tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus(env_names: Sequence[str] | None = None) -> list[str]:
    """The training text: each env's `tokenizer_corpus` (default params) in the given order, then the
    chat role names. None: `envs.DEFAULT_ENV` alone (the shipped tokenizer)."""
    import envs

    out: list[str] = []
    for name in env_names or (envs.DEFAULT_ENV,):
        env = envs.make(name)
        out += env.tokenizer_corpus(env.params)
    return out + ["system\n", "user\n", "assistant\n"] * 50


def build(out_dir: str | Path = ASSET_DIR, env_names: Sequence[str] | None = None, layout: str = "lfm2") -> Path:
    """Train the tokenizer on `corpus(env_names)` and save it in Hugging Face format into `out_dir`, with the
    special tokens and chat template of `layout` ("lfm2": the shipped one; "qwen": Qwen3's)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tokenizer layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    spec = dict(LAYOUTS[layout])
    specials = spec.pop("specials")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(env_names), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        **spec,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    # a class name every transformers version knows (transformers 5 writes its own "TokenizersBackend")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: build into the given folder (default: the shipped asset folder) from the given envs' text."""
    parser = argparse.ArgumentParser(description="Build the project tokenizer from registered envs' text.")
    parser.add_argument("out_dir", nargs="?", default=str(ASSET_DIR))
    parser.add_argument("--env", action="append", help="a registered env whose text to train on (repeatable; "
                        "default: envs.DEFAULT_ENV, as the shipped tokenizer)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="lfm2",
                        help="special tokens and chat template: lfm2 (the shipped tokenizer's) or qwen (Qwen3's)")
    args = parser.parse_args(argv)
    out = build(args.out_dir, args.env, args.layout)
    print(f"saved tokenizer to {out}")


if __name__ == "__main__":
    main()
