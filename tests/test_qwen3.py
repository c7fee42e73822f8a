"""Qwen3 as users bring it: its config.json (what is refused, by name), its tokenizer's layout (ChatML without a
bos, built here: nothing is downloaded) through the text bridge, and a Qwen3 model in the framework's config,
rollout, training and export (the numerics against transformers: tests/test_models.py)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import envs
from jaxrl_base.errors import ModelError
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.config import load_config, loads_config
from jaxrl_llm.generate import SamplingConfig
from jaxrl_llm.text.build_tokenizer import build as build_tokenizer
from models import family as fam
from models.qwen3 import PRESETS, Qwen3Config

TINY = PRESETS["qwen3-tiny"]
# Qwen3-0.6B's config.json as the Hub serves it (transformers 4.51 keys).
QWEN3_0P6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


# ---------------------------------------------------------------------------------------------- config.json


def test_the_released_config_reads_as_the_preset():
    assert fam.config_from_hf(QWEN3_0P6B) == PRESETS["qwen3-0.6b"]
    cfg = PRESETS["qwen3-0.6b"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta, cfg.rms_norm_eps) == \
        (1024, 28, 16, 8, 128, 3072, 151_936, True, 1e6, 1e-6)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads


def test_missing_keys_take_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    bare = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": None, "intermediate_size": 96, "vocab_size": 300}
    ours = fam.config_from_hf(bare)
    ref = transformers.Qwen3Config(**{k: v for k, v in bare.items() if k != "model_type"})
    assert (ours.head_dim, ours.num_key_value_heads, ours.tie_word_embeddings, ours.rope_theta) == \
        (ref.head_dim, ref.num_key_value_heads, ref.tie_word_embeddings, ref.rope_parameters["rope_theta"])


@pytest.mark.parametrize("change, match", [
    (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=20),
     r"layers \[20, 21, .*'sliding_attention'.*sliding-window attention is not supported"),
    (dict(layer_types=["full_attention"] * 27 + ["sliding_attention"]), r"layers \[27\] 'sliding_attention'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type is 'yarn'"),
    (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
])
def test_what_is_not_run_here_is_a_named_error(change, match):
    with pytest.raises(ModelError, match=match):
        fam.config_from_hf({**QWEN3_0P6B, **change})


@pytest.mark.parametrize("change, match", [
    (dict(num_key_value_heads=3), "not divisible by num_key_value_heads"),
    (dict(head_dim=15), "must be even"),
    (dict(head_dim=0), "head_dim must be a positive integer"),
    (dict(attention="flash"), "attention is 'flash'"),
])
def test_config_checks(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **change)


# ---------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """A tokenizer laid out as Qwen3's: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), no bos, ChatML."""
    folder = build_tokenizer(tmp_path_factory.mktemp("qwen_tok"), layout="qwen")
    return text.load_tokenizer(folder)


def test_the_text_bridge_verifies_its_tables_against_the_chatml_template(qwen_tok):
    assert qwen_tok.bos_token is None and qwen_tok.eos_token == "<|im_end|>" and qwen_tok.pad_token == "<|endoftext|>"
    text.check_tokenizer(qwen_tok)  # no bos needed: the template writes none
    env = envs.make("tictactoe", prompt="compact")
    tables = text.tables_for_env(qwen_tok, env)
    system = [{"role": "system", "content": env.system_prompt(env.params)}]
    assert np.asarray(tables.prefix).tolist() == qwen_tok.apply_chat_template(system, tokenize=True, return_dict=False)
    assert qwen_tok.decode(np.asarray(tables.prefix).tolist()).startswith("<|im_start|>system\n")
    assert tables.reply_error == ""


def test_a_template_that_rewrites_earlier_replies_is_refused(tmp_path):
    """Qwen3's released template moves <think>...</think> out of earlier assistant turns; rollouts keep the
    sampled tokens, so such a template is refused with the fix."""
    folder = build_tokenizer(tmp_path / "tok", layout="qwen")
    tok = text.load_tokenizer(folder)
    tok.chat_template = text.tokenizer.CHATML_TEMPLATE.replace(
        'set content = message["content"] -%}',
        'set content = message["content"] -%}{%- if "</think>" in content and not loop.last -%}'
        '{%- set content = content.split("</think>")[-1].lstrip("\\n") -%}{%- endif -%}')
    with pytest.raises(ValueError, match=r"rewrites the reply .*CHATML_TEMPLATE"):
        text.tables_for_env(tok, envs.make("tictactoe"))


def test_a_tiny_qwen3_plays_whole_games_with_that_tokenizer(qwen_tok):
    env = envs.make("tictactoe", prompt="tiny")
    cfg = TINY.replace(vocab_size=len(qwen_tok))
    module = fam.module_of(cfg)
    params = fam.init_params(cfg, jax.random.PRNGKey(0))
    tables = text.tables_for_env(qwen_tok, env)
    run = ro.make_rollout(env, fam.cached_call(module), lambda b, n: fam.init_cache(cfg, b, n), tables,
                          ro.RolloutConfig(context_length=192, max_turns=2),
                          SamplingConfig(temperature=1.0, max_new_tokens=12, constrained=True))
    examples = env.sample_examples(jax.random.PRNGKey(1), 2, 1, env.Stage(0.0, 1.0))
    traj = jax.device_get(run(params, examples, jax.random.PRNGKey(2)))
    assert (traj.reply_kind[:, 0] == 2).all()  # constrained replies: every first move parses
    game = ro.decode_game(qwen_tok, traj, 0)
    assert game.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n<think></think>" in game


# ---------------------------------------------------------------------------------------------- framework


BASE = """
[model]
preset = "qwen3-tiny"
vocab_size = 576

[env]
name = "tictactoe"

[env.params]
prompt = "tiny"

[rollout]
context_length = 320
max_turns = 8

"""


def test_model_section_takes_the_familys_fields():
    config = loads_config(BASE, ["model.head_dim=8", "model.attention_bias=true"])
    cfg = config.model.model_config()
    assert isinstance(cfg, Qwen3Config) and cfg.head_dim == 8 and cfg.attention_bias and cfg.vocab_size == 576
    with pytest.raises(ConfigError, match=r"model.conv_bias: unknown key 'conv_bias' for preset 'qwen3-tiny', "
                                          r"a qwen3 model"):
        loads_config(BASE, ["model.conv_bias=true"])
    with pytest.raises(ConfigError, match="model.head_dim"):  # an LFM2 preset has no head_dim field
        loads_config(BASE, ['model.preset="tiny"', "model.head_dim=8"])


def test_export_and_init_from_a_qwen3(tmp_path):
    """A tiny Qwen3 built by `train.build` (its training: tests/test_learnability.py), exported as `jaxrl-llm
    export` does, a transformers Qwen3 folder that `model.init_from` reads back as Qwen3; another family's
    config is refused that folder, and an unsupported model_type is named."""
    from jaxrl_llm import train
    from jaxrl_llm.cli.main import export_policy
    from models.hf import load_hf

    config = loads_config(BASE, [f'run.output_dir="{tmp_path / "run"}"'])
    comp = train.build(config)
    assert comp.model_config.model_type == "qwen3"
    params = train.fresh_params(comp, jax.random.PRNGKey(0))
    folder = tmp_path / "export"
    names = export_policy(comp, params, config, folder)
    assert "config.json" in names and json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
    assert isinstance(load_hf(folder).config, Qwen3Config)
    again = load_config(_write(tmp_path, BASE), [f'model.init_from="{folder}"'])
    assert again.model.model_config() == comp.model_config
    lfm2 = load_config(_write(tmp_path, BASE.replace('preset = "qwen3-tiny"', 'preset = "tiny"')))
    with pytest.raises(ValueError, match="holds a qwen3 model .* the config builds a lfm2 one"):
        train.policy_params(lfm2, train.build(lfm2), str(folder))
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "model_type": "mistral"}))
    with pytest.raises(ConfigError, match=r"model.init_from: .*model_type 'mistral', not 'lfm2' or 'qwen3'"):
        load_config(_write(tmp_path, BASE), [f'model.init_from="{folder}"'])


def _write(tmp_path, toml: str):
    path = tmp_path / "preset.toml"
    path.write_text(toml)
    return path
