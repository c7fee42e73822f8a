"""Quiet the leftovers of a failed Orbax read, so that the one useful line (the damaged step named, the step used
instead) is what the user reads.

When one array of a damaged step cannot be read, Orbax abandons the other reads of that restore: each later
reports itself when it is garbage-collected, as "Exception ignored in: <coroutine ...>" (Python's unraisable
hook) or "Task exception was never retrieved" (the `asyncio` logger), with a TensorStore spec of some 60 lines
each: thousands of lines for a real model. `silence_failed_reads()`, called where the checkpointer has turned
the failure into its named error, collects them at once and drops, from then on, exactly these reports (an
exception raised in Orbax's own code); every other unraisable exception and asyncio error is shown as before.
"""

from __future__ import annotations

import gc
import logging
import sys
from types import TracebackType
from typing import Any

__all__ = ["silence_failed_reads", "from_orbax"]

_ORBAX_PATHS = ("orbax/checkpoint", "orbax\\checkpoint")
_INSTALLED: dict[str, Any] = {}


def _frames(tb: TracebackType | None):
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def from_orbax(error: BaseException | None) -> bool:
    """Whether `error` (or an exception it was raised from) was raised inside Orbax's checkpoint code."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(marker in name for name in _frames(error.__traceback__) for marker in _ORBAX_PATHS):
            return True
        error = error.__cause__ or error.__context__
    return False


class _AsyncioFilter(logging.Filter):
    """Drops the asyncio logger's reports of tasks whose exception came from Orbax."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None and isinstance(getattr(record, "args", None), dict):
            error = record.args.get("exception")
        return not from_orbax(error)


def _unraisable_hook(unraisable: Any) -> None:
    if from_orbax(getattr(unraisable, "exc_value", None)):
        return
    _INSTALLED["previous"](unraisable)


def silence_failed_reads() -> None:
    """Installs (once) the two filters above, then collects the abandoned reads while they are in place."""
    if not _INSTALLED:
        _INSTALLED["previous"] = sys.unraisablehook
        sys.unraisablehook = _unraisable_hook
        logging.getLogger("asyncio").addFilter(_AsyncioFilter())
    gc.collect()
