"""One trainer per output folder: the run lock (`RunLock`) and the refusal to overwrite a run (`RunExistsError`).

`<folder>/jaxrl_llm.lock` holds the owner's PID, host, process start time and command. The lock is a file
created with O_EXCL, so of two processes that race for it one wins; a lock whose owner died on this host is
taken over. In a multi-host run process 0 alone holds it (`distributed.is_writer`): the other processes of the
run write nothing there. Independent of checkpoints and of the experiment schema.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from jaxrl_base.errors import CheckpointError, JaxrlError
from jaxrl_llm import distributed

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError", "RunExistsError"]


class RunLockedError(RuntimeError, JaxrlError):
    """Another live process holds the output folder's lock (one trainer per folder)."""


class RunExistsError(FileExistsError, CheckpointError):
    """checkpoint.resume = false on a folder that already holds a run: refused, nothing is truncated."""


LOCK_FILE = "jaxrl_llm.lock"
# The lock files this process holds -> nesting depth (experiment -> sft -> train). Process-wide on purpose:
# the lock file is one per process, so the count of its holders in this process is too.
_HELD: dict[str, int] = {}


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc/<pid>/stat field 22), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process `pid` (started at `start`, when recorded) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        if state in ("Z", "X"):  # a zombie: dead, not yet reaped
            return False
    except OSError:
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start  # a different start time: the PID was reused


class RunLock:
    """One trainer per output folder: `<folder>/jaxrl_llm.lock` holds the owner's PID, host and start time.

        with RunLock(config.run.output_dir):
            ...   # train: checkpoints, metrics

    A second process that asks for the lock while the owner runs gets RunLockedError naming the PID, host
    and since when, instead of interleaving checkpoints and metrics. A lock left by a process that died
    (SIGKILL, power loss) on this host is stale: it is taken over with a warning. A lock from another host
    cannot be checked from here: the error says which file to delete once no trainer runs there. The same
    process may nest locks on one folder (the experiment command runs SFT and GRPO under one lock).
    """

    def __init__(self, folder: str | os.PathLike, log=print):
        self.folder = Path(folder).expanduser().absolute()
        self.path = self.folder / LOCK_FILE
        self.log = log

    def _mine(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _process_start(os.getpid()),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}

    def acquire(self) -> RunLock:
        if not distributed.is_writer():  # multi-host: the run's lock is process 0's
            return self
        key = str(self.path)
        if _HELD.get(key):
            _HELD[key] += 1
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._mine(), f)
            _HELD[key] = 1
            return self
        raise RunLockedError(f"could not take the lock {key!r} (it keeps changing hands)")

    def _take_over_if_stale(self) -> None:
        """Raises RunLockedError unless the lock file belongs to no live process; a stale one is removed."""
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = {}, None, None
        if pid is not None:
            since = f" since {owner.get('since')}" if owner.get("since") else ""
            command = f" ({owner['command']})" if owner.get("command") else ""
            if host != socket.gethostname():
                raise RunLockedError(
                    f"{str(self.folder)!r} is in use by PID {pid} on host {host!r}{since}{command}: one trainer per "
                    f"output folder. If no trainer runs there any more, delete {str(self.path)!r}; or use another "
                    "run.output_dir")
            if pid == os.getpid() or _alive(pid, owner.get("pid_start")):
                if pid == os.getpid():  # a lock of this very process that was not released: take it back
                    self.path.unlink(missing_ok=True)
                    return
                raise RunLockedError(
                    f"{str(self.folder)!r} is in use by PID {pid} on this host ({host}){since}{command}: one trainer "
                    "per output folder. Wait for it to finish or stop it, or use another run.output_dir")
            what = f"PID {pid} on host {host}{since}, which no longer runs"
        else:
            what = "an unreadable lock file"
        stale = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.rename(self.path, stale)  # atomic: of two processes taking over, one wins
        except FileNotFoundError:
            return
        stale.unlink(missing_ok=True)
        self.log(f"warning: removed the stale lock {str(self.path)!r} of {what}")

    def release(self) -> None:
        key = str(self.path)
        if not _HELD.get(key):
            return
        _HELD[key] -= 1
        if _HELD[key] == 0:
            del _HELD[key]
            try:
                owner = json.loads(self.path.read_text())
                if int(owner.get("pid", -1)) == os.getpid():
                    self.path.unlink()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
