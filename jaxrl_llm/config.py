"""Experiment configuration: TOML presets loaded into the real config dataclasses, validated before anything compiles.

An experiment is one `ExperimentConfig`. Each TOML table is the dataclass that uses it (one dataclass per
concept, no mirrors here):

    [model]            preset (a name of `models.lfm2.PRESETS`) or init_from (an HF folder), plus any
                       `models.lfm2.Lfm2Config` field as an override            -> ModelSection
    [tokenizer]        path (absent = the project's own tokenizer)              -> TokenizerSection
    [env]              name (a registered env, `envs.make`)                     -> EnvSection
      [env.params]     the env's `Params` (e.g. Tic-Tac-Toe's prompt and rubric)
    [sampling]         `generate.SamplingConfig` (the base for stages and evaluation)
    [rollout]          `rollout.RolloutConfig`: context_length, max_turns, cache_stages (the base)
    [sft]              `algos.sft.SftConfig`; [sft.optim] `algos.optim.OptimConfig`; [sft.teacher] the env's `Teacher`
    [[grpo]]           GrpoStage: steps, num_prompts, group_size; [grpo.curriculum] the env's `Stage`;
                       [grpo.sampling] / [grpo.rollout] override the base key by key; [grpo.loss]
                       `algos.grpo.GrpoConfig`; [grpo.optim] `algos.optim.OptimConfig`
    [eval]             num_games, settings (names of the env's evaluation settings), every_steps;
                       [eval.sampling] (over the base, greedy by default) and [eval.rollout] likewise
    [checkpoint]       dir, keep, every_steps, async_save, resume
    [mesh]             data, fsdp axis sizes (-1 = all remaining devices)
    [lora]             `models.lora.LoraConfig`: rank (0 = off, the default), alpha, dropout, targets
    [run]              output_dir, seed, log_every, sample_every

Every dataclass checks its own fields (`jaxrl_llm.checks`); the loader only reads TOML into them: an
unknown key (with the closest valid key), a wrong type (field, expected type, the value got) or a value
a check refuses raises `ConfigError` (a ValueError) naming the whole key path. Fields whose type belongs
to the env (`checks.EnvBound`) are built once `[env] name` is known. `dump_config` writes the TOML text
that loads back to an equal config (a checkpoint stores it; a run is reproduced from it).

Optional fields (`X | None`) default to None, which TOML writes by leaving the key out.
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
from typing import Annotated, Any, Union

import numpy as np

from jaxrl_llm.algos.grpo import GrpoConfig
from jaxrl_llm.algos.optim import OptimConfig
from jaxrl_llm.algos.sft import SftConfig
from jaxrl_llm.checks import ConfigError, EnvBound, check_choice, check_int, check_str
from jaxrl_llm.generate.sampler import SamplingConfig
from jaxrl_llm.rollout.rollout import RolloutConfig
from models.lora import LoraConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ModelSection",
    "TokenizerSection",
    "EnvSection",
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
]

DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------------------------------------
# Types: checking and coercing a value against a field's annotation
# ----------------------------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
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


def _env_bound(tp: Any) -> EnvBound | None:
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, EnvBound)), None)
    return None


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "a boolean"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a float"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp) or _env_bound(tp):
        return "a table"
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            return "an array of tables"
        inner = _type_name(args[0]).split(" ", 1)[1] if args else "value"
        return f"an array of {inner}s"
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, env_cls: type | None) -> Any:
    """Checks `value` against annotation `tp`; returns it normalised (int -> float, list -> tuple, table ->
    dataclass). env_cls: the experiment's env class, for `EnvBound` fields. Raises ConfigError (path
    relative to the value)."""
    if tp is Any:
        return value
    bound = _env_bound(tp)
    if bound is not None:
        return _coerce_env_bound(value, bound, env_cls)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, env_cls)
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
                out.append(_coerce(v, item, env_cls))
            except ConfigError as e:
                raise e.prefixed(i) from None
        return tuple(out)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, env_cls)
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


def _coerce_env_bound(value: Any, bound: EnvBound, env_cls: type | None) -> Any:
    """A field whose type is the env's `Params` / `Stage` / `Teacher`: None -> its default, a table -> built."""
    cls = getattr(env_cls, bound.attr, None) if env_cls is not None else None
    if cls is None or cls is type(None):
        if env_cls is None:  # constructed in Python without the env: only instances (or None) can be checked later
            if value is None or dataclasses.is_dataclass(value):
                return value
            raise ConfigError(f"a table here needs the env: build the whole ExperimentConfig (from TOML), or pass "
                              f"the env's {bound.attr} instance")
        if value is None:
            return None
        raise ConfigError(f"env {env_cls.name!r} has no {bound.attr}; remove this table")
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value):
        raise ConfigError(f"expected the {bound.attr} of env {env_cls.name!r}, got {type(value).__name__}")
    return _build(cls, value, env_cls)


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("toml", True)]


def _unknown_key(cls: type, key: str) -> ConfigError:
    names = [f.name for f in _init_fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    everywhere = _all_keys(ExperimentConfig)
    elsewhere = sorted({k for k in everywhere if k.rsplit(".", 1)[-1] == key})
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if elsewhere:
        hint += f" ({key!r} is a key of another table: {', '.join(elsewhere)})"
    if not close and not elsewhere:  # a typo of a key that lives in another table
        near = difflib.get_close_matches(key, sorted({k.rsplit(".", 1)[-1] for k in everywhere}), n=1, cutoff=0.75)
        if near:
            hint += f" (did you mean {near[0]!r}, a key of another table: " + ", ".join(
                k for k in everywhere if k.rsplit(".", 1)[-1] == near[0]) + "?)"
    if not close:
        hint += f"; valid keys here: {', '.join(names)}"
    return ConfigError(f"unknown key {key!r}{hint}", (key,))


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a section class (GRPO stages as "grpo.N.<key>"; env-bound tables not expanded)."""
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


def _build(cls: type, data: Any, env_cls: type | None = None) -> Any:
    """A table (Mapping) -> an instance of dataclass `cls`, every key and value checked."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a table, got {_toml_type(data)}")
    if hasattr(cls, "_from_table"):
        return cls._from_table(data, env_cls)
    names = {f.name for f in _init_fields(cls)}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(cls, str(key))
        try:
            kwargs[key] = _coerce(value, hints[key], env_cls)
        except ConfigError as e:
            raise e.prefixed(key) from None
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(e.reason, e.path) from None  # the path says where: drop the class name
    except (ValueError, TypeError) as e:  # a check that does not raise ConfigError: name the class
        raise ConfigError(f"{cls.__name__}: {e}") from None


@dataclasses.dataclass(frozen=True)
class _Section:
    """Base of the config-only sections: checks/coerces every field against its annotation, then `_validate`."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in _init_fields(type(self)):
            try:
                value = _coerce(getattr(self, f.name), hints[f.name], None)
            except ConfigError as e:
                raise ConfigError(e.reason, (f.name, *e.path), type(self).__name__) from None
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# Architecture fields that change parameter shapes (with model.init_from they must equal the checkpoint's).
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "layer_types")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The model: `preset` (a name of `models.lfm2.PRESETS`) or, when set, `init_from` (a Hugging Face
    LFM2 folder: architecture from its config.json, weights loaded from it; `preset` is then unused).
    `arch` holds the `Lfm2Config` fields the TOML table sets besides those two (written flat in `[model]`,
    e.g. `hidden_size = 128`); each overrides the architecture's value."""

    preset: str = "tiny"
    init_from: str | None = None
    arch: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        from models import lfm2

        check_str(self, "preset")
        if self.init_from is not None:
            check_str(self, "init_from")
        arch = dict(self.arch)
        if len(arch) != len(self.arch):
            raise ConfigError("sets a field twice", ("arch",), "ModelSection")
        for name in arch:
            if name in ("preset", "init_from") or name not in _lfm2_hints():
                raise _unknown_model_key(name)
        object.__setattr__(self, "arch", tuple(sorted(arch.items(), key=lambda kv: list(_lfm2_hints()).index(kv[0]))))
        if self.init_from is None:
            check_choice(self, "preset", tuple(lfm2.PRESETS))
        for name in ("dtype", "param_dtype"):
            if arch.get(name) is not None and arch[name] not in DTYPES:
                raise ConfigError(f"must be one of {', '.join(map(repr, DTYPES))} (got {arch[name]!r})", (name,))
        for i, kind in enumerate(arch.get("layer_types") or ()):
            if kind not in lfm2.LAYER_TYPES:
                raise ConfigError(f"unknown layer type {kind!r}; use 'conv' or 'full_attention'", ("layer_types", i))
        if self.init_from is None:  # the architecture is known now: check it (no file access, no compile)
            try:
                self.lfm2_config()
            except ConfigError:
                raise
            except ValueError as e:
                named = re.findall(r"\w+", str(e))
                field = next((n for n in named if n in arch), None)
                raise ConfigError(f"{e} (preset {self.preset!r} with the overrides)", (field,) if field else ()) from None

    def __getattr__(self, name: str) -> Any:
        """`model.hidden_size` etc.: the override this section sets for an Lfm2Config field (None if unset)."""
        if name.startswith("_") or name == "arch" or name not in _lfm2_hints():
            raise AttributeError(f"ModelSection has no attribute {name!r}")
        return dict(self.arch).get(name)

    @classmethod
    def of(cls, preset: str = "tiny", init_from: str | None = None, **overrides: Any) -> "ModelSection":
        """ModelSection.of("cpu-5m", hidden_size=128): the keyword form of the `[model]` table."""
        return cls(preset=preset, init_from=init_from, arch=tuple(overrides.items()))

    @classmethod
    def _from_table(cls, table: Mapping[str, Any], env_cls=None) -> "ModelSection":
        hints = _lfm2_hints()
        kwargs, arch = {}, []
        for key, value in table.items():
            if key in ("preset", "init_from"):
                kwargs[key] = _coerce(value, str, None) if value is not None else None
                continue
            if key not in hints:
                raise _unknown_model_key(key)
            try:
                arch.append((key, _coerce(value, hints[key], None)))
            except ConfigError as e:
                raise e.prefixed(key) from None
        return cls(**kwargs, arch=tuple(arch))

    def _to_table(self) -> dict[str, Any]:
        out: dict[str, Any] = {"preset": self.preset}
        if self.init_from is not None:
            out["init_from"] = self.init_from
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.arch if v is not None})
        return out

    def overrides(self) -> dict[str, Any]:
        """The Lfm2Config fields this section sets."""
        return {k: v for k, v in self.arch if v is not None}

    def lfm2_config(self):
        """-> models.lfm2.Lfm2Config: the preset (or `init_from`'s config.json) with the overrides applied."""
        from models import lfm2

        over = self.overrides()
        if self.init_from is not None:
            saved = lfm2.Lfm2Config.from_pretrained(self.init_from)
            clash = [n for n in _SHAPE_FIELDS if n in over and tuple(_as_tuple(over[n])) != tuple(_as_tuple(getattr(saved, n)))]
            if clash:
                detail = ", ".join(f"model.{n} = {over[n]!r} (the checkpoint has {getattr(saved, n)!r})" for n in clash)
                raise ConfigError(
                    f"model.init_from = {self.init_from!r} fixes the architecture (its config.json) and {detail} "
                    f"would not fit its weights; remove the override or make it match", ("model", clash[0]))
            return dataclasses.replace(saved, **over)
        return dataclasses.replace(lfm2.PRESETS[self.preset], **over)


def _lfm2_hints() -> dict[str, Any]:
    from models.lfm2 import Lfm2Config

    return _hints(Lfm2Config)


def _unknown_model_key(key: str) -> ConfigError:
    names = ["preset", "init_from", *_lfm2_hints()]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(f"unknown key {key!r}{hint} (besides preset and init_from, [model] takes "
                       f"models.lfm2.Lfm2Config fields)", (key,))


@dataclasses.dataclass(frozen=True)
class TokenizerSection(_Section):
    """`path`: a Hugging Face tokenizer folder; None = the project's tokenizer (`text.load_tokenizer`)."""

    path: str | None = None


@dataclasses.dataclass(frozen=True)
class EnvSection(_Section):
    """The environment: `name` (registered with `envs.register`; `envs.make(name, **params)`) and its
    `Params` (the `[env.params]` table)."""

    name: str = dataclasses.field(default_factory=lambda: _default_env_name())
    params: Annotated[Any, EnvBound("Params")] = None

    def _validate(self) -> None:
        check_str(self, "name")

    def env_class(self):
        """The registered Env subclass (ConfigError with the closest names if unknown)."""
        return _env_class(self.name)

    def make(self):
        """The env instance with these params."""
        cls = self.env_class()
        return cls(self.params if self.params is not None else cls.Params())


def _default_env_name() -> str:
    """The env of a config without `[env] name` (`envs.DEFAULT_ENV`)."""
    import envs

    return envs.DEFAULT_ENV


def _env_class(name: str):
    import envs

    try:
        return envs.env_class(name)
    except KeyError as e:
        raise ConfigError(str(e.args[0]) if e.args else str(e), ("env", "name")) from None


@dataclasses.dataclass(frozen=True)
class GrpoStage(_Section):
    """One GRPO stage: `steps` updates, each on `num_prompts` examples x `group_size` rollouts drawn from
    the env's curriculum `Stage` (`curriculum`). `sampling` and `rollout` are the experiment's with this
    stage's `[grpo.sampling]` / `[grpo.rollout]` keys on top; `loss` (GrpoConfig) and `optim`
    (OptimConfig, counted in optimizer updates: total_steps defaulting to steps * passes *
    num_minibatches) are the update's."""

    steps: int = 100
    num_prompts: int = 32
    group_size: int = 8
    curriculum: Annotated[Any, EnvBound("Stage")] = None
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: GrpoConfig = GrpoConfig()
    optim: OptimConfig = OptimConfig()

    def _validate(self) -> None:
        check_int(self, "steps", 0)
        check_int(self, "num_prompts", 1)
        if check_int(self, "group_size", 1) < 2:
            raise ConfigError(f"must be >= 2 (got {self.group_size}): a group of one has no baseline", ("group_size",))
        micro = self.loss.num_minibatches * self.loss.grad_accum_steps
        if self.batch_size % micro:
            raise ConfigError(f"num_minibatches * grad_accum_steps ({micro}) must divide the batch num_prompts * "
                              f"group_size ({self.batch_size})", ("loss", "num_minibatches"))
        if self.sampling.max_new_tokens >= self.rollout.context_length:
            raise ConfigError(f"must be below the stage's context length {self.rollout.context_length}",
                              ("sampling", "max_new_tokens"))
        self.grpo_config()  # the effective loss config must be valid too

    @property
    def batch_size(self) -> int:
        """Rollouts per update: num_prompts * group_size."""
        return self.num_prompts * self.group_size

    def grpo_config(self) -> GrpoConfig:
        """The loss with this stage's group size, its sampling temperature and, when unset,
        max_completion_tokens = max_turns * max_new_tokens."""
        max_completion = self.loss.max_completion_tokens or self.rollout.max_turns * self.sampling.max_new_tokens
        return dataclasses.replace(self.loss, group_size=self.group_size, temperature=self.sampling.temperature,
                                   max_completion_tokens=max_completion)

    def optim_config(self) -> OptimConfig:
        """The optimizer with total_steps resolved. Its schedule counts optimizer updates, of which a GRPO
        step makes `passes * num_minibatches`: the default total is steps * passes * num_minibatches, and
        warmup_steps / total_steps are in updates too."""
        return self.optim.for_steps(self.steps * self.loss.passes * self.loss.num_minibatches)


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
    """Evaluation: `num_games` games in each of `settings` (names of the env's evaluation settings; empty:
    all of them). `sampling` / `rollout`: the experiment's with `greedy = true` and this table's keys on top.
    every_steps: also evaluate during training every N GRPO steps, into <run.output_dir>/eval_metrics.jsonl
    (0 = never during training)."""

    num_games: int = 100
    settings: tuple[str, ...] = ()
    every_steps: int = 0
    sampling: SamplingConfig = SamplingConfig(greedy=True)
    rollout: RolloutConfig = RolloutConfig()

    def _validate(self) -> None:
        check_int(self, "num_games", 1)
        check_int(self, "every_steps", 0)


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
        check_int(self, "keep", 1)
        check_int(self, "every_steps", 0)


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    """Device mesh axis sizes: `data` (replicated params, split batch) x `fsdp` (params and batch split);
    -1 = all the devices the other axis leaves."""

    data: int = -1
    fsdp: int = 1

    def _validate(self) -> None:
        for name in ("data", "fsdp"):
            if getattr(self, name) != -1 and getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, or -1 for all remaining devices (got {getattr(self, name)})", (name,))
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("only one of data and fsdp can be -1", ("fsdp",))

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
    steps and a printed sample game every `sample_every` steps (0 = never); `log`: where metrics go,
    "jsonl" (always written) and optionally "tensorboard" (tensorboardX, `<output_dir>/tensorboard`) and
    "wandb" (offline unless WANDB_MODE says otherwise), see `jaxrl_llm.log_sinks`."""

    output_dir: str = "runs/default"
    seed: int = 0
    log_every: int = 1
    sample_every: int = 0
    log: tuple[str, ...] = ("jsonl",)

    def _validate(self) -> None:
        from jaxrl_llm.log_sinks import LOG_SINKS

        if isinstance(self.log, str) or not isinstance(self.log, (list, tuple)):
            raise ConfigError(f"expected an array of names from {list(LOG_SINKS)}, got {self.log!r}", ("log",),
                              type(self).__name__)
        object.__setattr__(self, "log", tuple(self.log))
        for i, name in enumerate(self.log):
            if name not in LOG_SINKS:
                raise ConfigError(f"unknown log {name!r}: use any of {list(LOG_SINKS)} (e.g. [\"jsonl\", "
                                  "\"tensorboard\"])", ("log", i), type(self).__name__)
        check_int(self, "log_every", 1)
        check_int(self, "seed", 0, 2**63 - 1)
        check_int(self, "sample_every", 0)
        check_str(self, "output_dir")


# Tables that inherit the experiment's [sampling] / [rollout] key by key.
_INHERITED = ("sampling", "rollout")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(_Section):
    """A whole experiment (see the module docstring). Frozen and hashable."""

    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    env: EnvSection = EnvSection()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    sft: SftConfig = SftConfig()
    grpo: tuple[GrpoStage, ...] = ()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    run: RunSection = RunSection()
    lora: LoraConfig = LoraConfig()

    @classmethod
    def _from_table(cls, data: Mapping[str, Any], env_cls=None) -> "ExperimentConfig":
        """The whole config: the env first (its types), then the sections, stages and eval over the base
        [sampling] / [rollout] tables."""
        data = dict(data)
        for key in data:
            if key not in {f.name for f in _init_fields(cls)}:
                raise _unknown_key(cls, str(key))
        env_table = data.get("env", {})
        if not isinstance(env_table, Mapping):
            raise ConfigError(f"expected a table, got {_toml_type(env_table)}", ("env",))
        name = env_table.get("name", _default_env_name())
        if not isinstance(name, str):
            raise ConfigError(f"expected a string, got {_toml_type(name)}", ("env", "name"))
        env_cls = _env_class(name)
        base = {k: dict(_table(data, k)) for k in _INHERITED}

        def overlay(table: Any, where: tuple, defaults: Mapping[str, Any] | None = None) -> dict:
            table = dict(table)
            for k in _INHERITED:
                table[k] = {**base[k], **(defaults or {}).get(k, {}), **_table(table, k, where)}
            return table

        if "grpo" in data:
            if not isinstance(data["grpo"], (list, tuple)):
                raise ConfigError(f"expected an array of tables ([[grpo]]), got {_toml_type(data['grpo'])}", ("grpo",))
            stages = []
            for i, stage in enumerate(data["grpo"]):
                if not isinstance(stage, Mapping):
                    raise ConfigError(f"expected a table, got {_toml_type(stage)}", ("grpo", i))
                stages.append(overlay(stage, ("grpo", i)))
            data["grpo"] = stages
        data["eval"] = overlay(_table(data, "eval"), ("eval",), {"sampling": {"greedy": True}})
        hints = _hints(cls)
        kwargs = {}
        for key, value in data.items():
            try:
                kwargs[key] = _coerce(value, hints[key], env_cls)
            except ConfigError as e:
                raise e.prefixed(key) from None
        if "env" not in kwargs:
            kwargs["env"] = EnvSection(name=name, params=env_cls.Params())
        if "sft" not in kwargs:
            kwargs["sft"] = _coerce({}, hints["sft"], env_cls)
        return cls(**kwargs)

    def _validate(self) -> None:
        env_cls = self.env.env_class()
        self._resolve_env_types(env_cls)
        max_pos = None
        if self.model.init_from is None:
            max_pos = self.model.lfm2_config().max_position_embeddings
            for where, ctx in [(("rollout", "context_length"), self.rollout.context_length),
                               (("eval", "rollout", "context_length"), self.eval.rollout.context_length),
                               *[(("grpo", i, "rollout", "context_length"), s.rollout.context_length)
                                 for i, s in enumerate(self.grpo)]]:
                if ctx > max_pos:
                    raise ConfigError(f"{ctx} exceeds the model's max_position_embeddings {max_pos}", where)
            if self.sft.seq_len > max_pos:
                raise ConfigError(f"exceeds the model's max_position_embeddings {max_pos}", ("sft", "seq_len"))
        for where, section in [(("eval",), self.eval), *[(("grpo", i), s) for i, s in enumerate(self.grpo)]]:
            if section.sampling.max_new_tokens >= section.rollout.context_length:
                raise ConfigError(f"must be below the context length {section.rollout.context_length}",
                                  (*where, "sampling", "max_new_tokens"))
        names = [s.name for s in env_cls().eval_settings()]
        for i, name in enumerate(self.eval.settings):
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"env {self.env.name!r} has no evaluation setting {name!r}{hint} (it has: "
                                  f"{', '.join(names)})", ("eval", "settings", i))
        if self.sft.steps and self.sft.dataset is None and self.sft.teacher is None:
            raise ConfigError(f"env {self.env.name!r} has no teacher: give sft.dataset, or sft.steps = 0",
                              ("sft", "dataset"))
        if self.sft.check_every and not env_cls().has_check_rows(self.sft.teacher):
            raise ConfigError(f"env {self.env.name!r} has no exactness check for this teacher "
                              f"({self.sft.teacher!r})", ("sft", "check_every"))
        self._check_curricula()

    def _check_curricula(self) -> None:
        """Each stage's curriculum against the env's params (e.g. a search depth above max_depth): the env's
        own check, run by tracing `sample_examples` once, re-raised with the key path (grpo.N.curriculum.KEY)."""
        import jax

        env = self.make_env()
        for i, s in enumerate(self.grpo):
            try:
                jax.eval_shape(lambda st=s.curriculum: env.sample_examples(jax.random.PRNGKey(0), 1, 1, st))
            except ConfigError as e:
                where = ("env", "params") if e.owner == "Params" else ("grpo", i, "curriculum")
                raise ConfigError(e.reason, (*where, *e.path)) from None

    def _resolve_env_types(self, env_cls) -> None:
        """Env-bound fields left at None (a config built in Python) get the env's defaults; instances of the
        wrong class are refused."""
        def fix(value, attr, where):
            cls = getattr(env_cls, attr, None)
            if cls is None or cls is type(None):
                if value is not None:
                    raise ConfigError(f"env {env_cls.name!r} has no {attr}", where)
                return None
            if value is None:
                return cls()
            if not isinstance(value, cls):
                raise ConfigError(f"expected the {attr} of env {env_cls.name!r}, got {type(value).__name__}", where)
            return value

        object.__setattr__(self, "env", dataclasses.replace(self.env, params=fix(self.env.params, "Params", ("env", "params"))))
        object.__setattr__(self, "sft", dataclasses.replace(self.sft, teacher=fix(self.sft.teacher, "Teacher", ("sft", "teacher"))))
        object.__setattr__(self, "grpo", tuple(
            dataclasses.replace(s, curriculum=fix(s.curriculum, "Stage", ("grpo", i, "curriculum")))
            for i, s in enumerate(self.grpo)))

    # ---- helpers ----
    def make_env(self):
        """The env of this experiment (`envs.make(env.name, **env.params)`)."""
        return self.env.make()

    def eval_settings(self):
        """The env's evaluation settings named in eval.settings (all of them when it is empty), in order."""
        settings = self.make_env().eval_settings()
        if not self.eval.settings:
            return settings
        by_name = {s.name: s for s in settings}
        return tuple(by_name[n] for n in self.eval.settings)

    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <run.output_dir>/checkpoints."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else os.path.join(self.run.output_dir,
                                                                                        "checkpoints")


def _table(data: Mapping[str, Any], key: str, where: tuple = ()) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {_toml_type(value)}", (*where, key))
    return value


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
    """"grpo.0.optim.learning_rate=3e-5" -> (("grpo", "0", "optim", "learning_rate"), 3e-05); the value is a
    TOML literal, else a bare string."""
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


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config (or any section) -> plain dict: tuples as lists, None fields left out (TOML has no null)."""

    def convert(value: Any) -> Any:
        if hasattr(value, "_to_table"):
            return value._to_table()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: convert(getattr(value, f.name)) for f in _init_fields(type(value))
                    if getattr(value, f.name) is not None}
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
