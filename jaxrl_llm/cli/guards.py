"""The CLI's checks of a user's paths before any work: the preset, its `--set` overrides, the output folder,
and the files a command would write (never overwritten without `--force`, as `export` promises for its folder).

Each failure is a named error (`ConfigError`, `DataError`) whose one line names the path or the override and
the fix (`cli.errors` prints it). Nothing here imports jax.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Sequence

from jaxrl_base.errors import ConfigError, DataError
from jaxrl_llm.schema import parse_override

__all__ = ["load_preset", "check_preset_path", "check_overrides", "blame_overrides", "check_output_dir",
           "refuse_overwrite",
           "check_metrics_inputs"]


def check_preset_path(path: str) -> Path:
    """The preset must be a TOML file: a folder is named as a folder (with the presets in it), a missing file
    with the closest presets beside it."""
    preset = Path(path)
    if preset.is_dir():
        inside = sorted(p.name for p in preset.glob("*.toml"))
        shown = f"; presets there: {', '.join(inside[:6])}{' ...' if len(inside) > 6 else ''}" if inside else ""
        raise ConfigError(f"the preset {path!r} is a folder, not a TOML file{shown}")
    if not preset.exists():
        folder = preset.parent if preset.parent.is_dir() else None
        names = sorted(p.name for p in folder.glob("*.toml")) if folder is not None else []
        close = difflib.get_close_matches(preset.name, names, n=1, cutoff=0.6)
        hint = f"; did you mean {str(folder / close[0])!r}?" if close else ""
        raise ConfigError(f"the preset {path!r} does not exist{hint}")
    return preset


def check_overrides(overrides: Sequence[str]) -> None:
    """Each `--set` must be key=value: the error names the override, not the preset."""
    for item in overrides:
        try:
            parse_override(item)
        except ConfigError as e:
            raise ConfigError(f"--set {item!r}: {e.reason}") from None


def blame_overrides(error: ConfigError, preset: Path, overrides: Sequence[str],
                    preset_alone_loads: bool) -> ConfigError:
    """A config error of preset + overrides, blamed on the `--set` it comes from when the preset alone loads:
    the override whose key is the error's key (or above it) is named, else every override."""
    if not overrides or not preset_alone_loads:
        return error
    reason = error.reason
    suffix = f" (in {preset})"
    if reason.endswith(suffix):
        reason = reason[: -len(suffix)]
    key = error.key
    matching = [item for item in overrides
                if key and (key == item.split("=", 1)[0].strip() or key.startswith(item.split("=", 1)[0].strip() + ".")
                            or item.split("=", 1)[0].strip().startswith(key + "."))]
    named = ", ".join(f"--set {item!r}" for item in (matching or overrides))
    return ConfigError(f"{reason} (from {named}; the preset {preset} alone is valid)", error.path)


def check_output_dir(config: Any) -> None:
    """run.output_dir (and checkpoint.dir) must be folders or not exist yet; a file there is named."""
    for key, value in (("run.output_dir", config.run.output_dir), ("checkpoint.dir", config.checkpoint.dir)):
        if value is None:
            continue
        path = Path(value).expanduser()
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            where = "is a file" if blocker == path else f"is inside {str(blocker)!r}, which is a file"
            raise ConfigError(f"{value!r} {where}, not a folder: choose another folder (--set {key}=...) or move "
                              "the file", tuple(key.split(".")))


def refuse_overwrite(path: str | Path, flag: str, force: bool) -> Path:
    """A file a command would write: refused when it exists and `force` is not given (the error names the file,
    the flag and --force); a folder there is refused always. Returns the path."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise FileExistsError(f"{flag} {path} is a folder; give a file name")
    if target.exists() and not force:
        raise FileExistsError(f"{flag} {path} exists; nothing was written. Choose a new file name, or pass --force "
                              "to replace it")
    return target


def check_metrics_inputs(paths: Sequence[str]) -> None:
    """`jaxrl-llm plot`'s inputs: each a metrics file or a folder holding some; a file without one metrics row
    (empty, or only cut lines) is named."""
    from jaxrl_llm.metrics import read_metrics  # lazy: matplotlib is not needed here, but keep --help fast

    for item in paths:
        path = Path(item)
        if not path.exists():
            raise DataError(f"no metrics file or folder {item!r}")
        if path.is_dir():
            files = sorted(path.rglob("*.jsonl"))
            if not any(read_metrics(f) for f in files):
                raise DataError(f"{item!r} holds no .jsonl metrics file with a row: nothing to plot")
        elif not read_metrics(path):
            what = "is empty" if path.stat().st_size == 0 else "holds no complete metrics row"
            raise DataError(f"{path} {what}: nothing to plot (a run writes metrics.jsonl as it trains)")


def load_preset(path: str, overrides: Sequence[str] = (), check_paths: bool = True) -> Any:
    """`config.load_config` of a user's preset and `--set` overrides, with the checks above: the preset path,
    each override's form, an error blamed on the override it comes from, and the output folder."""
    from jaxrl_llm.config import load_config  # lazy: jax (fast --help)

    preset = check_preset_path(path)
    check_overrides(overrides)
    try:
        config = load_config(preset, overrides, check_paths)
    except ConfigError as error:
        if not overrides:
            raise
        try:
            load_config(preset, (), check_paths)
            alone = True
        except ConfigError:
            alone = False
        raise blame_overrides(error, preset, overrides, alone) from None
    check_output_dir(config)
    return config
