"""The `[model]` table of an experiment: `ModelSection`, a preset name or a Hugging Face folder, plus any field
of the model family's config written flat in the table as an override of the architecture.

The family comes from the preset (`models.family.PRESETS`: LFM2's "tiny", "cpu-5m", "lfm2-350m", ...; Qwen3's
"qwen3-tiny", "qwen3-cpu", "qwen3-0.6b", ...) or, with `init_from`, from the folder's config.json
(`model_type`); the model is reached only through the seam (`models.family`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.checks import ConfigError, check_choice, check_str
from jaxrl_llm.schema import BuildContext, coerce, hints

DTYPES = ("float32", "bfloat16", "float16")


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The model: `preset` (a name of `models.family.PRESETS`, of any family) or, when set, `init_from` (a
    Hugging Face folder of a supported family: architecture from its config.json, weights loaded from it;
    `preset` is then unused). `arch` holds the config fields the TOML table sets besides those two (written
    flat in `[model]`, e.g. `hidden_size = 128`); each overrides the architecture's value and must be a
    field of the model's family."""

    preset: str = "tiny"
    init_from: str | None = None
    arch: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        from models import family as fam

        check_str(self, "preset")
        if self.init_from is not None:
            check_str(self, "init_from")
        arch = dict(self.arch)
        if len(arch) != len(self.arch):
            raise ConfigError("sets a field twice", ("arch",), "ModelSection")
        for name in arch:
            if name in ("preset", "init_from") or name not in _field_types():
                raise _unknown_model_key(name)
        order = list(_field_types())
        object.__setattr__(self, "arch", tuple(sorted(arch.items(), key=lambda kv: order.index(kv[0]))))
        if self.init_from is None:
            check_choice(self, "preset", tuple(fam.PRESETS))
            config_cls = type(fam.PRESETS[self.preset])
            other = [n for n in arch if n not in config_cls.__dataclass_fields__]
            if other:
                raise _unknown_model_key(other[0], config_cls, self.preset)
        for name in ("dtype", "param_dtype"):
            if arch.get(name) is not None and arch[name] not in DTYPES:
                raise ConfigError(f"must be one of {', '.join(map(repr, DTYPES))} (got {arch[name]!r})", (name,))
        if self.init_from is None:
            layer_types = type(fam.PRESETS[self.preset]).LAYER_TYPES
            for i, kind in enumerate(arch.get("layer_types") or ()):
                if kind not in layer_types:
                    raise ConfigError(f"unknown layer type {kind!r}; use {' or '.join(map(repr, layer_types))}",
                                      ("layer_types", i))
            try:  # the architecture is known now: check it (no file access, no compile)
                self.model_config()
            except ConfigError:
                raise
            except ValueError as e:
                named = re.findall(r"\w+", str(e))
                field = next((n for n in named if n in arch), None)
                raise ConfigError(f"{e} (preset {self.preset!r} with the overrides)", (field,) if field else ()) from None

    def __getattr__(self, name: str) -> Any:
        """`model.hidden_size` etc.: the override this section sets for a config field (None if unset)."""
        if name.startswith("_") or name == "arch" or name not in _field_types():
            raise AttributeError(f"ModelSection has no attribute {name!r}")
        return dict(self.arch).get(name)

    @classmethod
    def of(cls, preset: str = "tiny", init_from: str | None = None, **overrides: Any) -> "ModelSection":
        """ModelSection.of("cpu-5m", hidden_size=128): the keyword form of the `[model]` table."""
        return cls(preset=preset, init_from=init_from, arch=tuple(overrides.items()))

    @classmethod
    def _from_table(cls, table: Mapping[str, Any], context: BuildContext = BuildContext()) -> "ModelSection":
        arch_types = _field_types()
        kwargs, arch = {}, []
        for key, value in table.items():
            if key in ("preset", "init_from"):
                kwargs[key] = coerce(value, str) if value is not None else None
                continue
            if key not in arch_types:
                raise _unknown_model_key(key)
            try:
                arch.append((key, coerce(value, arch_types[key])))
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
        """The config fields this section sets."""
        return {k: v for k, v in self.arch if v is not None}

    def model_config(self):
        """-> the family's config (`models.lfm2.Lfm2Config`, `models.qwen3.Qwen3Config`): the preset (or
        `init_from`'s config.json) with the overrides applied."""
        from models import family as fam

        over = self.overrides()
        if self.init_from is not None:
            saved = fam.config_from_pretrained(self.init_from)
            fields = type(saved).__dataclass_fields__
            other = [n for n in over if n not in fields]
            if other:
                raise ConfigError(
                    f"model.init_from = {self.init_from!r} holds a {saved.model_type} model, which has no field "
                    f"{other[0]!r}; remove it (the fields of {type(saved).__name__}: {', '.join(fields)})",
                    ("model", other[0]))
            clash = [n for n in saved.ARCH_FIELDS if n in over
                     and tuple(_as_tuple(over[n])) != tuple(_as_tuple(getattr(saved, n)))]
            if clash:
                detail = ", ".join(f"model.{n} = {over[n]!r} (the checkpoint has {getattr(saved, n)!r})" for n in clash)
                raise ConfigError(
                    f"model.init_from = {self.init_from!r} fixes the architecture (its config.json) and {detail} "
                    f"would not fit its weights; remove the override or make it match", ("model", clash[0]))
            return dataclasses.replace(saved, **over)
        return dataclasses.replace(fam.PRESETS[self.preset], **over)


def _field_types() -> dict[str, Any]:
    """The config fields of every family with their types (a field two families share has one type)."""
    from models.family import FAMILIES

    out: dict[str, Any] = {}
    for f in FAMILIES.values():
        for name, kind in hints(f.config).items():
            out.setdefault(name, kind)
    return out


def _unknown_model_key(key: str, config_cls: type | None = None, preset: str | None = None) -> ConfigError:
    names = ["preset", "init_from", *(config_cls.__dataclass_fields__ if config_cls else _field_types())]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
    if config_cls is not None:
        return ConfigError(f"unknown key {key!r} for preset {preset!r}, a {config_cls.model_type} model{hint} "
                           f"(besides preset and init_from, [model] takes {config_cls.__name__} fields)", (key,))
    return ConfigError(f"unknown key {key!r}{hint} (besides preset and init_from, [model] takes the fields of a "
                       "model family's config: models.lfm2.Lfm2Config, models.qwen3.Qwen3Config)", (key,))
