"""Build the project's tokenizer (deterministic): `python -m envs.tictactoe.build_tokenizer [out_dir]`.

A small byte-level BPE trained with `tokenizers` on the Tic-Tac-Toe environment's own text: both prompt
presets' system prompts, every message form on every reachable board, and short reasoning phrases. The
pre-tokenizer is a Llama-3 style regex with single digits (so every cell index is one token), then the
byte-level alphabet. Special tokens: <|pad|> 0, <|startoftext|> 1, <|endoftext|> 2, <|im_start|> 3,
<|im_end|> 4 (eos). The chat template is ChatML like LFM2's (jaxrl_llm.text.tokenizer.CHAT_TEMPLATE).
The output is the Hugging Face folder `jaxrl_llm/assets/tokenizer/` (loaded offline by load_tokenizer()).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from envs.tictactoe import game, text  # the project tokenizer is trained on this env's text
from jaxrl_llm.text.tokenizer import ASSET_DIR, BOS, CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, PAD

VOCAB_SIZE = 640
SPECIAL_TOKENS = [PAD, BOS, ENDOFTEXT, IM_START, IM_END]
# Llama-3 style split, except digits: one digit per pre-token, so moves and cell indices are single tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

def _reachable_boards() -> list[tuple[int, ...]]:
    """Every board reachable in a game (either side first), in a fixed order (the game's own rules)."""
    won, full = game.terminal_tables()
    pow3 = [3**i for i in range(9)]
    seen: dict[tuple[tuple[int, ...], int], None] = {}
    stack = [((0,) * 9, 1), ((0,) * 9, 2)]
    while stack:
        board, player = stack.pop()
        key = (board, player)
        if key in seen:
            continue
        seen[key] = None
        index = sum(v * p for v, p in zip(board, pow3))
        if won[index] or full[index]:
            continue
        for i in range(9):
            if board[i] == 0:
                nb = list(board)
                nb[i] = player
                stack.append((tuple(nb), 3 - player))
    return sorted({b for b, _ in seen})


def corpus() -> list[str]:
    """The training text, in a fixed order."""
    out: list[str] = []
    boards = _reachable_boards()
    for preset in (text.PRESETS["reference"], text.PRESETS["compact"]):
        out += [text.system_prompt(preset)] * 50
        for i, board in enumerate(boards):
            status = i % game.NUM_STATUS
            k = (i * 7) % 9
            out.append(text.render_message(preset, board, status, k))
    for k in range(9):
        out += [
            f"<think>I can win at {k}.</think>\n<move>{k}</move>",
            f"<think>I must block at {k}.</think>\n<move>{k}</move>",
            f"<think>Centre is strongest.</think>\n<move>{k}</move>",
            f"<think>Corner is strong.</think>\n<move>{k}</move>",
            f"<think>I take {k}.</think><move>{k}</move>",
            f"<move>{k}</move>",
        ] * 20
    out += ["system\n", "user\n", "assistant\n"] * 50
    return out


def build(out_dir: str | Path = ASSET_DIR) -> Path:
    """Train the tokenizer and save it in Hugging Face format into `out_dir`."""
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
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[ENDOFTEXT, IM_START],
        chat_template=CHAT_TEMPLATE,
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
    """CLI: build into the given folder (default: the shipped asset folder)."""
    argv = sys.argv[1:] if argv is None else argv
    out = build(argv[0] if argv else ASSET_DIR)
    print(f"saved tokenizer to {out}")


if __name__ == "__main__":
    main()
