"""Experiment config: presets, overrides, validation errors naming the key path, TOML round trip."""

import dataclasses
import typing
from pathlib import Path

import jax
import pytest

from envs.tictactoe import EnvParams
from jaxrl_llm import config as cfg
from jaxrl_llm.config import ConfigError, ExperimentConfig, GrpoStage
from jaxrl_llm.optim import OptimConfig

PRESETS = Path(__file__).resolve().parents[1] / "experiments" / "presets"
TINY = PRESETS / "tiny_test.toml"
CPU = PRESETS / "cpu.toml"


def _sections(config_cls=ExperimentConfig):
    hints = typing.get_type_hints(config_cls)
    out = []
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if typing.get_origin(tp) is tuple:
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp) and tp is not EnvParams:
            out.append(tp)
    return out


# ---- presets ---------------------------------------------------------------------------------------------


def test_presets_load_and_fit_the_tokenizer():
    from jaxrl_llm.tokenizer import load_tokenizer
    from models.lfm2 import Lfm2ForCausalLM, count_params

    vocab = len(load_tokenizer())
    tiny, cpu = cfg.load_config(TINY), cfg.load_config(CPU)
    for c in (tiny, cpu):
        assert c.model.lfm2_config().vocab_size >= vocab
    assert tiny.prompt.preset == "compact" and cpu.prompt.preset == "tiny"
    assert len(tiny.grpo) == 2 and tiny.sft.steps <= 5
    # cpu: SFT then the spec's two GRPO stages (rising opponent strength), 7 training turns, 8 in evaluation,
    # 1000 evaluation games per opponent.
    assert cpu.sft.steps > 0 and cpu.sft.teacher == "best" and cpu.sft.tree_copies > 0
    assert [(s.p_min, s.p_max) for s in cpu.grpo] == [(0.2, 0.7), (0.0, 0.25)]
    assert all(s.max_turns == 7 for s in cpu.grpo) and cpu.eval.max_turns == 8 and cpu.eval.num_games == 1000
    module = Lfm2ForCausalLM(cpu.model.lfm2_config())
    shapes = jax.eval_shape(module.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 4), "int32"))
    assert 500_000 <= count_params(shapes) <= 5_000_000


@pytest.mark.parametrize("size", ["350m", "1.2b"])
def test_gpu_presets_load_a_real_checkpoint_layout(size, tmp_path):
    """The GPU presets read an LFM2 folder (here a tiny stand-in with the same files) with the reference prompt
    and the spec's two stages (256 then 480 rollouts, p ranges, temperatures, context lengths)."""
    import json

    from models import lfm2

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(lfm2.PRESETS["tiny"].to_hf_dict()))
    c = cfg.load_config(PRESETS / f"lfm2_{size}_gpu.toml", [f'model.init_from="{folder}"', f'tokenizer.path="{folder}"'])
    assert c.prompt.preset == "reference" and c.model.lfm2_config().hidden_size == lfm2.PRESETS["tiny"].hidden_size
    assert [s.num_prompts * s.group_size for s in c.grpo] == [256, 480]
    assert [(s.p_min, s.p_max, s.temperature) for s in c.grpo] == [(0.2, 0.7, 1.0), (0.0, 0.25, 1.25)]
    assert [c.stage_context_length(i) for i in range(2)] == [768, 384]
    assert c.sft.steps == 30 and c.sft.batch_size == 32
    with pytest.raises(ConfigError, match="init_from"):
        cfg.load_config(PRESETS / f"lfm2_{size}_gpu.toml")  # the checkpoint is not downloaded here


def test_defaults_are_valid_and_hashable():
    c = ExperimentConfig(grpo=(GrpoStage(),))
    assert hash(c) == hash(ExperimentConfig(grpo=(GrpoStage(),)))
    # a section works as a static jit argument
    f = jax.jit(lambda x, s: x * s.temperature, static_argnums=1)
    assert float(f(2.0, c.sampling)) == 2.0


def test_every_optional_field_defaults_to_none():
    # TOML has no null: an Optional field is written by leaving it out, so its default must be None.
    for section in _sections():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if type(None) in typing.get_args(hints[f.name]):
                assert f.default is None, f"{section.__name__}.{f.name}"


def test_optim_fields_mirror_optim_config():
    names = {f.name for f in dataclasses.fields(OptimConfig)}
    assert set(cfg._OPTIM_FIELDS) == names
    stage = GrpoStage(steps=40, learning_rate=3e-5)
    assert stage.optim == OptimConfig(learning_rate=3e-5, total_steps=40)
    assert cfg.SftSection(steps=0).optim.total_steps == 1  # OptimConfig needs >= 1
    assert cfg.SftSection(total_steps=7).optim.total_steps == 7


def test_stage_helpers():
    c = cfg.load_config(TINY)
    fields = c.grpo[0].grpo_fields()
    assert fields["group_size"] == 2 and fields["temperature"] == 1.0
    assert fields["max_completion_tokens"] == c.grpo[0].max_turns * c.grpo[0].max_new_tokens
    rc = c.rollout_config(1, stop_token_ids=[7], pad_id=3)
    assert rc.context_length == 352 and rc.env.max_turns == 3
    assert rc.sampling.temperature == 1.25 and rc.sampling.max_new_tokens == 12
    assert rc.sampling.stop_token_ids == (7,) and rc.sampling.pad_id == 3
    ev = c.rollout_config(None)
    assert ev.sampling.greedy and ev.env.max_turns == c.eval.max_turns
    assert c.rollout_config(0).context_length == c.rollout.context_length
    staged = cfg.load_config(TINY, ["rollout.cache_stages=3"])
    assert staged.rollout_config(0).cache_stages == staged.rollout_config(None).cache_stages == 3
    assert c.eval.opponent_probs() == (1.0, 0.0)
    assert c.checkpoint_dir() == "runs/tiny_test/checkpoints"


def test_mesh_axis_sizes():
    assert cfg.MeshSection().axis_sizes(8) == (8, 1)
    assert cfg.MeshSection(data=2, fsdp=-1).axis_sizes(8) == (2, 4)
    with pytest.raises(ConfigError, match="does not fit 8 devices"):
        cfg.MeshSection(data=3, fsdp=1).axis_sizes(8)
    with pytest.raises(ConfigError, match="fsdp"):
        cfg.MeshSection(data=-1, fsdp=-1)


# ---- overrides -------------------------------------------------------------------------------------------


def test_overrides():
    c = cfg.load_config(TINY, [
        "grpo.0.learning_rate=3e-5",
        "sampling.temperature=1.2",
        'eval.opponents=["optimal"]',
        "prompt.preset=reference",  # bare string
        "sft.learning_rate=1",  # an integer literal for a float field
        "grpo.2.steps=5",  # one past the end appends a stage with defaults
        "model.remat=true",
    ])
    assert c.grpo[0].learning_rate == 3e-5
    assert c.sampling.temperature == 1.2
    assert c.eval.opponents == ("optimal",)
    assert c.prompt.preset == "reference"
    assert c.sft.learning_rate == 1.0 and isinstance(c.sft.learning_rate, float)
    assert len(c.grpo) == 3 and c.grpo[2].steps == 5 and c.grpo[2].group_size == GrpoStage().group_size
    assert c.model.remat is True and c.model.lfm2_config().remat is True
    assert cfg.parse_override(" a.b = [1, 2] ") == (("a", "b"), [1, 2])


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("sampling.temperature=0", "sampling.temperature", ["> 0"]),
        ("grpo.1.temperature=-1", "grpo.1.temperature", ["> 0"]),
        ("grpo.0.p_min=0.9", "grpo.0.p_min", ["p_max"]),
        ("grpo.0.p_max=1.5", "grpo.0.p_max", ["[0, 1]"]),
        ("sft.teacher_random_move_prob=-0.1", "sft.teacher_random_move_prob", ["[0, 1]"]),
        ("sft.steps=-1", "sft.steps", [">= 0"]),
        ("grpo.0.steps=-3", "grpo.0.steps", [">= 0"]),
        ("grpo.0.group_size=1", "grpo.0.group_size", [">= 2"]),
        ("grpo.0.loss_type=dr_grpo", "grpo.0.loss_type", ["did you mean 'dr-grpo'"]),
        ("grpo.0.num_minibatches=3", "grpo.0.num_minibatches", ["divide"]),
        ('eval.opponents=["optimal", "strong"]', "eval.opponents.1", ["unknown opponent 'strong'"]),
        ("eval.opponents=[]", "eval.opponents", ["at least one"]),
        ("env.max_turns=0", "env.max_turns", [">= 1"]),
        ("env.invalid_penalty=0.5", "env.invalid_penalty", ["<= 0"]),
        ("model.preset=tinny", "model.preset", ["did you mean 'tiny'"]),
        ("model.num_hidden_layers=3", "model.num_hidden_layers", ["layer_types"]),
        ('model.layer_types=["conv", "attn", "conv", "conv"]', "model.layer_types.1", ["'attn'"]),
        ("model.dtype=float8", "model.dtype", ["bfloat16"]),
        ("prompt.preset=short", "prompt.preset", ["'compact'"]),
        ("rollout.context_length=8", "rollout.context_length", [">= 16"]),
        ("rollout.cache_stages=0", "rollout.cache_stages", [">= 1"]),
        ("sampling.max_new_tokens=400", "sampling.max_new_tokens", ["context_length"]),
        ("grpo.1.max_new_tokens=352", "grpo.1.max_new_tokens", ["context length 352"]),
        ("sft.seq_len=100000", "sft.seq_len", ["max_position_embeddings"]),
        ("mesh.data=0", "mesh.data", ["-1"]),
        ("checkpoint.keep=0", "checkpoint.keep", [">= 1"]),
    ],
)
def test_out_of_range_values_name_the_key(override, key, words):
    with pytest.raises(ConfigError) as info:
        cfg.load_config(TINY, [override])
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith(key + ":") and "tiny_test.toml" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("sampling.temperature=hot", "sampling.temperature", ["expected a float", "string 'hot'"]),
        ("sampling.top_k=1.5", "sampling.top_k", ["expected an integer", "float 1.5"]),
        ("run.seed=true", "run.seed", ["expected an integer", "boolean true"]),
        ("eval.greedy=1", "eval.greedy", ["expected a boolean", "integer 1"]),
        ("eval.opponents=random", "eval.opponents", ["expected an array of strings", "string 'random'"]),
        ("eval.opponents=[1]", "eval.opponents.0", ["expected a string", "integer 1"]),
        ("run.output_dir=3", "run.output_dir", ["expected a string"]),
        ("model.vocab_size=big", "model.vocab_size", ["expected an integer", "string 'big'"]),
        ("sampling=3", "sampling", ["expected a table"]),
        ("grpo.0=3", "grpo.0", ["expected a table"]),
        ("env.win_value=[1]", "env.win_value", ["expected a float"]),
    ],
)
def test_wrong_types_name_field_expected_and_got(override, key, words):
    with pytest.raises(ConfigError) as info:
        cfg.load_config(TINY, [override])
    assert info.value.key == key
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("sampling.temprature=1.0", "sampling.temprature", "did you mean 'temperature'"),
        ("samplng.temperature=1.0", "samplng", "did you mean 'sampling'"),
        ("grpo.0.learnig_rate=1e-5", "grpo.0.learnig_rate", "did you mean 'learning_rate'"),
        ("rollout.max_turns=3", "rollout.max_turns", "'max_turns' is a key of env, eval, grpo.N"),
    ],
)
def test_unknown_keys_suggest_the_closest(override, key, suggestion):
    with pytest.raises(ConfigError) as info:
        cfg.load_config(TINY, [override])
    assert info.value.key == key
    assert "unknown key" in str(info.value) and suggestion in str(info.value)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        cfg.load_config(TINY, ["sampling.temperature"])
    with pytest.raises(ConfigError, match="use an index up to 2"):
        cfg.load_config(TINY, ["grpo.5.steps=1"])
    with pytest.raises(ConfigError, match="is a list"):
        cfg.load_config(TINY, ["grpo.first.steps=1"])
    with pytest.raises(ConfigError, match="is a value"):
        cfg.load_config(TINY, ["sampling.max_new_tokens.x=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        cfg.load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling\ntemperature = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        cfg.load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[[grpo]]\nsteps = 1\n\n[[grpo]]\ntemperatur = 1.0\n")
    with pytest.raises(ConfigError) as info:
        cfg.load_config(typo)
    assert info.value.key == "grpo.1.temperatur" and "typo.toml" in str(info.value)
    typo.write_text('[model]\ninit_from = "/no/such/folder"\n')
    with pytest.raises(ConfigError) as info:
        cfg.load_config(typo)
    assert info.value.key == "model.init_from"
    assert cfg.load_config(typo, check_paths=False).model.init_from == "/no/such/folder"


def test_init_from_with_a_clashing_architecture_override_names_both_values(tmp_path):
    import json

    from models import lfm2

    folder = tmp_path / "ckpt"
    folder.mkdir()
    saved = dataclasses.replace(lfm2.PRESETS["tiny"], vocab_size=576)
    (folder / "config.json").write_text(json.dumps(saved.to_hf_dict()))
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\ninit_from = "{folder}"\nvocab_size = 576\nhidden_size = {saved.hidden_size}\n')
    assert cfg.load_config(path).model.lfm2_config().vocab_size == 576  # overrides equal to the checkpoint's
    with pytest.raises(ConfigError) as info:
        cfg.load_config(path, [f"model.hidden_size={2 * saved.hidden_size}"])
    assert info.value.key == "model.hidden_size"
    assert f"checkpoint has {saved.hidden_size}" in str(info.value) and "init_from" in str(info.value)


def test_python_construction_errors_name_the_field():
    with pytest.raises(ConfigError) as info:
        GrpoStage(temperature=0.0)
    assert info.value.key == "temperature" and isinstance(info.value, ValueError)
    with pytest.raises(ConfigError) as info:
        ExperimentConfig(grpo=(GrpoStage(), GrpoStage(max_new_tokens=2000)))
    assert info.value.key == "grpo.1.max_new_tokens"
    assert ExperimentConfig(grpo=[GrpoStage()]).grpo == (GrpoStage(),)  # lists become tuples


# ---- dumping ---------------------------------------------------------------------------------------------


def test_round_trip():
    configs = [
        ExperimentConfig(),
        ExperimentConfig(grpo=(GrpoStage(), GrpoStage(p_min=0.0, p_max=0.25, ratio_mask_low=0.5))),
        cfg.load_config(TINY),
        cfg.load_config(CPU),
        cfg.loads_config("", [
            'run.output_dir="runs/a \\"quoted\\" dir\\\\x é\\t"',
            'tokenizer.path="/tmp/tok"',
            "model.init_from=/models/LFM2-350M",
            "model.dtype=bfloat16",
            "sampling.top_p=0.95",
            "grpo.0.max_completion_tokens=100",
            "checkpoint.dir=/ckpt",
        ]),
    ]
    for c in configs:
        text = cfg.dump_config(c)
        again = cfg.loads_config(text)
        assert again == c
        assert cfg.dump_config(again) == text
        assert cfg.config_from_dict(cfg.config_to_dict(c)) == c


def test_dump_writes_stages_as_tables_and_leaves_none_out():
    text = cfg.dump_config(cfg.load_config(TINY))
    assert text.count("[[grpo]]") == 2 and "[model]" in text
    assert "init_from" not in text  # None
    assert "context_length = 352" in text
    assert text.index("steps = ") < text.index("learning_rate")  # a stage's own fields first
