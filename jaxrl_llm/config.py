"""Experiment configuration: frozen dataclasses loaded from TOML, validated before anything compiles.

An experiment is one `ExperimentConfig`, composed of sections named as the TOML tables:

    [model]       architecture: a preset of `models.lfm2.PRESETS` or an HF folder (`init_from`), overrides
    [tokenizer]   path (absent = the project's own tokenizer)
    [prompt]      preset: "reference", "compact" or "tiny" (`jaxrl_llm.text.PRESETS`)
    [env]         `envs.tictactoe.EnvParams` fields (reward values and weights, base max_turns)
    [sampling]    temperature, top_k, top_p, max_new_tokens (the base; GRPO stages set their own)
    [rollout]     context_length, cache_stages
    [sft]         steps, batch_size, num_games, teacher_random_move_prob, seq_len + optimizer fields
    [[grpo]]      a list of stages: steps, num_prompts, group_size, difficulty [p_min, p_max], sampling,
                  max_turns, the GRPO loss fields (named as `jaxrl_llm.grpo.GrpoConfig`) + optimizer fields
    [eval]        num_games, max_turns, opponents, greedy / temperature
    [checkpoint]  dir, keep, every_steps, async_save, resume
    [mesh]        data, fsdp axis sizes (-1 = all remaining devices)
    [run]         output_dir, seed, log_every, sample_every

Every section is a frozen, hashable dataclass (tuples, never lists), so a section can be a static jit
argument. The optimizer fields of `[sft]` and of each `[[grpo]]` stage are flat in the TOML table
(`sft.learning_rate`, `grpo.0.learning_rate`); `section.optim` builds the `optim.OptimConfig`.

Loading (`load_config(path, ["grpo.0.learning_rate=3e-5", ...])`) checks every key and value and raises
`ConfigError` (a ValueError) naming the TOML key path: an unknown key (with the closest valid key), a
wrong type (field, expected type, the value got) or an out-of-range value. `dump_config` writes the TOML
text that loads back to an equal config (a checkpoint stores it; a run is reproduced from it).

Optional fields (`X | None`) always default to None, which TOML writes by leaving the key out.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from envs.tictactoe import EnvParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ModelSection",
    "TokenizerSection",
    "PromptSection",
    "SamplingSection",
    "RolloutSection",
    "SftSection",
    "GrpoStage",
    "EvalSection",
    "CheckpointSection",
    "MeshSection",
    "RunSection",
    "ExperimentConfig",
    "load_config",
    "loads_config",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "apply_overrides",
    "parse_override",
    "OPPONENTS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
]

# Values accepted by jaxrl_llm.grpo.GrpoConfig (kept in step with it; grpo.py is not imported here).
LOSS_TYPES = ("token-mean", "sequence-mean-token-mean", "dr-grpo")
SCALE_REWARDS = ("group", "none")
# Evaluation opponents by name -> the opponent's random_move_prob.
OPPONENTS: dict[str, float] = {"random": 1.0, "optimal": 0.0}
SCHEDULES = ("cosine", "linear", "constant")
DTYPES = ("float32", "bfloat16", "float16")
PROMPT_PRESETS = ("reference", "compact", "tiny")  # jaxrl_llm.text.PRESETS (checked against it when importable)


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """An invalid configuration; `path` is the TOML key path (e.g. ("grpo", "0", "temperature"))."""

    def __init__(self, reason: str, path: Sequence[str | int] = ()):
        self.reason = reason
        self.path = tuple(str(p) for p in path)
        super().__init__(f"{'.'.join(self.path)}: {reason}" if self.path else reason)

    @property
    def key(self) -> str:
        """The dotted key path, e.g. "grpo.0.temperature" ("" for the whole config)."""
        return ".".join(self.path)

    def prefixed(self, *prefix: str | int) -> ConfigError:
        """The same error one or more levels further out."""
        return ConfigError(self.reason, (*prefix, *self.path))


def _fail(field: str, reason: str) -> None:
    raise ConfigError(reason, (field,))


# ----------------------------------------------------------------------------------------------------------
# Types: checking and coercing a value against a field's annotation
# ----------------------------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _toml_type(value: Any) -> str:
    """How TOML would name the value's type (for error messages)."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, np.integer)):
        return f"integer {value}"
    if isinstance(value, (float, np.floating)):
        return f"float {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return f"array {list(value)!r}"
    if value is None:
        return "nothing (None)"
    return f"{type(value).__name__} {value!r}"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "a boolean"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a float"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return "a table"
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        inner = _type_name(args[0]).split(" ", 1)[1] if args else "value"
        return f"an array of {inner}s" if not dataclasses.is_dataclass(args[0]) else "an array of tables"
    if _is_union(tp):
        parts = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Checks `value` against annotation `tp`; returns it normalised (int -> float, list -> tuple, table ->
    dataclass). Raises ConfigError (path relative to the value)."""
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"expected {_type_name(tp)}, got {_toml_type(value)}")
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected {_type_name(tp)}, got {_toml_type(value)}")
        item = args[0] if args else Any
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_coerce(v, item))
            except ConfigError as e:
                raise e.prefixed(i) from None
        return tuple(out)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    if tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
    elif tp is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - an annotation this module does not use
        raise TypeError(f"unsupported annotation {tp!r}")
    raise ConfigError(f"expected {_type_name(tp)}, got {_toml_type(value)}")


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _unknown_key(cls: type, key: str) -> ConfigError:
    names = [f.name for f in _init_fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    elsewhere = sorted({k for k in _all_keys(ExperimentConfig) if k.rsplit(".", 1)[-1] == key})
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if elsewhere:
        hint += f" ({key!r} is a key of {', '.join(k.rsplit('.', 1)[0] for k in elsewhere)})"
    if not close:
        hint += f"; valid keys here: {', '.join(names)}"
    return ConfigError(f"unknown key {key!r}{hint}", (key,))


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a section class (GRPO stages as "grpo.N.<key>")."""
    keys = []
    hints = _hints(cls)
    for f in _init_fields(cls):
        tp = hints[f.name]
        name = prefix + f.name
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, name + ".")
        elif typing.get_origin(tp) is tuple and typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            keys += _all_keys(typing.get_args(tp)[0], name + ".N.")
        else:
            keys.append(name)
    return keys


_FOREIGN_FIELD = re.compile(r"^\s*[A-Za-z_]\w*\.(\w+)")


def _build(cls: type, data: Any) -> Any:
    """A table (Mapping) -> an instance of dataclass `cls`, every key and value checked."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a table, got {_toml_type(data)}")
    names = {f.name for f in _init_fields(cls)}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(cls, str(key))
        try:
            kwargs[key] = _coerce(value, hints[key])
        except ConfigError as e:
            raise e.prefixed(key) from None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a class of another module (EnvParams): find the field it names
        match = _FOREIGN_FIELD.match(str(e))
        field = match.group(1) if match and match.group(1) in names else None
        raise ConfigError(str(e), (field,) if field else ()) from None


@dataclasses.dataclass(frozen=True)
class _Section:
    """Base of the sections: checks/coerces every field against its annotation, then `_validate`."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in _init_fields(type(self)):
            try:
                value = _coerce(getattr(self, f.name), hints[f.name])
            except ConfigError as e:
                raise e.prefixed(f.name) from None
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        pass


def _positive(section: Any, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 1:
            _fail(name, f"must be >= 1 (got {getattr(section, name)})")


def _non_negative(section: Any, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 0:
            _fail(name, f"must be >= 0 (got {getattr(section, name)})")


def _probability(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not 0.0 <= value <= 1.0:
            _fail(name, f"must be a probability in [0, 1] (got {value})")


def _choice(section: Any, name: str, choices: Sequence[str]) -> None:
    value = getattr(section, name)
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        _fail(name, f"must be one of {', '.join(map(repr, choices))} (got {value!r}){hint}")


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# Architecture fields that change parameter shapes (with model.init_from they must equal the checkpoint's).
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "layer_types")


@dataclasses.dataclass(frozen=True)
class ModelSection(_Section):
    """The model: `preset` (a name of `models.lfm2.PRESETS`) or, when set, `init_from` (a Hugging Face
    LFM2 folder: architecture from its config.json, weights loaded from it; `preset` is then unused).
    Every other field, when set, overrides the architecture's value."""

    preset: str = "tiny"
    init_from: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    layer_types: tuple[str, ...] | None = None
    max_position_embeddings: int | None = None
    dtype: str | None = None
    param_dtype: str | None = None
    remat: bool | None = None
    attention_row_block: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The Lfm2Config fields this section sets (the non-None overrides)."""
        skip = ("preset", "init_from")
        return {f.name: getattr(self, f.name) for f in _init_fields(type(self))
                if f.name not in skip and getattr(self, f.name) is not None}

    def lfm2_config(self):
        """-> models.lfm2.Lfm2Config: the preset (or `init_from`'s config.json) with the overrides applied."""
        from models import lfm2

        if self.init_from is not None:
            saved = lfm2.Lfm2Config.from_pretrained(self.init_from)
            clash = [name for name in _SHAPE_FIELDS if getattr(self, name) is not None
                     and tuple(_as_tuple(getattr(self, name))) != tuple(_as_tuple(getattr(saved, name)))]
            if clash:
                detail = ", ".join(f"model.{n} = {getattr(self, n)!r} (the checkpoint has {getattr(saved, n)!r})"
                                   for n in clash)
                raise ConfigError(
                    f"model.init_from = {self.init_from!r} fixes the architecture (its config.json) and {detail} "
                    f"would not fit its weights; remove the override or make it match", ("model", clash[0]))
            return dataclasses.replace(saved, **self.overrides())
        return dataclasses.replace(lfm2.PRESETS[self.preset], **self.overrides())

    def _validate(self) -> None:
        from models import lfm2

        if self.init_from is None:
            _choice(self, "preset", tuple(lfm2.PRESETS))
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) is not None:
                _choice(self, name, DTYPES)
        if self.layer_types is not None:
            for i, kind in enumerate(self.layer_types):
                if kind not in lfm2.LAYER_TYPES:
                    raise ConfigError(f"unknown layer type {kind!r}; use 'conv' or 'full_attention'",
                                      ("layer_types", i))
        if self.init_from is None:  # the architecture is known now: check it (no file access, no compile)
            try:
                self.lfm2_config()
            except ValueError as e:
                named = re.findall(r"\w+", str(e))
                field = next((n for n in named if n in self.overrides()), None)
                raise ConfigError(f"{e} (preset {self.preset!r} with the overrides)",
                                  (field,) if field else ()) from None


@dataclasses.dataclass(frozen=True)
class TokenizerSection(_Section):
    """`path`: a Hugging Face tokenizer folder; None = the project's tokenizer (`tokenizer.load_tokenizer`)."""

    path: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptSection(_Section):
    """`preset`: the prompt style, "reference" (the spec's text), "compact" (a short system prompt) or "tiny"
    (short messages too, for models trained from scratch)."""

    preset: str = "reference"

    def _validate(self) -> None:
        _choice(self, "preset", PROMPT_PRESETS)


@dataclasses.dataclass(frozen=True)
class SamplingSection(_Section):
    """Base sampling of replies (evaluation, samples; GRPO stages set their own temperature and length)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64

    def _validate(self) -> None:
        if not self.temperature > 0:
            _fail("temperature", f"must be > 0 (got {self.temperature}); use eval.greedy for argmax decoding")
        _non_negative(self, "top_k")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1] (got {self.top_p}); 1.0 disables it")
        _positive(self, "max_new_tokens")

    def to_sampling_config(self, stop_token_ids: Sequence[int] = (), pad_id: int = 0, **changes: Any):
        """-> sampling.SamplingConfig with these fields, the tokenizer's stop ids / pad id, and `changes`."""
        from jaxrl_llm.sampling import SamplingConfig

        fields = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      max_new_tokens=self.max_new_tokens, stop_token_ids=tuple(stop_token_ids), pad_id=pad_id)
        fields.update(changes)
        return SamplingConfig(**fields)


@dataclasses.dataclass(frozen=True)
class RolloutSection(_Section):
    """`context_length`: positions of a game's conversation buffer and model cache. `cache_stages`: grow
    the model cache with the conversation in this many steps (`rollout.RolloutConfig.cache_stages`;
    attention then reads a cache sized to the turns played so far; 1 = one full-size cache)."""

    context_length: int = 1024
    cache_stages: int = 1

    def _validate(self) -> None:
        if self.context_length < 16:
            _fail("context_length", f"must be >= 16 (got {self.context_length})")
        if self.cache_stages < 1:
            _fail("cache_stages", f"must be >= 1 (got {self.cache_stages})")


_OPTIM_FIELDS = ("learning_rate", "warmup_steps", "total_steps", "schedule", "end_lr_ratio", "weight_decay",
                 "b1", "b2", "eps", "max_grad_norm")


@dataclasses.dataclass(frozen=True)
class _OptimFields(_Section):
    """Optimizer fields shared by `[sft]` and each `[[grpo]]` stage (see optim.OptimConfig);
    `total_steps` None = the section's `steps`."""

    learning_rate: float = 1e-4
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    @property
    def optim(self):
        """-> optim.OptimConfig of this section (total_steps defaults to `steps`, at least 1)."""
        from jaxrl_llm.optim import OptimConfig

        total = self.total_steps if self.total_steps is not None else max(getattr(self, "steps", 1), 1)
        return OptimConfig(**{name: getattr(self, name) for name in _OPTIM_FIELDS if name != "total_steps"},
                           total_steps=total)

    def _validate(self) -> None:
        if not self.learning_rate > 0:
            _fail("learning_rate", f"must be > 0 (got {self.learning_rate})")
        _non_negative(self, "warmup_steps", "weight_decay", "max_grad_norm")
        if self.total_steps is not None:
            _positive(self, "total_steps")
        _choice(self, "schedule", SCHEDULES)
        _probability(self, "end_lr_ratio")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(name, f"must be in [0, 1) (got {getattr(self, name)})")
        if not self.eps > 0:
            _fail("eps", f"must be > 0 (got {self.eps})")


@dataclasses.dataclass(frozen=True)
class SftSection(_OptimFields):
    """Supervised fine-tuning on teacher games (steps 0 skips it).

    num_games: teacher games generated for the data set; teacher_random_move_prob: how often the teacher
    plays a random legal move instead of a minimax-optimal one (its replies stay well formatted);
    teacher: "uniform" (a uniform draw among the optimal moves) or "best" (the optimal move that wins most
    often against the random opponent, deterministic); reasoning: "templates" (a short templated thought in
    <think>) or "none" (an empty <think></think>); the teacher's opponent plays at p =
    opponent_random_move_prob, or at p uniform in [opponent_random_move_prob, opponent_p_max] when that is
    set; tree_copies: copies of every game the "best" teacher can meet (its whole game tree, 738 games, see
    `sft_data.exhaustive_expert_games`) added to the num_games sampled ones; check_every: every that many steps
    (0: never) check teacher-forced, greedy, whether the model reproduces every game of that tree exactly
    (teacher "best" only; logged as check_exact); stop_when_exact: end SFT at the first exact check (`steps`
    is then the most it runs); seq_len: tokens per training row (a game is cut or padded to it); dataset: train on this prompt /
    completion data set instead (a `save_to_disk` folder, a .jsonl / .parquet file, or a local copy of
    `anakin87/tictactoe-filtered`), None generates the expert games."""

    steps: int = 100
    batch_size: int = 32
    num_games: int = 1000
    teacher_random_move_prob: float = 0.0
    teacher: str = "uniform"
    reasoning: str = "templates"
    seq_len: int = 768
    opponent_random_move_prob: float = 0.5
    opponent_p_max: float | None = None
    tree_copies: int = 0
    check_every: int = 0
    stop_when_exact: bool = False
    dataset: str | None = None

    def opponent_p_range(self) -> tuple[float, float]:
        """(p_min, p_max) of the teacher's opponent."""
        p_max = self.opponent_random_move_prob if self.opponent_p_max is None else self.opponent_p_max
        return self.opponent_random_move_prob, p_max

    def _validate(self) -> None:
        _non_negative(self, "steps")
        _positive(self, "batch_size", "num_games")
        if self.seq_len < 16:
            _fail("seq_len", f"must be >= 16 (got {self.seq_len})")
        _probability(self, "teacher_random_move_prob", "opponent_random_move_prob")
        _choice(self, "teacher", ("uniform", "best"))
        _choice(self, "reasoning", ("templates", "none"))
        _non_negative(self, "tree_copies", "check_every")
        if (self.check_every or self.stop_when_exact) and self.teacher != "best":
            _fail("check_every", "the game-tree check needs teacher = \"best\"")
        if self.stop_when_exact and not self.check_every:
            _fail("stop_when_exact", "needs check_every > 0")
        if self.tree_copies and (self.teacher != "best" or self.teacher_random_move_prob > 0):
            _fail("tree_copies", "needs the deterministic teacher: teacher = \"best\" and "
                                 "teacher_random_move_prob = 0")
        if self.opponent_p_max is not None:
            _probability(self, "opponent_p_max")
            if self.opponent_p_max < self.opponent_random_move_prob:
                _fail("opponent_p_max", f"must be >= opponent_random_move_prob ({self.opponent_random_move_prob}), "
                      f"got {self.opponent_p_max}")
        super()._validate()


# GRPO loss fields (named as jaxrl_llm.grpo.GrpoConfig's), minus `temperature`, handled apart.
_GRPO_FIELDS = ("group_size", "scale_rewards", "std_eps", "epsilon_low", "epsilon_high", "beta", "loss_type",
                "max_completion_tokens", "ratio_mask_low", "ratio_mask_high", "num_minibatches", "passes",
                "grad_accum_steps", "shuffle")


@dataclasses.dataclass(frozen=True)
class GrpoStage(_OptimFields):
    """One GRPO stage: `steps` updates, each on `num_prompts` examples x `group_size` rollouts whose
    opponent strength is stratified over [p_min, p_max] (random_move_prob). The replies are sampled at
    `temperature` with at most `max_new_tokens` per turn, for at most `max_turns` replies per game;
    `context_length` None = rollout.context_length. The loss fields are those of grpo.GrpoConfig
    (`grpo_fields()`); `max_completion_tokens` None = max_turns * max_new_tokens."""

    steps: int = 100
    num_prompts: int = 32
    group_size: int = 8
    p_min: float = 0.2
    p_max: float = 0.7
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_turns: int = 7
    context_length: int | None = None
    scale_rewards: str = "group"
    std_eps: float = 1e-4
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: str = "token-mean"
    max_completion_tokens: int | None = None
    ratio_mask_low: float | None = None
    ratio_mask_high: float | None = None
    num_minibatches: int = 1
    passes: int = 1
    grad_accum_steps: int = 1
    shuffle: bool = True

    @property
    def batch_size(self) -> int:
        """Rollouts per update: num_prompts * group_size."""
        return self.num_prompts * self.group_size

    def grpo_fields(self) -> dict[str, Any]:
        """The keyword arguments of grpo.GrpoConfig: `GrpoConfig(**stage.grpo_fields())`."""
        fields = {name: getattr(self, name) for name in _GRPO_FIELDS}
        if fields["max_completion_tokens"] is None:
            fields["max_completion_tokens"] = self.max_turns * self.max_new_tokens
        fields["temperature"] = self.temperature
        return fields

    def env_params(self, base: EnvParams) -> EnvParams:
        """The environment of this stage: `base` with this stage's max_turns."""
        return dataclasses.replace(base, max_turns=self.max_turns)

    def _validate(self) -> None:
        _non_negative(self, "steps")
        _positive(self, "num_prompts", "max_new_tokens", "max_turns", "num_minibatches", "passes",
                  "grad_accum_steps")
        if self.group_size < 2:
            _fail("group_size", f"must be >= 2 (got {self.group_size}): a group of one has no baseline")
        _probability(self, "p_min", "p_max")
        if self.p_min > self.p_max:
            _fail("p_min", f"must be <= p_max (got p_min {self.p_min} > p_max {self.p_max})")
        if not self.temperature > 0:
            _fail("temperature", f"must be > 0 (got {self.temperature})")
        if self.context_length is not None and self.context_length < 16:
            _fail("context_length", f"must be >= 16 (got {self.context_length})")
        _choice(self, "scale_rewards", SCALE_REWARDS)
        _choice(self, "loss_type", LOSS_TYPES)
        if not self.std_eps > 0:
            _fail("std_eps", f"must be > 0 (got {self.std_eps})")
        if not 0.0 <= self.epsilon_low < 1.0:
            _fail("epsilon_low", f"must be in [0, 1) (got {self.epsilon_low})")
        _non_negative(self, "epsilon_high", "beta")
        if self.max_completion_tokens is not None:
            _positive(self, "max_completion_tokens")
        if self.ratio_mask_low is not None and not 0.0 <= self.ratio_mask_low < 1.0:
            _fail("ratio_mask_low", f"must be in [0, 1) (got {self.ratio_mask_low})")
        if self.ratio_mask_high is not None and not self.ratio_mask_high > 1.0:
            _fail("ratio_mask_high", f"must be > 1 (got {self.ratio_mask_high})")
        micro = self.num_minibatches * self.grad_accum_steps
        if self.batch_size % micro:
            _fail("num_minibatches", f"num_minibatches * grad_accum_steps ({micro}) must divide the batch "
                                     f"num_prompts * group_size ({self.batch_size})")
        super()._validate()


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
    """Evaluation: `num_games` games against each of `opponents` ("random" p = 1, "optimal" p = 0), at most
    `max_turns` replies; greedy decoding or sampling at `temperature`. every_steps: also evaluate during
    training every N GRPO steps, into <run.output_dir>/eval_metrics.jsonl (0 = never during training)."""

    num_games: int = 100
    max_turns: int = 8
    opponents: tuple[str, ...] = ("random", "optimal")
    greedy: bool = True
    temperature: float = 1.0
    every_steps: int = 0

    def opponent_probs(self) -> tuple[float, ...]:
        """random_move_prob of each opponent, in order."""
        return tuple(OPPONENTS[name] for name in self.opponents)

    def _validate(self) -> None:
        _positive(self, "num_games", "max_turns")
        _non_negative(self, "every_steps")
        if not self.opponents:
            _fail("opponents", f"needs at least one opponent of {', '.join(map(repr, OPPONENTS))}")
        for i, name in enumerate(self.opponents):
            if name not in OPPONENTS:
                raise ConfigError(f"unknown opponent {name!r}; use {' or '.join(map(repr, OPPONENTS))}",
                                  ("opponents", i))
        if not self.temperature > 0:
            _fail("temperature", f"must be > 0 (got {self.temperature})")


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
    """Checkpoints: `dir` (None = <run.output_dir>/checkpoints), the last `keep` kept, one every
    `every_steps` steps (0 = only at the end of each stage), asynchronous writes (`async_save`), and
    `resume` from the latest checkpoint in `dir` when there is one."""

    dir: str | None = None
    keep: int = 3
    every_steps: int = 100
    async_save: bool = True
    resume: bool = True

    def _validate(self) -> None:
        _positive(self, "keep")
        _non_negative(self, "every_steps")


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    """Device mesh axis sizes: `data` (replicated params, split batch) x `fsdp` (params and batch split);
    -1 = all the devices the other axis leaves."""

    data: int = -1
    fsdp: int = 1

    def _validate(self) -> None:
        for name in ("data", "fsdp"):
            if getattr(self, name) != -1 and getattr(self, name) < 1:
                _fail(name, f"must be >= 1, or -1 for all remaining devices (got {getattr(self, name)})")
        if self.data == -1 and self.fsdp == -1:
            _fail("fsdp", "only one of data and fsdp can be -1")

    def axis_sizes(self, num_devices: int) -> tuple[int, int]:
        """-> (data, fsdp) with -1 resolved; raises ConfigError unless data * fsdp == num_devices."""
        data, fsdp = self.data, self.fsdp
        if data == -1:
            data = num_devices // fsdp if num_devices % fsdp == 0 else 0
        if fsdp == -1:
            fsdp = num_devices // data if num_devices % data == 0 else 0
        if data < 1 or fsdp < 1 or data * fsdp != num_devices:
            raise ConfigError(f"data {self.data} x fsdp {self.fsdp} does not fit {num_devices} devices", ("mesh",))
        return data, fsdp


@dataclasses.dataclass(frozen=True)
class RunSection(_Section):
    """The run: `output_dir` (metrics, checkpoints, plots), `seed`, a metrics line every `log_every`
    steps and a printed sample game every `sample_every` steps (0 = never)."""

    output_dir: str = "runs/default"
    seed: int = 0
    log_every: int = 1
    sample_every: int = 0

    def _validate(self) -> None:
        _positive(self, "log_every")
        _non_negative(self, "seed", "sample_every")
        if not self.output_dir:
            _fail("output_dir", "must not be empty")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(_Section):
    """A whole experiment (see the module docstring). Frozen and hashable."""

    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    prompt: PromptSection = PromptSection()
    env: EnvParams = EnvParams()
    sampling: SamplingSection = SamplingSection()
    rollout: RolloutSection = RolloutSection()
    sft: SftSection = SftSection()
    grpo: tuple[GrpoStage, ...] = ()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    run: RunSection = RunSection()

    def stage_context_length(self, stage: int) -> int:
        """Context length of GRPO stage `stage` (its own, else rollout.context_length)."""
        own = self.grpo[stage].context_length
        return own if own is not None else self.rollout.context_length

    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <run.output_dir>/checkpoints."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else os.path.join(self.run.output_dir,
                                                                                        "checkpoints")

    def rollout_config(self, stage: int | None = None, stop_token_ids: Sequence[int] = (), pad_id: int = 0):
        """-> rollout.RolloutConfig for GRPO stage `stage` (None: evaluation, with eval's max_turns and
        greedy / temperature, the base max_new_tokens and context length)."""
        from jaxrl_llm.rollout import RolloutConfig

        if stage is None:
            sampling = self.sampling.to_sampling_config(stop_token_ids, pad_id, greedy=self.eval.greedy,
                                                        temperature=self.eval.temperature)
            env = dataclasses.replace(self.env, max_turns=self.eval.max_turns)
            return RolloutConfig(context_length=self.rollout.context_length, sampling=sampling, env=env,
                                 cache_stages=self.rollout.cache_stages)
        s = self.grpo[stage]
        sampling = self.sampling.to_sampling_config(stop_token_ids, pad_id, temperature=s.temperature,
                                                    max_new_tokens=s.max_new_tokens)
        return RolloutConfig(context_length=self.stage_context_length(stage), sampling=sampling,
                             env=s.env_params(self.env), cache_stages=self.rollout.cache_stages)

    def _validate(self) -> None:
        max_pos = None
        if self.model.init_from is None:
            max_pos = self.model.lfm2_config().max_position_embeddings
            if self.rollout.context_length > max_pos:
                _fail("rollout", f"context_length {self.rollout.context_length} exceeds the model's "
                                 f"max_position_embeddings {max_pos}")
            if self.sft.seq_len > max_pos:
                raise ConfigError(f"exceeds the model's max_position_embeddings {max_pos}", ("sft", "seq_len"))
        if self.sampling.max_new_tokens >= self.rollout.context_length:
            raise ConfigError(f"must be below rollout.context_length {self.rollout.context_length}",
                              ("sampling", "max_new_tokens"))
        for i, stage in enumerate(self.grpo):
            ctx = self.stage_context_length(i)
            if stage.max_new_tokens >= ctx:
                raise ConfigError(f"must be below the stage's context length {ctx}", ("grpo", i, "max_new_tokens"))
            if max_pos is not None and ctx > max_pos:
                raise ConfigError(f"{ctx} exceeds the model's max_position_embeddings {max_pos}",
                                  ("grpo", i, "context_length"))


# ----------------------------------------------------------------------------------------------------------
# Loading, overrides
# ----------------------------------------------------------------------------------------------------------


def _parse_literal(text: str) -> Any:
    """A TOML literal ("3e-5", "true", '["optimal"]', '"x"'), else the bare text as a string."""
    text = text.strip()
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """"grpo.0.learning_rate=3e-5" -> (("grpo", "0", "learning_rate"), 3e-05); the value is a TOML literal,
    else a bare string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. sampling.temperature=1.2)")
    key, value = text.split("=", 1)
    parts = tuple(p.strip() for p in key.strip().split("."))
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part")
    return parts, _parse_literal(value)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw TOML dict with each "dotted.key=value" set. A list index may be one past the end
    (`grpo.2.steps=10` on two stages appends a stage with defaults)."""
    data = copy.deepcopy(dict(data))
    for text in overrides or ():
        parts, value = parse_override(text)
        node: Any = data
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the config"
            if isinstance(node, list):
                if not part.isdigit():
                    raise ConfigError(f"{where} is a list: use an index, not {part!r}", parts[: depth + 1])
                index = int(part)
                if index > len(node):
                    raise ConfigError(f"{where} has {len(node)} entries: use an index up to {len(node)} "
                                      f"({len(node)} appends one)", parts[: depth + 1])
                if index == len(node):
                    node.append({})
                if last:
                    node[index] = value
                else:
                    node = node[index]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if part not in node:
                        node[part] = [] if parts[depth + 1].isdigit() else {}
                    node = node[part]
            else:
                raise ConfigError(f"{where} is a value, not a table", parts[:depth])
    return data


def config_from_dict(data: Mapping[str, Any]) -> ExperimentConfig:
    """Raw TOML data -> a validated ExperimentConfig (ConfigError naming the key path otherwise)."""
    return _build(ExperimentConfig, data)


def _check_paths(config: ExperimentConfig) -> None:
    folder = config.model.init_from
    if folder is not None and not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder!r} is not a folder with a config.json (a Hugging Face LFM2 checkpoint)",
                          ("model", "init_from"))
    if folder is not None:
        config.model.lfm2_config()  # the overrides must fit the checkpoint's architecture
    if config.tokenizer.path is not None and not os.path.exists(config.tokenizer.path):
        raise ConfigError(f"{config.tokenizer.path!r} does not exist", ("tokenizer", "path"))
    if config.sft.dataset is not None and not os.path.exists(config.sft.dataset):
        raise ConfigError(f"{config.sft.dataset!r} does not exist (a save_to_disk folder or a .jsonl/.parquet file)",
                          ("sft", "dataset"))


def loads_config(text: str, overrides: Sequence[str] = (), check_paths: bool = False) -> ExperimentConfig:
    """TOML text (+ overrides) -> ExperimentConfig. check_paths: also check init_from / tokenizer.path exist."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML: {e}") from None
    config = config_from_dict(apply_overrides(data, overrides))
    if check_paths:
        _check_paths(config)
    return config


def load_config(path: str | os.PathLike, overrides: Sequence[str] = (), check_paths: bool = True) -> ExperimentConfig:
    """Reads a TOML preset, applies `--set` overrides ("dotted.key=value", values TOML literals) and
    validates everything; raises ConfigError (a ValueError) naming the key path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        return loads_config(path.read_text(encoding="utf-8"), overrides, check_paths)
    except ConfigError as e:
        raise ConfigError(f"{e.reason} (in {path})", e.path) from None


# ----------------------------------------------------------------------------------------------------------
# Dumping: dict and TOML text
# ----------------------------------------------------------------------------------------------------------


def _dump_order(cls: type) -> list[str]:
    """Field names in writing order: a stage's own fields first, its optimizer fields last."""
    names = [f.name for f in _init_fields(cls)]
    if issubclass(cls, _OptimFields):
        names = [n for n in names if n not in _OPTIM_FIELDS] + [n for n in names if n in _OPTIM_FIELDS]
    return names


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config (or any section) -> plain dict: tuples as lists, None fields left out (TOML has no null)."""

    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {name: convert(getattr(value, name)) for name in _dump_order(type(value))
                    if getattr(value, name) is not None}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value

    return convert(config)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _write_table(lines: list[str], prefix: tuple[str, ...], table: Mapping[str, Any], header: str | None) -> None:
    if header is not None:
        lines.append(header)
    for key, value in table.items():
        if not isinstance(value, Mapping) and not _is_table_array(value):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        path = (*prefix, key)
        dotted = ".".join(_toml_key(p) for p in path)
        if isinstance(value, Mapping):
            lines.append("")
            _write_table(lines, path, value, f"[{dotted}]")
        elif _is_table_array(value):
            for item in value:
                lines.append("")
                _write_table(lines, path, item, f"[[{dotted}]]")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """A minimal TOML writer for config data (tables, arrays of tables, scalars, arrays)."""
    lines: list[str] = []
    _write_table(lines, (), data, None)
    return "\n".join(lines).lstrip("\n") + "\n"


def dump_config(config: ExperimentConfig) -> str:
    """The TOML text of a config; `loads_config(dump_config(c)) == c`."""
    return "# jaxrl_llm experiment config\n" + dumps_toml(config_to_dict(config))
