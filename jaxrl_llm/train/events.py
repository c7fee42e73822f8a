"""Loop events: named moments of the training loops that a caller may observe through an `on_event` hook.

`run_sft(..., on_event=hook)` (`train_sft`) and `train_grpo(..., on_event=hook)` call `hook(LoopEvent(point, step,
...))` (through `train.loop.run_loop`) at

| point | moment |
|---|---|
| `sft_step` | SFT step `step` (1-based) computed (its check and held-out eval too), its row not yet written |
| `grpo_step` | GRPO step `step` computed (params updated, metrics on the host), its row not yet written |
| `eval` | the evaluation after GRPO step `step` computed, its row not yet written |
| `save` | the checkpoint of step `step` started (asynchronous: perhaps not committed; `checkpointer.wait()` commits) |
| `sft_save` | the same for an SFT progress checkpoint (`train.sft_resume`) |

The default hook does nothing. Tests install one that kills the process at a chosen event
(`tests/kill_at.py`), to prove that a run killed there resumes to the uninterrupted run's metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["LoopEvent", "EventHook", "no_events"]


@dataclasses.dataclass(frozen=True)
class LoopEvent:
    """One moment of a training loop: the point's name, the global step, and at `save` the Checkpointer."""

    point: str
    step: int
    checkpointer: Any = None


EventHook = Callable[[LoopEvent], None]


def no_events(event: LoopEvent) -> None:
    """The default hook: ignores every event."""
