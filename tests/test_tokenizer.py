"""The project tokenizer: special tokens, chat template, round trips, deterministic rebuild, checks."""

import random

import pytest

import reference_text as ref
from envs.tictactoe import text
from jaxrl_llm.text.build_tokenizer import build
from jaxrl_llm.text.tokenizer import ASSET_DIR, CHAT_TEMPLATE, check_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_special_tokens_and_size(tok):
    assert tok.convert_tokens_to_ids("<|pad|>") == 0 and tok.pad_token_id == 0
    assert tok.bos_token == "<|startoftext|>"
    assert tok.eos_token == "<|im_end|>"
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|startoftext|>", "<|im_start|>", "<|im_end|>")]
    assert len(set(ids)) == 3 and all(i is not None and i != tok.unk_token_id for i in ids)
    assert 300 <= len(tok) <= 1100
    check_tokenizer(tok)


def test_digits_are_single_tokens(tok):
    for d in range(10):
        assert len(tok(str(d), add_special_tokens=False)["input_ids"]) == 1
    for d in range(9):
        ids = tok(f"<move>{d}</move>", add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids(str(d)) in ids


def _env_texts():
    rng = random.Random(0)
    out = [ref.SYSTEM_PROMPT, text.system_prompt(text.PRESETS["compact"])]
    for _ in range(40):
        messages, replies = ref.random_game(rng)
        out += [ref.message(*m) for m in messages] + replies
    out += ["<think>I can win at 2.</think>", "I must block at 6.", "Centre is strongest.", "Corner is strong.",
            "<move>4</move>", "héllo \u00a0 wörld \u2003 ✓ 10 123"]
    return out


def test_round_trip(tok):
    for t in _env_texts():
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == t


def test_chat_template_is_chatml(tok):
    conv = [{"role": "system", "content": "S y s"}, {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "<move>4</move>"}, {"role": "user", "content": "U2"}]
    body = ("<|startoftext|><|im_start|>system\nS y s<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
            "<|im_start|>assistant\n<move>4</move><|im_end|>\n<|im_start|>user\nU2<|im_end|>\n")
    for gen in (False, True):
        expected = body + ("<|im_start|>assistant\n" if gen else "")
        assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == expected
        ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert list(ids) == tok(expected, add_special_tokens=False)["input_ids"]
    # without a system message: no system block
    assert (tok.apply_chat_template(conv[1:2], tokenize=False, add_generation_prompt=True)
            == "<|startoftext|><|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n")


def test_rebuild_is_deterministic(tmp_path):
    build(tmp_path)
    shipped = sorted(p.name for p in ASSET_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (ASSET_DIR / name).read_bytes(), name


def test_check_tokenizer_names_what_is_missing(tok):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare = PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(ValueError) as err:
        check_tokenizer(bare)
    msg = str(err.value)
    for name in ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "pad token", "chat template"):
        assert name in msg
    no_template = load_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        check_tokenizer(no_template)
    assert CHAT_TEMPLATE.startswith("{{- bos_token -}}")


def test_any_env_can_train_a_project_tokenizer_through_the_protocol(tmp_path):
    """`build(env_names=...)` takes each env's `tokenizer_corpus` (arithmetic: the protocol's default, its
    system prompt, message pieces and example replies); the result passes the text bridge's checks."""
    import envs
    from jaxrl_llm.text.build_tokenizer import corpus

    arithmetic = envs.make("arithmetic")
    texts = corpus(["arithmetic"])
    assert arithmetic.system_prompt(arithmetic.params) in texts and "-17" in " ".join(texts)
    assert texts[-3:] == ["system\n", "user\n", "assistant\n"]
    assert corpus() == envs.make("tictactoe").tokenizer_corpus(None) + ["system\n", "user\n", "assistant\n"] * 50
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build(tmp_path, ["arithmetic", "connect_four"])))
    check_tokenizer(tok)
    assert all(len(tok(str(d), add_special_tokens=False)["input_ids"]) == 1 for d in range(10))


def test_the_project_tokenizer_loads_as_the_auto_class_would_without_importing_torch():
    """The project's tokenizer is read by the fast class itself: the same tokenizer AutoTokenizer builds (vocab,
    special tokens, chat template, encodings), and no torch import at start-up (AutoTokenizer imports torch
    whenever it is installed: about 1.5 s for every CLI start)."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    code = ("import sys; from jaxrl_llm.text import load_tokenizer; load_tokenizer(); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    ours, auto = load_tokenizer(), AutoTokenizer.from_pretrained(str(ASSET_DIR))
    assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
    assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
    chat = [{"role": "system", "content": "Tic-Tac-Toe."}, {"role": "user", "content": "X12\n3O5\n67X"},
            {"role": "assistant", "content": "<think></think><move>4</move>"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    assert ours.encode("O played 4.\nX12") == auto.encode("O played 4.\nX12")
