"""Names that moved to another module stay importable from their old place, resolved on first use.

    __getattr__ = moved_names(__name__, {"make": "envs.registry", ...})

at the end of the old module makes `from old import make` work as before. The new module is imported only
when the name is asked for (PEP 562), so the old module does not import the new one at load time and no
import circle forms when the new module imports the old one (the layering test counts static imports).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that resolves each name of `moves` (name -> the module it lives in now)."""

    def __getattr__(name: str) -> Any:
        if name in moves:
            return getattr(importlib.import_module(moves[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
