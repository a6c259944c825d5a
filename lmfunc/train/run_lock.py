"""The lock that keeps two runs out of one folder.

Rank 0 of a run creates ``<folder>/lmfunc.lock`` (exclusively, ``O_CREAT | O_EXCL``) before it
writes anything there, holding the host, the pid, the process's start time in the kernel's clock
ticks (``/proc/<pid>/stat``; absent off Linux) and the wall-clock start, and deletes it when the
run ends. A second run that finds the lock is refused with the holder's details. A lock whose
holder is known to be gone (same host, and no such process, or a process of that pid that started
at another time: the pid was reused) is stale: it is taken over, with a message. A
holder on another host cannot be checked from here (multi-node runs share the filesystem, not the
process table), so such a lock is always refused; delete the file when that run is known to have
died.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from lmfunc.config.model import ConfigError

LOCK_FILE = "lmfunc.lock"


def process_start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``);
    None where there is no such file (no such process, or no procfs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def _holder_alive(holder: dict) -> Optional[bool]:
    """Whether the lock's process runs: True/False on this host, None for another host. A process
    with the lock's pid that started at another time than the one recorded is another process."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    except (KeyError, TypeError, ValueError):
        return False
    recorded, now = holder.get("process_start"), process_start_ticks(pid)
    return not (isinstance(recorded, int) and now is not None and now != recorded)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


class RunLock:
    """An acquired lock on one folder; ``release`` deletes it (only if it is still this process's)."""

    def __init__(self, folder: str, taken_over: Optional[str] = None) -> None:
        self.path = os.path.join(folder, LOCK_FILE)
        self.taken_over = taken_over
        """A message when a stale lock was replaced, else None."""
        self._mine = {"host": socket.gethostname(), "pid": os.getpid()}

    def release(self) -> None:
        holder = _read(self.path)
        if holder.get("host") == self._mine["host"] and holder.get("pid") == self._mine["pid"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def acquire(folder: str, what: str = "run folder") -> RunLock:
    """Lock ``folder`` (created if missing) for this process, or raise ``ConfigError`` naming the
    holder. A stale lock (holder gone, same host) is taken over."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    taken_over = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            alive = _holder_alive(holder)
            if alive is False and taken_over is None:
                taken_over = f"took over the stale lock {path} ({_describe(holder)}: that process is gone)"
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                continue
            where = "on another host: lmfunc cannot check it from here" if alive is None else "still running"
            raise ConfigError(
                f"{what} {folder} is in use by another lmfunc run ({_describe(holder)}, {where}); "
                f"wait for it, pick another folder, or delete {path} if that run has died"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "process_start": process_start_ticks(os.getpid()),
                       "started": time.time()}, f)
            f.write("\n")
        return RunLock(folder, taken_over)
    raise ConfigError(f"could not lock {what} {folder}: another process keeps replacing {path}")
