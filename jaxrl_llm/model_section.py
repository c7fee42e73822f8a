"""The `[model]` table of an experiment: `ModelSection`, a preset name or a Hugging Face folder, plus any
`models.lfm2.Lfm2Config` field written flat in the table as an override of the architecture.
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
    def _from_table(cls, table: Mapping[str, Any], context: BuildContext = BuildContext()) -> "ModelSection":
        arch_types = _lfm2_hints()
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

    return hints(Lfm2Config)


def _unknown_model_key(key: str) -> ConfigError:
    names = ["preset", "init_from", *_lfm2_hints()]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(f"unknown key {key!r}{hint} (besides preset and init_from, [model] takes "
                       f"models.lfm2.Lfm2Config fields)", (key,))
