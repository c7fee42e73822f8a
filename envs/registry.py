"""The env registry: names -> Env subclasses (`register`, `make`, `registered`), class paths
"package.module:ClassName" imported on use, and installed packages' entry points (group `jaxrl_llm.envs`).
Re-exported by `envs.core` and `envs`."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from envs.core import Env
from jaxrl_base.errors import EnvError

_REGISTRY: dict[str, type[Env] | str] = {}


def register(name: str, env: type[Env] | str, overwrite: bool = False) -> None:
    """Register an Env subclass (or "module:Class", imported on first use) under `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an env name must be a non-empty string, got {name!r}")
    if isinstance(env, type) and not issubclass(env, Env):
        raise TypeError(f"{env.__name__} is not a subclass of envs.Env")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not env:
        raise ValueError(f"an env named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = env


ENTRY_POINT_GROUP = "jaxrl_llm.envs"  # installed packages register envs here: `name = "module:Class"`
_ENTRY_POINTS_LOADED = False


class EnvNotFoundError(KeyError, EnvError):
    """An env name that is neither registered, nor an installed entry point, nor an importable class path
    (a KeyError whose text is the plain message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _load_entry_points() -> None:
    """Registers every installed package's envs of the entry-point group `jaxrl_llm.envs` (once; a name
    already registered keeps its entry, and the class is imported on first use)."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        _REGISTRY.setdefault(point.name, point.value)


def entry_point_envs() -> dict[str, str]:
    """{name: "module:Class"} of the installed packages' envs (the entry-point group `jaxrl_llm.envs`)."""
    from importlib.metadata import entry_points

    return {point.name: point.value for point in entry_points(group=ENTRY_POINT_GROUP)}


def registered() -> list[str]:
    """The registered env names (built-ins, `register` calls and installed entry points), sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


def class_path(cls: type) -> str:
    """"module:QualName" of a class: the form `env_class` imports (checkpoints record it)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str, name: str) -> type[Env]:
    """The Env subclass at "package.module:ClassName". A module not found on sys.path is looked for in the
    current folder too (as `python -m` would), so a user's env folder works from the plain command line.
    EnvNotFoundError names the module or attribute that failed."""
    import os
    import sys

    module, _, attr = path.partition(":")
    if not module or not attr:
        raise EnvNotFoundError(f"env {name!r}: a class path must be 'package.module:ClassName', got {path!r}")
    try:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            here = os.getcwd()
            top = module.split(".")[0]
            if e.name not in (top, module) and not module.startswith(f"{e.name}."):
                raise
            if here in sys.path or not (os.path.isdir(os.path.join(here, top))
                                        or os.path.isfile(os.path.join(here, top + ".py"))):
                raise
            sys.path.append(here)
            mod = importlib.import_module(module)
    except ImportError as e:
        raise EnvNotFoundError(f"env {name!r}: cannot import module {module!r} ({type(e).__name__}: {e}); is its "
                               "package installed, or its folder the current one or on PYTHONPATH?") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvNotFoundError(f"env {name!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise EnvNotFoundError(f"env {name!r}: {path} is {obj!r}, not a subclass of envs.Env")
    return obj


def env_class(name: str) -> type[Env]:
    """The Env subclass registered as `name` (or installed through the entry-point group `jaxrl_llm.envs`),
    or at the class path `name` = "package.module:ClassName"; EnvNotFoundError (a KeyError) with the
    closest names and both ways to bring an env of your own otherwise."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        if isinstance(name, str) and ":" in name:
            return _import_class(name, name)
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise EnvNotFoundError(
            f"unknown env {name!r}{hint} (registered: {', '.join(registered())}). An env of your own: name its "
            f"class as 'package.module:ClassName', or install a package that declares it in the entry-point group "
            f"{ENTRY_POINT_GROUP!r} (pyproject.toml: [project.entry-points.\"{ENTRY_POINT_GROUP}\"] "
            f"my_env = \"package.module:ClassName\")")
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        entry = _import_class(entry, name)
        _REGISTRY[name] = entry
    return entry


def make(name: str, **params: Any) -> Env:
    """The env registered as `name`, with its `Params(**params)`."""
    cls = env_class(name)
    return cls(cls.Params(**params))
