"""One process of a multi-process test run: the `jaxrl-llm` command, optionally with a record of the files this
process writes under a folder, and optionally SIGKILLed at a loop event of `train` (`tests/kill_at.py`).

    python tests/multihost_run.py [--writes LOG --watch FOLDER] [--kill-at grpo_step@2] -- train PRESET --set ...
    python tests/multihost_run.py --die raise|kill --port PORT --index I      # a run in which process 1 dies

--writes: every file this process opens for writing, renames or removes under --watch (Python's audit events;
Orbax's tensorstore writes in C++ are not seen, which is why the tests keep the checkpoints in another folder)
is appended to LOG as it happens, so the record survives a SIGKILL.

Every process writes JAX's persistent compilation cache here (`every_process_writes_the_compilation_cache`), so a
test's second and later starts load process 1's programs as they load process 0's.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def record_writes(log: Path, folder: Path) -> None:
    """Appends to `log` each path under `folder` that this process opens for writing, renames or removes."""
    folder = str(folder.resolve())
    out = open(log, "a", buffering=1, encoding="utf-8")  # opened before the hook: not recorded

    def under(path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        try:
            full = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return full if full == folder or full.startswith(folder + os.sep) else None

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            found = under(path) if writing else None
        elif event in ("os.rename", "os.replace", "os.remove", "os.unlink", "shutil.rmtree"):
            found = under(args[0])
        else:
            return
        if found:
            out.write(f"{event} {found}\n")

    sys.addaudithook(hook)


def every_process_writes_the_compilation_cache() -> None:
    """Lets this process write JAX's persistent compilation cache, which JAX leaves to process 0 alone.

    On XLA:CPU a multi-process program's cache key differs from process to process (JAX strips the device
    assignment from the key on GPU only), so process 1 never finds process 0's entries and, writing none of its own,
    compiled every program again at every start: 48 s for the GRPO step of the tests' tiny model beside the
    suite. Writing its entries makes the next start load them. The harness changes nothing else: a program
    loaded from the cache is the one the compile would give. If this JAX lacks the private hook, nothing is changed.
    """
    try:
        from jax._src import compiler
        from jax._src import distributed as jax_distributed
    except ImportError:
        return
    write = getattr(compiler, "_cache_write", None)
    if write is None or not hasattr(jax_distributed, "global_state"):
        return

    def write_as_process_0(*args, **kwargs):
        state = jax_distributed.global_state
        index, state.process_id = state.process_id, 0  # `_cache_write` returns early unless process_id is 0
        try:
            return write(*args, **kwargs)
        finally:
            state.process_id = index

    compiler._cache_write = write_as_process_0


def die(mode: str, port: int, index: int) -> int:
    """Two processes meet (`distributed.run`), do one collective, then process 1 fails: "raise" (an exception) or
    "kill" (SIGKILL). Process 0 then waits in a collective that never completes, until its watchdog ends it."""
    import signal

    from jaxrl_llm import distributed

    def body() -> int:
        import jax
        import numpy as np

        rows = np.zeros(jax.device_count(), np.float32)
        total = lambda: distributed.gather(distributed.place_batch(rows, np.arange(len(rows))))  # noqa: E731
        total()
        if index == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("boom in process 1")
        total()  # process 1 never comes
        return 0

    launch = distributed.Launch(coordinator=f"localhost:{port}", num_processes=2, process_id=index)
    return distributed.run(launch, body, "jaxrl-llm test", quiet_others=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=Path, default=None)
    parser.add_argument("--watch", type=Path, default=None)
    parser.add_argument("--kill-at", default=None, help="<point>@<step> of tests/kill_at.py (train only)")
    parser.add_argument("--die", choices=("raise", "kill"), default=None, help="with --port and --index: see `die`")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--index", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    every_process_writes_the_compilation_cache()
    if args.die:
        return die(args.die, args.port, args.index)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.writes is not None:
        record_writes(args.writes, args.watch)
    cli = importlib.import_module("jaxrl_llm.cli.main")  # the package's `main` attribute is the function

    if args.kill_at is not None:  # inside the command: jax is set up by then (the distributed runtime first)
        cmd_train = cli.cmd_train

        def killed_train(parsed) -> int:
            import jaxrl_llm.train as train
            from kill_at import kill_hook

            train.train_grpo = functools.partial(train.train_grpo, on_event=kill_hook(args.kill_at))
            return cmd_train(parsed)

        cli.cmd_train = killed_train
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main())
