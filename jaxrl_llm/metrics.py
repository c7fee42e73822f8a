"""Visibility: a JSONL metrics log, a progress display, plots of the curves and the results table.

- `MetricsWriter(path, resume_step=None)`: one JSON object per step (`{"step": 12, "time": ..., "reward_mean":
  0.41, ...}`), flushed line by line; jax / numpy scalars become numbers. After a restart from the
  checkpoint of step S, `MetricsWriter(path, resume_step=S)` keeps the lines with step <= S and appends
  after them, so the curves have no duplicated or orphaned steps.
- `Progress(total, description, keys)`: a rich progress bar with the key figures on a terminal, plain
  periodic lines otherwise (CI logs).
- `plot_metrics(paths, out_png, keys=None)`: one subplot per metric, x = step, one line per file (run or
  stage), drawn with matplotlib's Agg canvas (no display needed).
- `format_results_table(rows, columns)`: a Markdown results table in % with the env's columns
  (`env.results_columns`; Tic-Tac-Toe's is the spec's `| model | W | D | L | format | invalid |`).

Metric names the plots know (others are plotted after them): see `PLOT_KEYS`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np

from jaxrl_llm import distributed

__all__ = [
    "MetricsWriter",
    "read_metrics",
    "to_jsonable",
    "Progress",
    "plot_metrics",
    "format_results_table",
    "PLOT_KEYS",
    "METRIC_KINDS",
    "metric_kind",
    "log_name",
    "format_metric",
]

# What an env's metric is (`Env.metric_kinds`): a 0/1 "rate" (the default; shown in %, logged as
# `<name>_rate`) or a "mean" of any number per game (e.g. guesses per game; shown as a number, logged as
# `<name>_mean`).
METRIC_KINDS = ("rate", "mean")


def metric_kind(kinds: Mapping[str, str] | None, name: str) -> str:
    """The kind of metric `name` under `kinds` (an env's `metric_kinds`): "rate" unless declared."""
    return (kinds or {}).get(name, "rate")


def log_name(name: str, kind: str = "rate") -> str:
    """The key of an env metric in the training logs: `<name>_rate` for a rate, `<name>_mean` for a mean."""
    return f"{name}_mean" if kind == "mean" else f"{name}_rate"


def format_metric(value: float, kind: str = "rate") -> str:
    """A rate in % to 0.1 ("61.4%"), a mean as a number to 3 significant digits ("4.25")."""
    if kind == "mean":
        return f"{float(value):.3g}"
    return f"{100 * float(value):.1f}%"

# Preferred order of the plotted metrics when no keys are given (those present in the logs are drawn first,
# then any other number; the env's own `<metric>_rate` figures sort among the others).
PLOT_KEYS = (
    "reward_mean",
    "format_rate",
    "kl",
    "entropy",
    "grad_norm",
    "learning_rate",
    "decision_policy_change",
    "decision_entropy",
    "illegal_choice_prob",
    "frac_groups_with_spread",
    "reply_length",
    "loss",
)
_NOT_PLOTTED = ("step", "time", "stage", "elapsed")


# ----------------------------------------------------------------------------------------------------------
# JSONL writer
# ----------------------------------------------------------------------------------------------------------


def to_jsonable(value: Any) -> Any:
    """jax / numpy arrays and scalars -> Python numbers (or nested lists); mappings and sequences recursed.
    Non-finite floats stay NaN / Infinity (Python's json reads them back)."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        array = np.asarray(value)
        return array.item() if array.ndim == 0 else array.tolist()
    return str(value)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line cut by a crash (not valid JSON) is skipped."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


class MetricsWriter:
    """Appends one JSON object per step to a JSONL file, flushing each line.

    resume_step: None starts a new log (an existing file is replaced); an int S resumes after a restart
    from step S: existing lines with step <= S are kept (a line cut by a crash is dropped), later ones
    are removed, and new lines are appended. In a multi-host run only process 0 writes (`distributed`):
    elsewhere `write` returns the row and touches no file.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None, sinks: Sequence = (),
                 group: str = "metrics"):
        self.path = Path(path)
        self.sinks, self.group = tuple(sinks), group  # `log_sinks`: each row's scalars also go there
        self._file: TextIO | None = None
        self._writes = distributed.is_writer()
        if not self._writes:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            kept: list[dict[str, Any]] = []
        else:
            kept = [r for r in read_metrics(self.path) if isinstance(r.get("step"), (int, float))
                    and r["step"] <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, self.path)  # atomic: a crash here leaves the old file or the new one
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any] | None = None, **more: Any) -> dict[str, Any]:
        """Writes {"step": step, "time": now, **metrics, **more} as one line; returns the row written."""
        if self._file is None and self._writes:
            raise ValueError(f"MetricsWriter({str(self.path)!r}) is closed")
        row = {"step": int(step), "time": time.time()}
        row.update(to_jsonable(dict(metrics or {})))
        row.update(to_jsonable(more))
        if not self._writes:
            return row
        try:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        except OSError as e:  # disk full, ...: name the file (Python's own message does not)
            raise OSError(e.errno, f"cannot write metrics to {str(self.path)!r}: {e.strerror or e}", str(self.path)) from None
        if self.sinks:
            from jaxrl_llm.log_sinks import scalars

            values = scalars(row)
            for sink in self.sinks:
                sink.scalars(self.group, int(step), values)
        return row

    def close(self) -> None:
        """Closes the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------
# Progress display
# ----------------------------------------------------------------------------------------------------------


def _format_figure(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.2e}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


class Progress:
    """A progress display for `total` steps showing the figures named in `keys`.

    On a terminal (and with rich installed): a live bar `description ━━━━ 12/100 0:01:02 reward 0.41 ...`.
    Otherwise (CI logs, files): a plain line `description 12/100 (12%) 3.1 it/s reward 0.41 ...` every
    `every` updates (default: about 20 lines in all) and at the end.

        with Progress(100, "grpo stage 1", keys=["reward_mean", "win_rate", "games_per_s"]) as bar:
            for step in range(100):
                bar.update(1, **metrics)
    """

    def __init__(self, total: int, description: str = "", keys: Sequence[str] = (), every: int | None = None,
                 file: TextIO | None = None, plain: bool | None = None):
        self.total = max(int(total), 0)
        self.description = description
        self.keys = tuple(keys)
        self.file = file if file is not None else sys.stdout
        self.every = every if every is not None else max(1, self.total // 20)
        self.completed = 0
        self.figures: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._last_printed = -1
        if plain is None:
            plain = not (hasattr(self.file, "isatty") and self.file.isatty())
        self._rich = None
        if not plain:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress
                from rich.progress import TimeRemainingColumn
            except ImportError:
                plain = True
            else:
                self._rich = RichProgress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[figures]}"),
                    console=Console(file=self.file),
                )
                self._rich.start()
                self._task = self._rich.add_task(description, total=self.total, figures="")
        self.plain = plain

    def figures_text(self) -> str:
        """The key figures as "name value" pairs (keys not yet reported are left out)."""
        return "  ".join(f"{k} {_format_figure(self.figures[k])}" for k in self.keys if k in self.figures)

    def update(self, advance: int = 1, **figures: Any) -> None:
        """Advances by `advance` steps and records the latest figures (jax / numpy scalars accepted)."""
        self.completed += advance
        self.figures.update({k: to_jsonable(v) for k, v in figures.items()})
        if self._rich is not None:
            self._rich.update(self._task, advance=advance, figures=self.figures_text())
        elif self.completed - max(self._last_printed, 0) >= self.every or self.completed >= self.total:
            self._print_line()

    def line(self) -> str:
        """The plain progress line for the current state."""
        elapsed = time.perf_counter() - self._start
        rate = self.completed / elapsed if elapsed > 0 else 0.0
        percent = 100.0 * self.completed / self.total if self.total else 100.0
        head = f"{self.description} " if self.description else ""
        text = f"{head}{self.completed}/{self.total} ({percent:.0f}%) {_format_figure(rate)} it/s"
        figures = self.figures_text()
        return f"{text}  {figures}" if figures else text

    def _print_line(self) -> None:
        if self.completed == self._last_printed:
            return
        self._last_printed = self.completed
        print(self.line(), file=self.file, flush=True)

    def close(self) -> None:
        """Stops the bar (rich) or prints the final line (plain) (idempotent)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self.plain:
            self._print_line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------


def _jsonl_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no metrics file or folder {str(p)!r}")
    if not files:
        raise FileNotFoundError(f"no .jsonl metrics files in {[str(p) for p in map(Path, paths)]}")
    return files


def _label(path: Path, files: Sequence[Path]) -> str:
    stems = [f.stem for f in files]
    if stems.count(path.stem) > 1:
        return f"{path.parent.name}/{path.stem}"
    return path.stem


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_metrics(paths: str | os.PathLike | Iterable[str | os.PathLike], out_png: str | os.PathLike,
                 keys: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Plots JSONL metrics: one subplot per metric (x = step), one line per file (runs / stages overlaid).

    paths: a .jsonl file, a folder (every .jsonl under it) or a list of them. keys: the metrics to draw
    (default: those of PLOT_KEYS present, then every other numeric key). Returns the PNG's path (in a
    multi-host run drawn by process 0 alone).
    """
    if not distributed.is_writer():
        return Path(out_png)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    files = _jsonl_files(paths)
    runs = [(_label(f, files), read_metrics(f)) for f in files]
    present: list[str] = []
    for _, rows in runs:
        for row in rows:
            for k, v in row.items():
                if k not in present and k not in _NOT_PLOTTED and _is_number(v):
                    present.append(k)
    if keys is None:
        keys = [k for k in PLOT_KEYS if k in present] + sorted(k for k in present if k not in PLOT_KEYS)
    keys = list(keys)
    if not keys:
        raise ValueError(f"nothing to plot: no numeric metrics in {[str(f) for f in files]}")
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 2.8 * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        for label, rows in runs:
            points = [(r["step"], r[key]) for r in rows if _is_number(r.get(key)) and _is_number(r.get("step"))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=label, linewidth=1.2, marker="." if len(xs) < 30 else None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    if len(runs) > 1:
        handles, labels = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncols=min(len(runs), 4), fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


# ----------------------------------------------------------------------------------------------------------
# Results table
# ----------------------------------------------------------------------------------------------------------

def _percent(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def format_results_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]],
                         title: str = "model", fractions: bool = True, kinds: Mapping[str, str] | None = None) -> str:
    """A results table (Markdown), one row per mapping, one column per (header, key) of `columns`:

        | model | W | D | L | format | invalid |
        |---|---|---|---|---|---|
        | after SFT | 74 | 13 | 13 | 99.8 | 11 |

    Each row has "model" and the rates named in `columns` (a key may also end in "_rate" in the row:
    "win_rate"); a missing or NaN value shows "-". fractions: the rates are in [0, 1] (False: already
    in %). Shown to 0.1 %, ".0" dropped. `title` heads the first column (e.g. "vs random opponent").
    kinds: the env's `metric_kinds`; a "mean" column shows its number (to 3 significant digits), not a %.
    """
    columns = tuple(columns)
    lines = [f"| {title} | " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = [str(row.get("model", row.get("name", "")))]
        for _, key in columns:
            kind = metric_kind(kinds, key)
            value = row.get(key, row.get(log_name(key, kind)))
            value = None if value is None else float(to_jsonable(value))
            if value is None or math.isnan(value):
                cells.append("-")
                continue
            cells.append(f"{value:.3g}" if kind == "mean" else _percent(100.0 * value if fractions else value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
