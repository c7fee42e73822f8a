"""The CLI's one user-facing error path: a user's error is one line and exit code 2, Ctrl-C one line and 130.

    jaxrl-llm train: data/games.jsonl line 4: not valid JSON (Expecting ',' delimiter at column 66); ...
    jaxrl-llm train: interrupted (Ctrl-C); the last checkpoint, step 40 in runs/x/checkpoints, is kept: run the same
    command again to resume from it

What counts as the user's: every `jaxrl_base.JaxrlError` (config, data, env, checkpoint, model; the library's
named errors derive from them) and an `OSError` (a missing file, a folder that cannot be written, a full disk).
Anything else is a bug and stays a traceback. `JAXRL_LLM_DEBUG=1` prints the traceback of a user's error (and
of Ctrl-C) before its line.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from jaxrl_base.errors import JaxrlError, one_line

__all__ = ["DEBUG_VARIABLE", "EXIT_USER_ERROR", "EXIT_INTERRUPTED", "debug", "note_config", "interrupt_line",
           "report"]

DEBUG_VARIABLE = "JAXRL_LLM_DEBUG"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
TRAINING_COMMANDS = ("experiment", "sft", "train")

_CONFIG: dict[str, Any] = {}  # the command's loaded config (`note_config`), for the Ctrl-C line


def debug() -> bool:
    """Whether `JAXRL_LLM_DEBUG` asks for tracebacks (set, and not "", "0", "false" or "no")."""
    return os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def note_config(config: Any) -> None:
    """Remembers the command's config, so that an interruption can say which checkpoints it kept."""
    _CONFIG["config"] = config


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types printed as one line: every `JaxrlError` (the library's named errors derive from one,
    `RunLockedError` and `NonFiniteLossError` included) and `OSError` (a missing file, a full disk)."""
    return (JaxrlError, OSError)


def _committed_steps(folder: Path) -> list[int]:
    """The committed Orbax steps in `folder` (numbered subfolders), without opening Orbax."""
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def interrupt_line(command: str, config: Any = None) -> str:
    """The line printed on Ctrl-C: what the command kept and how to resume. For a training command, the newest
    committed checkpoint of the run (GRPO, SFT in progress, SFT done); otherwise that nothing was kept."""
    config = config if config is not None else _CONFIG.get("config")
    if command not in TRAINING_COMMANDS or config is None:
        return f"jaxrl-llm {command}: interrupted (Ctrl-C) before it finished; nothing was saved: run it again"
    out = Path(config.run.output_dir)
    kept = []
    for what, folder in (("GRPO", Path(config.checkpoint_dir())), ("SFT (finished)", out / "sft"),
                         ("SFT (in progress)", out / "sft_progress")):
        steps = _committed_steps(folder.expanduser())
        if steps:
            kept.append(f"{what} step {steps[-1]} in {folder}")
    if not kept:
        return (f"jaxrl-llm {command}: interrupted (Ctrl-C) before the first checkpoint; nothing was kept: the same "
                "command starts the run over")
    return (f"jaxrl-llm {command}: interrupted (Ctrl-C); kept the last checkpoint{'s' if len(kept) > 1 else ''} "
            f"({'; '.join(kept)}): run the same command again to resume from {'them' if len(kept) > 1 else 'it'}")


def report(command: str, body: Callable[[], int]) -> int:
    """Runs `body()` (the command) and returns its exit code; a user's error prints one line to stderr and gives
    `EXIT_USER_ERROR`, Ctrl-C `EXIT_INTERRUPTED` with `interrupt_line`; with `JAXRL_LLM_DEBUG=1` the traceback
    comes first. Every other exception propagates (a bug's traceback)."""
    try:
        return body()
    except KeyboardInterrupt:
        if debug():
            traceback.print_exc()
        print(interrupt_line(command), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BaseException as error:
        if not isinstance(error, user_errors()):
            raise
        if debug():
            traceback.print_exc()
        print(f"jaxrl-llm {command}: {message(error)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


def message(error: BaseException) -> str:
    """`jaxrl_base.one_line` without the type's name, which the line does not need (the message names the
    thing); an error with no message keeps its type's name."""
    line = one_line(error)
    prefix = f"{type(error).__name__}: "
    return line[len(prefix):] if line.startswith(prefix) else line
