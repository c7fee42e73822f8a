"""The named errors of bad user input: one base class, one subclass per kind of thing a user brings.

Each error's message names the thing (a file and 1-based line, a config key, a tensor, an env function) and
the fix. The CLI prints any `JaxrlError` as one line and exits with status 2 (`JAXRL_LLM_DEBUG=1` shows the
traceback); every other exception stays a traceback, because it is a bug. Each subclass also derives from
the built-in type its callers caught before (ValueError), so existing `except ValueError` code keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["JaxrlError", "ConfigError", "DataError", "EnvError", "CheckpointError", "ModelError", "one_line"]


class JaxrlError(Exception):
    """Base of every error caused by a user's input (config, data, env, checkpoint, model), not by a bug."""


class ConfigError(JaxrlError, ValueError):
    """An invalid configuration value; `path` is its key path, e.g. ("grpo", "0", "temperature")."""

    def __init__(self, reason: str, path: Sequence[str | int] = (), owner: str | None = None):
        self.reason = reason
        self.path = tuple(str(p) for p in path)
        self.owner = owner
        where = ".".join(self.path)
        if owner and where:
            where = f"{owner}.{where}"
        super().__init__(f"{where}: {reason}" if where else reason)

    @property
    def key(self) -> str:
        """The dotted key path, e.g. "grpo.0.temperature" ("" for the whole config)."""
        return ".".join(self.path)

    def prefixed(self, *prefix: str | int) -> "ConfigError":
        """The same error one or more levels further out (the owner class is dropped: the path says it)."""
        return ConfigError(self.reason, (*prefix, *self.path))


class DataError(JaxrlError, ValueError):
    """A data file or dataset that cannot be used as it is: names the file, the 1-based line or row, the field."""


class EnvError(JaxrlError, ValueError):
    """An environment that breaks the protocol or yields unusable values: names the env function and field."""


class CheckpointError(JaxrlError, ValueError):
    """A checkpoint that cannot be read, restored or written: names the folder, step, file or tensor."""


class ModelError(JaxrlError, ValueError):
    """A model config, family or weights that cannot be used: names the key, tensor or model_type."""


def one_line(error: BaseException) -> str:
    """The error as one line for the CLI: its type and message, inner newlines joined with "; "."""
    text = "; ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
