"""The launch flags of the commands that can run over several processes (experiment, sft, train, eval) and
how a command runs as one process of such a run (`jaxrl_llm.distributed`).

    jaxrl-llm train PRESET --distributed                       # on a cluster JAX detects (SLURM, Open MPI, ...)
    jaxrl-llm train PRESET --coordinator HOST:PORT --num-processes N --process-id I   # by hand

Every process runs the same command; process 0 writes and prints, the others print only their errors.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from jaxrl_base.errors import ConfigError, one_line
from jaxrl_llm import distributed

__all__ = ["add_launch_flags", "launch_of", "run_command"]


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Adds --distributed, --coordinator, --num-processes and --process-id to a command's parser."""
    group = parser.add_argument_group("multi-host run (one process per host; see the README's multi-host section)")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run that JAX detects from the cluster's environment (SLURM, Open "
                            "MPI, Kubernetes, Cloud TPU)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="start a multi-process run by hand: the address of process 0 and a free port there")
    group.add_argument("--num-processes", type=int, default=None, metavar="N", help="with --coordinator: how many")
    group.add_argument("--process-id", type=int, default=None, metavar="I", help="with --coordinator: this one, 0..N-1")


def launch_of(args: argparse.Namespace) -> distributed.Launch:
    """The `Launch` the parsed flags describe (not enabled for a command without the flags)."""
    return distributed.Launch(auto=bool(getattr(args, "distributed", False)),
                              coordinator=getattr(args, "coordinator", None),
                              num_processes=getattr(args, "num_processes", None),
                              process_id=getattr(args, "process_id", None))


def _noting(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`func` that records its exception's one line (`distributed.note_error`) before passing it on."""
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BaseException as error:
            distributed.note_error(one_line(error))
            raise

    return wrapper


def run_command(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """`body(args)` (the CLI's dispatch, printing its own errors) as it is, or, with the launch flags, as one
    process of a multi-process run: the runtime started first, the output of processes other than 0 kept to
    stderr, and a failure anywhere ending every process with one line (`distributed.run`)."""
    launch = launch_of(args)
    if not launch.enabled:
        return body(args)
    try:
        launch.check()
    except ConfigError as error:  # flags that describe no run: one line, before anything starts
        print(f"jaxrl-llm {args.command}: {error}", file=sys.stderr)
        return 2
    args.func = _noting(args.func)

    # One writer: progress and results come from process 0; the others' standard output goes to /dev/null.
    return distributed.run(launch, lambda: body(args), f"jaxrl-llm {args.command}", quiet_others=True)
