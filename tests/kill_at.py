"""Fault injection for the SIGKILL tests: a loop-event hook (`jaxrl_llm.train.events`) that kills this process
at one moment of a run, and a driver that runs a command's loops with it.

    python tests/kill_at.py grpo_step@3 train PRESET --set KEY=VALUE ...

runs what `jaxrl-llm train` (or `experiment`: SFT, then the GRPO stages) runs, and SIGKILLs itself at the named
point of the named step. Points: `sft_step`, `grpo_step`, `eval` (the loop's events of those names),
`async_save` (the moment a GRPO checkpoint's save has started, perhaps not committed), `after_commit` (the same
moment, once that save is committed), and `sft_async_save` / `sft_after_commit` (the same two moments of an SFT
progress checkpoint). A run that never reaches the point ends normally (exit 0), which the
tests take as a failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from jaxrl_llm.config import load_config
from jaxrl_llm.train import build, run_sft, train_grpo
from jaxrl_llm.train.events import EventHook, LoopEvent

# kill point -> (the loop event it happens at, whether the pending checkpoint is committed first)
POINTS = {"sft_step": ("sft_step", False), "grpo_step": ("grpo_step", False), "eval": ("eval", False),
          "async_save": ("save", False), "after_commit": ("save", True),
          "sft_async_save": ("sft_save", False), "sft_after_commit": ("sft_save", True)}


def kill_hook(spec: str) -> EventHook:
    """The hook that SIGKILLs this process at "<point>@<step>" (a point of POINTS)."""
    name, _, step = spec.partition("@")
    if name not in POINTS or not step.isdigit():
        raise ValueError(f"kill point {spec!r}: expected <point>@<step> with a point of {sorted(POINTS)}")
    point, commit_first = POINTS[name]

    def hook(event: LoopEvent) -> None:
        if event.point == point and event.step == int(step):
            if commit_first:
                event.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main(argv: list[str] | None = None) -> int:
    """Runs the loops of `train` (GRPO) or `experiment` (SFT, then GRPO) with the kill hook of `spec`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="<point>@<step>")
    parser.add_argument("command", choices=("train", "experiment"))
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    hook = kill_hook(args.spec)
    config = load_config(args.config, args.set)
    comp = build(config)
    if args.command == "experiment":
        run_sft(config, comp, on_event=hook)
    train_grpo(config, comp, on_event=hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
