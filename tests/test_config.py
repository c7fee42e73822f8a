"""Experiment config: presets, overrides, validation errors naming the key path, TOML round trip."""

import dataclasses
import typing
from pathlib import Path

import jax
import pytest

from envs import tictactoe as ttt
from jaxrl_llm import config as cfg
from jaxrl_llm.algos.grpo import GrpoConfig
from jaxrl_llm.algos.optim import OptimConfig
from jaxrl_llm.config import ConfigError, ExperimentConfig, GrpoStage

PRESETS = Path(__file__).resolve().parents[1] / "experiments" / "presets"
TINY = PRESETS / "tiny_test.toml"
CPU = PRESETS / "cpu.toml"


def _sections(config_cls=ExperimentConfig, seen=None):
    """Every dataclass a TOML table becomes, nested ones included (the env's own types too)."""
    seen = [] if seen is None else seen
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if typing.get_origin(tp) is tuple:
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp) and tp not in seen:
            seen.append(tp)
            _sections(tp, seen)
    for env_type in (ttt.Params, ttt.Stage, ttt.Teacher):
        if env_type not in seen:
            seen.append(env_type)
    return seen


# ---- presets ---------------------------------------------------------------------------------------------


def test_presets_load_and_fit_the_tokenizer():
    from jaxrl_llm.text import load_tokenizer
    from models.lfm2 import Lfm2ForCausalLM, count_params

    vocab = len(load_tokenizer())
    tiny, cpu = cfg.load_config(TINY), cfg.load_config(CPU)
    for c in (tiny, cpu):
        assert c.model.model_config().vocab_size >= vocab and c.env.name == "tictactoe"
    assert tiny.env.params.prompt == "compact" and cpu.env.params.prompt == "tiny"
    assert len(tiny.grpo) == 2 and tiny.sft.steps <= 5
    # cpu: SFT then the spec's two GRPO stages (rising opponent strength), 7 training turns, 8 in evaluation,
    # 1000 evaluation games per opponent.
    assert cpu.sft.steps > 0 and cpu.sft.teacher.kind == "best" and cpu.sft.teacher.tree_copies > 0
    assert [(s.curriculum.p_min, s.curriculum.p_max) for s in cpu.grpo] == [(0.2, 0.7), (0.0, 0.25)]
    assert all(s.rollout.max_turns == 7 for s in cpu.grpo) and cpu.eval.rollout.max_turns == 8
    assert cpu.eval.num_games == 1000 and cpu.eval.sampling.greedy
    module = Lfm2ForCausalLM(cpu.model.model_config())
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
    assert c.env.params.prompt == "reference" and c.model.model_config().hidden_size == lfm2.PRESETS["tiny"].hidden_size
    assert [s.num_prompts * s.group_size for s in c.grpo] == [256, 480]
    assert [(s.curriculum.p_min, s.curriculum.p_max, s.sampling.temperature) for s in c.grpo] == [
        (0.2, 0.7, 1.0), (0.0, 0.25, 1.25)]
    assert [s.rollout.context_length for s in c.grpo] == [768, 384]
    assert c.sft.steps == 30 and c.sft.batch_size == 32
    with pytest.raises(ConfigError, match="init_from"):
        cfg.load_config(PRESETS / f"lfm2_{size}_gpu.toml")  # the checkpoint is not downloaded here


def test_defaults_are_valid_and_hashable():
    c = ExperimentConfig(grpo=(GrpoStage(),))
    assert hash(c) == hash(ExperimentConfig(grpo=(GrpoStage(),)))
    # env-bound fields left out in Python get the env's defaults
    assert c.env.params == ttt.Params() and c.grpo[0].curriculum == ttt.Stage() and c.sft.teacher == ttt.Teacher()
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


def test_sections_are_the_real_dataclasses_not_mirrors():
    """One dataclass per concept: the stage nests GrpoConfig / OptimConfig / SamplingConfig / RolloutConfig."""
    from jaxrl_llm.algos.sft import SftConfig
    from jaxrl_llm.generate import SamplingConfig
    from jaxrl_llm.rollout import RolloutConfig

    hints = typing.get_type_hints(GrpoStage, include_extras=True)
    assert (hints["loss"], hints["optim"], hints["sampling"], hints["rollout"]) == (
        GrpoConfig, OptimConfig, SamplingConfig, RolloutConfig)
    hints = typing.get_type_hints(ExperimentConfig)
    assert (hints["sft"], hints["sampling"], hints["rollout"]) == (SftConfig, SamplingConfig, RolloutConfig)
    stage = GrpoStage(steps=40, optim=OptimConfig(learning_rate=3e-5))
    assert stage.optim_config() == OptimConfig(learning_rate=3e-5, total_steps=40)
    assert GrpoStage(steps=0).optim_config().total_steps == 1  # the schedule needs >= 1
    assert GrpoStage(optim=OptimConfig(total_steps=7)).optim_config().total_steps == 7
    # fields set by the code, not the user, are not TOML keys; the group size is the stage's, not the loss's
    with pytest.raises(ConfigError, match="unknown key 'group_size'"):
        cfg.load_config(TINY, ["grpo.0.loss.group_size=4"])
    with pytest.raises(ConfigError, match="unknown key 'pad_id'"):
        cfg.load_config(TINY, ["sampling.pad_id=4"])


def test_stage_helpers():
    c = cfg.load_config(TINY)
    loss = c.grpo[0].grpo_config()
    # the update's group size and temperature: the stage's, passed to it by make_grpo_step (not loss fields)
    assert c.grpo[0].group_size == 2 and c.grpo[0].sampling.temperature == 1.0
    assert not hasattr(loss, "group_size") and not hasattr(loss, "temperature")
    assert loss.max_completion_tokens == c.grpo[0].rollout.max_turns * c.grpo[0].sampling.max_new_tokens
    s1 = c.grpo[1]
    assert s1.rollout.context_length == 352 and s1.rollout.max_turns == 3
    assert s1.sampling.temperature == 1.25 and s1.sampling.max_new_tokens == 12
    assert s1.sampling.with_tokenizer((7,), 3).stop_token_ids == (7,) and s1.sampling.with_tokenizer((7,), 3).pad_id == 3
    # stages and eval inherit [sampling] / [rollout] key by key; eval is greedy unless it says otherwise
    assert c.eval.sampling.greedy and c.eval.rollout.max_turns == 3 and c.eval.sampling.max_new_tokens == 16
    assert c.grpo[0].rollout.context_length == c.rollout.context_length
    staged = cfg.load_config(TINY, ["rollout.cache_stages=3"])
    assert staged.grpo[0].rollout.cache_stages == staged.eval.rollout.cache_stages == 3
    assert [s.name for s in c.eval_settings()] == ["random", "optimal"]
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
        "grpo.0.optim.learning_rate=3e-5",
        "sampling.temperature=1.2",
        'eval.settings=["optimal"]',
        "env.params.prompt=reference",  # bare string
        "sft.optim.learning_rate=1",  # an integer literal for a float field
        "grpo.2.steps=5",  # one past the end appends a stage with defaults
        "grpo.0.curriculum.p_max=0.8",
        "model.remat=true",
    ])
    assert c.grpo[0].optim.learning_rate == 3e-5
    assert c.sampling.temperature == 1.2 and c.grpo[0].sampling.temperature == 1.2  # inherited
    assert c.grpo[1].sampling.temperature == 1.25  # its own
    assert c.eval.settings == ("optimal",) and [s.name for s in c.eval_settings()] == ["optimal"]
    assert c.env.params.prompt == "reference"
    assert c.sft.optim.learning_rate == 1.0 and isinstance(c.sft.optim.learning_rate, float)
    assert len(c.grpo) == 3 and c.grpo[2].steps == 5 and c.grpo[2].group_size == GrpoStage().group_size
    assert c.grpo[2].curriculum == ttt.Stage() and c.grpo[0].curriculum.p_max == 0.8
    assert c.model.remat is True and c.model.model_config().remat is True
    assert cfg.parse_override(" a.b = [1, 2] ") == (("a", "b"), [1, 2])


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("sampling.temperature=0", "sampling.temperature", ["> 0"]),
        ("sampling.temperature=inf", "sampling.temperature", ["finite"]),
        ("grpo.1.sampling.temperature=-1", "grpo.1.sampling.temperature", ["> 0"]),
        ("grpo.0.curriculum.p_min=0.9", "grpo.0.curriculum.p_min", ["p_max"]),
        ("grpo.0.curriculum.p_max=1.5", "grpo.0.curriculum.p_max", ["[0, 1]"]),
        ("sft.teacher.explore_prob=-0.1", "sft.teacher.explore_prob", ["[0, 1]"]),
        ("sft.steps=-1", "sft.steps", [">= 0"]),
        ("grpo.0.steps=-3", "grpo.0.steps", [">= 0"]),
        ("grpo.0.group_size=1", "grpo.0.group_size", [">= 2"]),
        ("grpo.0.loss.loss_type=dr_grpo", "grpo.0.loss.loss_type", ["did you mean 'dr-grpo'"]),
        ("grpo.0.loss.num_minibatches=3", "grpo.0.loss.num_minibatches", ["divide"]),
        ("grpo.0.loss.beta=nan", "grpo.0.loss.beta", ["finite"]),
        ("grpo.0.optim.learning_rate=inf", "grpo.0.optim.learning_rate", ["finite"]),
        ("grpo.0.optim.weight_decay=nan", "grpo.0.optim.weight_decay", ["finite"]),
        ("grpo.0.optim.max_grad_norm=nan", "grpo.0.optim.max_grad_norm", ["finite"]),
        ('eval.settings=["optimal", "strong"]', "eval.settings.1", ["no evaluation setting 'strong'"]),
        ("env.params.invalid_penalty=0.5", "env.params.invalid_penalty", ["<= 0"]),
        ("env.params.prompt=short", "env.params.prompt", ["'compact'"]),
        ("env.name=tictacto", "env.name", ["did you mean 'tictactoe'"]),
        ("model.preset=tinny", "model.preset", ["did you mean 'tiny'"]),
        ("model.num_hidden_layers=3", "model.num_hidden_layers", ["layer_types"]),
        ('model.layer_types=["conv", "attn", "conv", "conv"]', "model.layer_types.1", ["'attn'"]),
        ("model.dtype=float8", "model.dtype", ["bfloat16"]),
        ("rollout.context_length=8", "rollout.context_length", [">= 16"]),
        ("rollout.cache_stages=0", "rollout.cache_stages", [">= 1"]),
        ("eval.batch_size=-1", "eval.batch_size", [">= 0"]),
        ("rollout.max_turns=0", "rollout.max_turns", [">= 1"]),
        ("sampling.max_new_tokens=400", "grpo.0.sampling.max_new_tokens", ["context length"]),
        ("grpo.1.sampling.max_new_tokens=352", "grpo.1.sampling.max_new_tokens", ["context length 352"]),
        ("sft.seq_len=100000", "sft.seq_len", ["max_position_embeddings"]),
        ("mesh.data=0", "mesh.data", ["-1"]),
        ("checkpoint.keep=0", "checkpoint.keep", [">= 1"]),
        ("run.seed=-1", "run.seed", ["in 0.."]),
        ("run.seed=9223372036854775808", "run.seed", ["in 0.."]),
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


def test_a_greedy_grpo_stage_still_needs_a_temperature_above_0():
    """Greedy sampling accepts temperature 0, but the GRPO update divides the logits by the stage's sampling
    temperature: a stage refuses it (as when GrpoConfig held a copy of it)."""
    with pytest.raises(ConfigError) as info:
        cfg.load_config(TINY, ["grpo.0.sampling.greedy=true", "grpo.0.sampling.temperature=0"])
    assert info.value.key == "grpo.0.sampling.temperature" and "> 0" in str(info.value)
    assert cfg.load_config(TINY, ["grpo.0.sampling.greedy=true"]).grpo[0].sampling.temperature == 1.0
    assert cfg.load_config(TINY, ["eval.sampling.temperature=0"]).eval.sampling.temperature == 0.0  # eval: no update


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("sampling.temperature=hot", "sampling.temperature", ["expected a float", "string 'hot'"]),
        ("sampling.top_k=1.5", "sampling.top_k", ["expected an integer", "float 1.5"]),
        ("run.seed=true", "run.seed", ["expected an integer", "boolean true"]),
        ("eval.sampling.greedy=1", "eval.sampling.greedy", ["expected a boolean", "integer 1"]),
        ("eval.settings=random", "eval.settings", ["expected an array of strings", "string 'random'"]),
        ("eval.settings=[1]", "eval.settings.0", ["expected a string", "integer 1"]),
        ("run.output_dir=3", "run.output_dir", ["expected a string"]),
        ("model.vocab_size=big", "model.vocab_size", ["expected an integer", "string 'big'"]),
        ("sampling=3", "sampling", ["expected a table"]),
        ("grpo.0=3", "grpo.0", ["expected a table"]),
        ("env.params.win_value=[1]", "env.params.win_value", ["expected a float"]),
        ("grpo.0.curriculum=3", "grpo.0.curriculum", ["expected a table"]),
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
        ("grpo.0.optim.learnig_rate=1e-5", "grpo.0.optim.learnig_rate", "did you mean 'learning_rate'"),
        ("grpo.0.learning_rate=1e-5", "grpo.0.learning_rate", "grpo.N.optim.learning_rate"),
        ("env.params.promt=tiny", "env.params.promt", "did you mean 'prompt'"),
        ("model.hiden_size=3", "model.hiden_size", "did you mean 'hidden_size'"),
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
    typo.write_text("[[grpo]]\nsteps = 1\n\n[[grpo]]\n[grpo.sampling]\ntemperatur = 1.0\n")
    with pytest.raises(ConfigError) as info:
        cfg.load_config(typo)
    assert info.value.key == "grpo.1.sampling.temperatur" and "typo.toml" in str(info.value)
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
    assert cfg.load_config(path).model.model_config().vocab_size == 576  # overrides equal to the checkpoint's
    with pytest.raises(ConfigError) as info:
        cfg.load_config(path, [f"model.hidden_size={2 * saved.hidden_size}"])
    assert info.value.key == "model.hidden_size"
    assert f"checkpoint has {saved.hidden_size}" in str(info.value) and "init_from" in str(info.value)


def test_python_construction_errors_name_the_field():
    from jaxrl_llm.generate import SamplingConfig

    with pytest.raises(ConfigError) as info:
        SamplingConfig(temperature=0.0)
    assert info.value.key == "temperature" and isinstance(info.value, ValueError)
    assert str(info.value).startswith("SamplingConfig.temperature:")
    with pytest.raises(ConfigError) as info:
        GrpoStage(sampling=SamplingConfig(max_new_tokens=2000))
    assert info.value.key == "sampling.max_new_tokens"
    stage = GrpoStage(curriculum=ttt.Stage())
    assert ExperimentConfig(grpo=[stage]).grpo == (stage,)  # lists become tuples
    with pytest.raises(ConfigError, match="expected the Stage of env 'tictactoe', got Params"):
        ExperimentConfig(grpo=(GrpoStage(curriculum=ttt.Params()),))


# ---- dumping ---------------------------------------------------------------------------------------------


def test_round_trip():
    configs = [
        ExperimentConfig(),
        ExperimentConfig(grpo=(GrpoStage(), GrpoStage(curriculum=ttt.Stage(0.0, 0.25),
                                                      loss=GrpoConfig(ratio_mask_low=0.5)))),
        cfg.load_config(TINY),
        cfg.load_config(CPU),
        cfg.loads_config("", [
            'run.output_dir="runs/a \\"quoted\\" dir\\\\x é\\t"',
            'tokenizer.path="/tmp/tok"',
            "model.init_from=/models/LFM2-350M",
            "model.dtype=bfloat16",
            "sampling.top_p=0.95",
            "grpo.0.loss.max_completion_tokens=100",
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
    assert "context_length = 352" in text and "[grpo.curriculum]" in text and "[env.params]" in text
    assert text.index("steps = ") < text.index("learning_rate")  # a stage's own fields first
