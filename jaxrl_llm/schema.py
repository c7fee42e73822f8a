"""The TOML schema machinery behind `jaxrl_llm.config`, generic over any tree of frozen dataclasses.

A TOML table becomes the dataclass whose field holds it: `build(cls, table, context)` checks every key
(an unknown one raises `ConfigError` with the closest valid key here, and the tables elsewhere in the
schema's root that have it) and coerces every value against the field's annotation (`coerce`: bool, int,
float, str, `X | None`, `tuple[...]`, nested dataclasses, and `checks.EnvBound` fields, whose type the
experiment's env class gives). An error names the whole key path (`grpo.0.loss.beta: ...`).
`Section` is the base of config-only dataclasses (each field coerced on construction, then `_validate`);
a class may read its own table with a `_from_table(table, context)` classmethod and write it with
`_to_table()`. Also here: `--set` overrides (`parse_override`, `apply_overrides`), TOML reading
(`loads_toml`) and a minimal writer (`config_to_dict`, `dumps_toml`). The experiment's own sections live
in `jaxrl_llm.config`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Union

import numpy as np

from jaxrl_llm.checks import ConfigError, EnvBound

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "BuildContext", "Section", "all_keys", "apply_overrides", "build", "coerce", "config_to_dict", "dumps_toml",
    "hints", "init_fields", "loads_toml", "parse_override", "sub_table", "toml_type", "unknown_key",
]


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a build needs besides the table: `env_cls`, the experiment's env class (for `EnvBound`
    fields; None when unknown), and `root`, the schema's top class (its keys are searched for the table an
    unknown key belongs to; None: no such hint), or a function returning it (for sections built as the
    root's own defaults, before the root class exists)."""

    env_cls: type | None = None
    root: type | Callable[[], type] | None = None

    def root_class(self) -> type | None:
        """The root class (`root`, called when it is a function)."""
        return self.root if self.root is None or isinstance(self.root, type) else self.root()


# ----------------------------------------------------------------------------------------------------------
# Types: checking and coercing a value against a field's annotation
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass (with `Annotated` extras), cached per class."""
    return typing.get_type_hints(cls, include_extras=True)


def toml_type(value: Any) -> str:
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


def coerce(value: Any, tp: Any, context: BuildContext = BuildContext()) -> Any:
    """Checks `value` against annotation `tp`; returns it normalised (int -> float, list -> tuple, table ->
    dataclass). context: the env class (for `EnvBound` fields) and the schema's root. Raises ConfigError
    (path relative to the value)."""
    if tp is Any:
        return value
    bound = _env_bound(tp)
    if bound is not None:
        return _coerce_env_bound(value, bound, context)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, context)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"expected {_type_name(tp)}, got {toml_type(value)}")
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected {_type_name(tp)}, got {toml_type(value)}")
        item = args[0] if args else Any
        out = []
        for i, v in enumerate(value):
            try:
                out.append(coerce(v, item, context))
            except ConfigError as e:
                raise e.prefixed(i) from None
        return tuple(out)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, context)
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
    raise ConfigError(f"expected {_type_name(tp)}, got {toml_type(value)}")


def _coerce_env_bound(value: Any, bound: EnvBound, context: BuildContext) -> Any:
    """A field whose type is the env's `Params` / `Stage` / `Teacher`: None -> its default, a table -> built."""
    env_cls = context.env_cls
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
    return build(cls, value, context)


def init_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` a TOML table sets (init fields without `metadata={"toml": False}`)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("toml", True)]


def unknown_key(cls: type, key: str, root: type | None = None) -> ConfigError:
    """The error of an unknown key of `cls`'s table: the closest key of this table ("did you mean"), the
    tables of `root` (the whole schema) that have this key or a close one, else the valid keys here."""
    names = [f.name for f in init_fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    everywhere = all_keys(root) if root is not None else []
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


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a section class (an array of tables as "name.N.<key>", e.g. "grpo.N.steps";
    env-bound tables not expanded)."""
    keys = []
    field_types = hints(cls)
    for f in init_fields(cls):
        tp = field_types[f.name]
        name = prefix + f.name
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, name + ".")
        elif typing.get_origin(tp) is tuple and typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            keys += all_keys(typing.get_args(tp)[0], name + ".N.")
        else:
            keys.append(name)
    return keys


def build(cls: type, data: Any, context: BuildContext = BuildContext()) -> Any:
    """A table (Mapping) -> an instance of dataclass `cls`, every key and value checked."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a table, got {toml_type(data)}")
    if hasattr(cls, "_from_table"):
        return cls._from_table(data, context)
    names = {f.name for f in init_fields(cls)}
    field_types = hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise unknown_key(cls, str(key), context.root_class())
        try:
            kwargs[key] = coerce(value, field_types[key], context)
        except ConfigError as e:
            raise e.prefixed(key) from None
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(e.reason, e.path) from None  # the path says where: drop the class name
    except (ValueError, TypeError) as e:  # a check that does not raise ConfigError: name the class
        raise ConfigError(f"{cls.__name__}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of the config-only sections: checks/coerces every field against its annotation, then `_validate`.
    A subclass names its schema's root (for the "a key of another table" hint) in `_context`."""

    @classmethod
    def _context(cls) -> BuildContext:
        """The context of coercing a field set in Python: no env class; the root, when a subclass gives it."""
        return BuildContext()

    def __post_init__(self) -> None:
        field_types = hints(type(self))
        context = self._context()
        for f in init_fields(type(self)):
            try:
                value = coerce(getattr(self, f.name), field_types[f.name], context)
            except ConfigError as e:
                raise ConfigError(e.reason, (f.name, *e.path), type(self).__name__) from None
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        pass


def sub_table(data: Mapping[str, Any], key: str, where: tuple = ()) -> Mapping[str, Any]:
    """data[key] when it is a table, {} when absent; ConfigError at `where + (key,)` otherwise."""
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {toml_type(value)}", (*where, key))
    return value


# ----------------------------------------------------------------------------------------------------------
# Overrides and TOML text
# ----------------------------------------------------------------------------------------------------------


def loads_toml(text: str) -> dict[str, Any]:
    """TOML text -> its raw data; ConfigError("invalid TOML: ...") when it does not parse."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML: {e}") from None


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


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config (or any section) -> plain dict: tuples as lists, None fields left out (TOML has no null)."""

    def convert(value: Any) -> Any:
        if hasattr(value, "_to_table"):
            return value._to_table()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: convert(getattr(value, f.name)) for f in init_fields(type(value))
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
