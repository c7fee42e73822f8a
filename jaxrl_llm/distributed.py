"""One run over several processes: JAX's multi-controller runtime (`jax.distributed`), one writer, one failure.

A multi-host run is N copies of the same command, one per host (or per process on one machine), that together
see every device: each jitted step spans all of them and XLA moves the data between hosts. This module is what
the framework needs on top of JAX for that:

- `initialize(Launch)`: starts the runtime, from the cluster's environment (`--distributed`: SLURM, Open MPI,
  Kubernetes, Cloud TPU, as JAX detects) or by hand (`--coordinator HOST:PORT --num-processes N --process-id I`).
  On the CPU the cross-process collectives are gloo.
- One writer: `is_writer()` (process 0) takes the run lock, writes metrics, plots, samples and results, and
  prints; the others compute the same steps and write nothing (`writer_only`).
- One failure ends the run: the process that fails publishes one line (`fail`) in the runtime's key-value
  store and leaves without waiting at a barrier; every other process has a watchdog thread that reads it,
  prints "process I of N failed: ..." and leaves too. A process killed outright stops beating in that store:
  the others notice within `LIVENESS_S` seconds and leave with one line naming it. Only the coordinator
  (process 0) killed outright ends the others through JAX's own fatal error ("another task died"), at once.
- Global arrays: `replicated` (host values that are equal everywhere, e.g. a step count or a key, as one
  array over all devices, which a joint Orbax checkpoint needs), `all_true` and `broadcast` (host decisions
  made the same everywhere), `gather` (a sharded array back to every host) and `local_rows` (this process's
  share of a batch read from a file).

Without `initialize` (one process) every helper is the identity or a no-op, so single-process code pays nothing.
jax is imported inside the functions: the CLI's `--help` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import time
import traceback
from typing import Any, Callable

from jaxrl_base.errors import ConfigError

__all__ = ["Launch", "run", "initialize", "is_initialized", "process_index", "process_count", "is_writer",
           "writer_only", "write_text", "note_error", "fail", "finish", "default_sharding", "replicated", "all_true",
           "broadcast", "gather", "place_batch", "local_rows"]

LIVENESS_S = 10  # seconds without a beat after which the watchdog takes a process for dead
BEAT_S = 1.0  # how often each watchdog beats and reads the others'
HEARTBEAT_S = 30  # JAX's own heartbeat timeout (its default: 100), the fallback if a watchdog cannot run
INIT_TIMEOUT_S = 300  # how long the processes wait for each other at the start (JAX's default)
SHUTDOWN_TIMEOUT_S = 60  # how long a finished process waits at the final barrier for the others
PREFIX = "jaxrl_llm/"  # the run's entries in JAX's key-value store
FAILURE_KEY = PREFIX + "failure"  # what a failing process publishes: "<process>\t<one line>"
GRACE_S = 2.0  # how long a failing coordinator (process 0) stays up so the others can read its failure


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a command joins a multi-process run. auto: `--distributed` (JAX detects the cluster; any of the
    three fields below given too is passed on); coordinator "HOST:PORT", num_processes N, process_id I: a
    run started by hand (all three, or with auto, whatever the cluster does not provide)."""

    auto: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def enabled(self) -> bool:
        """Whether the command runs as one process of several (any flag given)."""
        return self.auto or any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))

    def check(self) -> None:
        """ConfigError naming the flag when the flags do not describe a run: by hand all three are needed,
        HOST:PORT must have a port, 0 <= process_id < num_processes."""
        given = {"--coordinator": self.coordinator, "--num-processes": self.num_processes,
                 "--process-id": self.process_id}
        missing = [flag for flag, v in given.items() if v is None]
        if not self.auto and self.enabled and missing:
            raise ConfigError(f"a run started by hand needs --coordinator HOST:PORT, --num-processes N and "
                              f"--process-id I (missing {', '.join(missing)}); or pass --distributed on a cluster "
                              "JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU)")
        if self.coordinator is not None and not re.fullmatch(r".+:\d{1,5}", self.coordinator):
            raise ConfigError(f"--coordinator {self.coordinator!r} is not HOST:PORT (e.g. localhost:12355 or "
                              "node001:12355, the host of process 0 and a free port there)")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"--num-processes must be >= 1 (got {self.num_processes})")
        if self.process_id is not None and self.num_processes is not None \
                and not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"--process-id {self.process_id} is not in 0 .. {self.num_processes - 1} "
                              f"(--num-processes {self.num_processes})")


class _Runtime:
    """This process's part of a run: its index, the count, the command (for messages) and the watchdog."""

    def __init__(self, index: int, count: int, command: str):
        self.index, self.count, self.command = index, count, command
        self.done = threading.Event()
        self.failed = False

    def say(self, line: str) -> None:
        """One line to stderr, flushed (the process may leave right after)."""
        print(f"{self.command}: {line}", file=sys.stderr, flush=True)


_RUNTIME: _Runtime | None = None


def is_initialized() -> bool:
    """Whether `initialize` started a multi-process run in this process."""
    return _RUNTIME is not None


def process_index() -> int:
    """This process's index in the run (0 without a multi-process run; jax is not imported for it)."""
    if _RUNTIME is not None:
        return _RUNTIME.index
    jax = sys.modules.get("jax")
    return 0 if jax is None else int(jax.process_index())


def process_count() -> int:
    """The number of processes in the run (1 without a multi-process run)."""
    if _RUNTIME is not None:
        return _RUNTIME.count
    jax = sys.modules.get("jax")
    return 1 if jax is None else int(jax.process_count())


def is_writer() -> bool:
    """Whether this process writes the run's files and prints its progress: process 0 only."""
    return process_index() == 0


def writer_only(func: Callable) -> Callable:
    """`func` run by the writer (process 0); elsewhere a no-op returning None."""
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs) if is_writer() else None

    wrapper.__name__, wrapper.__doc__ = func.__name__, func.__doc__
    return wrapper


def write_text(path, text: str) -> None:
    """`Path(path).write_text(text)` (UTF-8) by the writer (process 0) alone."""
    if is_writer():
        from pathlib import Path

        Path(path).write_text(text, encoding="utf-8")


# ---- start, failure, end ----


def _client():
    from jax._src import distributed as jax_distributed  # the runtime's key-value store (None after shutdown)

    return jax_distributed.global_state.client


def initialize(launch: Launch, command: str = "jaxrl-llm", quiet_others: bool = False) -> None:
    """Starts JAX's distributed runtime as `launch` says (before anything else touches a device) and this
    process's watchdog. On the CPU the collectives between processes are gloo. `command` prefixes the one-line
    messages (e.g. "jaxrl-llm train"). quiet_others: the standard output of every process but 0 goes to
    /dev/null from here on (Python's and the C libraries', e.g. gloo's), so the run prints once; errors still
    reach stderr."""
    global _RUNTIME
    launch.check()
    import jax

    if _RUNTIME is not None:
        raise RuntimeError("jaxrl_llm.distributed.initialize was called twice")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                               initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    runtime = _Runtime(jax.process_index(), jax.process_count(), command)
    _RUNTIME = runtime
    if quiet_others and runtime.index != 0:
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    threading.Thread(target=_watch, args=(runtime,), name="jaxrl_llm-watchdog", daemon=True).start()
    _warm_up()


def _warm_up() -> None:
    """One all-reduce over every device of the run while the processes are in step (they have just met at JAX's
    start). On the CPU, gloo builds its context for a set of devices at their first collective and waits only 30
    s there for the other processes; built here, the context of all the devices is reused later, when one
    process may reach a collective long after the others (a slower compile, a checkpoint to read)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = _mesh()
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
    zeros = jax.make_array_from_process_local_data(spread, np.zeros(jax.local_device_count(), np.float32))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jax.block_until_ready(jax.jit(jnp.sum, out_shardings=whole)(zeros))


def _leave(runtime: _Runtime, line: str) -> None:
    """Another process failed or vanished: one line, then this process leaves (no barrier can complete). The
    coordinator first gives a failing peer a moment to leave with its own exit code."""
    runtime.done.set()
    runtime.say(f"{line}; ending process {runtime.index} too")
    if runtime.index == 0:
        time.sleep(GRACE_S)
    os._exit(1)


def _watch(runtime: _Runtime) -> None:
    """The watchdog thread. Every `BEAT_S`: this process's beat in the key-value store, then every entry
    under `PREFIX`: a failure line published by another process (`fail`) ends this one with that line; a
    peer whose beat has not moved for `LIVENESS_S` (killed, or its host lost) ends it naming that peer; a
    store that stops answering means the coordinator (process 0, which serves it) is gone."""
    beat, errors = 0, 0
    seen: dict[str, tuple[str, float]] = {}
    started = time.monotonic()
    while not runtime.done.is_set():
        try:
            client = _client()
            if client is None:
                return
            beat += 1
            client.key_value_set(f"{PREFIX}alive/{runtime.index}", str(beat), allow_overwrite=True)
            entries = dict(client.key_value_dir_get(PREFIX))
            errors = 0
        except Exception as error:  # noqa: BLE001 - the store is unreachable
            errors += 1
            if errors >= 3 and not runtime.done.is_set():
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                _leave(runtime, f"lost the run's coordinator, process 0 of {runtime.count} (killed, or its host "
                                f"lost: {first[:160]})")
            time.sleep(BEAT_S)
            continue
        if runtime.done.is_set():
            return
        failure = entries.get(FAILURE_KEY)
        if failure is not None:
            index, _, line = failure.partition("\t")
            if index != str(runtime.index):
                _leave(runtime, f"process {index} of {runtime.count} failed: {line}")
            return
        now = time.monotonic()
        for peer in range(runtime.count):
            if peer == runtime.index:
                continue
            value = entries.get(f"{PREFIX}alive/{peer}")
            if peer not in seen or seen[peer][0] != value:
                seen[peer] = (value, now)
            elif now - max(seen[peer][1], started) > LIVENESS_S:
                _leave(runtime, f"process {peer} of {runtime.count} stopped responding (no sign of life for "
                                f"{LIVENESS_S} s: killed, out of memory, or its host lost)")
        time.sleep(BEAT_S)


_last_error: str | None = None


def note_error(line: str) -> None:
    """Records the one line a command printed for its error, for `run` to pass on to the other processes."""
    global _last_error
    _last_error = line


def fail(line: str, code: int = 1) -> None:
    """This process failed (`line`: its error in one line, already printed here): tell the others and leave
    at once with `code`, without the final barrier (which the others would never reach)."""
    runtime = _RUNTIME
    if runtime is None:
        raise RuntimeError("jaxrl_llm.distributed.fail outside a multi-process run")
    runtime.done.set()
    try:
        _client().key_value_set(FAILURE_KEY, f"{runtime.index}\t{line}")
    except Exception:  # noqa: BLE001 - another process published first, or the coordinator is gone
        pass
    if runtime.index == 0 and runtime.count > 1:
        time.sleep(GRACE_S)  # process 0 serves the key-value store: let the others read the line
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish() -> None:
    """The command ended well here: wait for the others at JAX's final barrier (a failure of theirs meanwhile
    still ends this process through the watchdog), then stop the runtime."""
    global _RUNTIME
    runtime = _RUNTIME
    if runtime is None:
        return
    import jax

    jax.distributed.shutdown()
    runtime.done.set()
    _RUNTIME = None


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, a peer gone


def _await_watchdog(line: str) -> None:
    """Before this process reports its own exception: a collective that broke because another process died
    or failed gives the watchdog time to name that process instead (it ends this one meanwhile)."""
    time.sleep(LIVENESS_S + 3 * BEAT_S if any(text in line for text in PEER_LOST) else 2 * BEAT_S)


def run(launch: Launch, body: Callable[[], int], command: str = "jaxrl-llm", quiet_others: bool = False) -> int:
    """`body()` (a command: returns its exit code; prints its own error line) as one process of the run that
    `launch` describes, or as it is when `launch` is not enabled. A non-zero code or an exception ends every
    process of the run with one line (`fail`); a zero code waits for the others (`finish`). quiet_others: see
    `initialize`."""
    if not launch.enabled:
        return body()
    initialize(launch, command, quiet_others)
    try:
        code = body()
    except BaseException as error:  # noqa: BLE001 - a bug: its traceback here, one line to the others
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        _await_watchdog(line)
        traceback.print_exc()
        fail(line, 1)
    if code:
        fail(_last_error or f"exit code {code}", code)
    finish()
    return 0


# ---- global arrays and host decisions ----


def _mesh():
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))


def default_sharding():
    """Where an array goes that nothing else places (a restored step count, params before they are sharded): the
    first device in one process; replicated over every device in a multi-process run, where the first device
    belongs to process 0 alone."""
    import jax

    if process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec())


def replicated(tree: Any) -> Any:
    """Each leaf that only this host holds (a host value, an array on one local device) as one global array
    replicated over every device of the run; global arrays stay as they are. The values must be equal on every
    process (a step count, the run's key): what a joint Orbax checkpoint and a multi-host jit need. One process:
    `tree` unchanged."""
    if process_count() == 1:
        return tree
    import jax
    import numpy as np

    sharding = jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec())

    def leaf(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x
        if not hasattr(x, "shape") and not isinstance(x, (int, float, bool, np.generic)):
            return x
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(leaf, tree)


def all_true(flag: bool) -> bool:
    """Whether `flag` is True on every process (a collective: every process must call it); one process: flag."""
    if process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def broadcast(value: Any) -> Any:
    """Process 0's `value` (a host number or array tree) on every process (a collective); one process: value."""
    if process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(value)


def gather(tree: Any) -> Any:
    """A tree of (possibly sharded) global arrays as host numpy arrays, whole, on every process (a collective);
    one process: `jax.device_get`."""
    import jax
    import numpy as np

    if process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def leaf(x):  # a host value or an array this process holds whole is already here
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(leaf, tree)


def place_batch(array, index):
    """`array[index]` (host data, rows picked by `index`) as a step's batch. One process: `jnp.asarray` of it. A
    multi-host run: one global array whose rows are split over every device of the run; each process reads and
    places only its own rows (`jax.make_array_from_process_local_data`), never the whole batch. The batch size
    must be a multiple of the run's device count (ConfigError)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if process_count() == 1:
        return jnp.asarray(array[index])
    num = len(index)
    if num % jax.device_count():
        raise ConfigError(f"a batch of {num} rows cannot be split evenly over the run's {jax.device_count()} devices: "
                          f"make the batch size a multiple of {jax.device_count()}")
    sharding = jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec("all"))
    mine = np.asarray(array[np.asarray(index)[local_rows(num, sharding)]])
    return jax.make_array_from_process_local_data(sharding, mine, (num, *np.shape(array)[1:]))


def local_rows(num_rows: int, sharding) -> slice:
    """The rows [start, stop) of a batch of `num_rows` that this process feeds when the batch's leading axis is
    laid out by `sharding` (the rows of its addressable devices; contiguous, as a mesh over the processes'
    devices in order gives). One process: every row."""
    if process_count() == 1:
        return slice(0, num_rows)
    indices = sharding.addressable_devices_indices_map((num_rows,)).values()
    starts = [i[0].start or 0 for i in indices]
    stops = [num_rows if i[0].stop is None else i[0].stop for i in indices]
    return slice(min(starts), max(stops))
