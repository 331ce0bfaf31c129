"""One run per workdir: `WORKDIR/run.lock`, held for the run's life by its process 0.

The lock is an exclusive `flock` on the file, which the kernel releases when the process ends
however it ends (kill -9 included); the file says who holds it (host, PID, start time). A
second run on the workdir stops at once naming the holder. A lock file whose process is gone
(its flock released, its content left by a crash) is taken over with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from bov_jax.errors import UserError

log = logging.getLogger("bov_jax")

LOCK_FILE = "run.lock"


class WorkdirBusyError(UserError, RuntimeError):
    """Another run holds the workdir."""

    exit_status = 1


def describe(holder: str) -> str:
    """'host h, PID p, started at t' from a lock file's content (or what it holds)."""
    try:
        who = json.loads(holder)
        return f"host {who['host']}, PID {who['pid']}, started {who['started']}"
    except (ValueError, KeyError, TypeError):
        return f"an unknown holder ({holder.strip()[:80]!r})" if holder.strip() else "a run"


def _try_lock(file: IO[str]) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def holder(workdir: Path) -> str | None:
    """Who runs in `workdir` now ('host h, PID p, started t'), or None if nobody does."""
    path = Path(workdir) / LOCK_FILE
    try:
        file = open(path)  # noqa: SIM115 -- closed below, after the lock test
    except FileNotFoundError:
        return None
    with file:
        if _try_lock(file):
            return None  # released on close
        return describe(file.read())


@contextlib.contextmanager
def hold(workdir: Path) -> Iterator[None]:
    """Hold `workdir`'s lock while the body runs; WorkdirBusyError if another run holds it."""
    path = Path(workdir) / LOCK_FILE
    with open(path, "a+") as file:
        if not _try_lock(file):
            file.seek(0)
            raise WorkdirBusyError(
                f"{workdir} is in use by another run ({describe(file.read())}, see {path}); "
                "wait for it to end or stop it, or pass another --workdir"
            )
        file.seek(0)
        left = file.read()
        if left.strip():
            log.warning("taking over %s: its run (%s) is gone", path, describe(left))
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        file.seek(0)
        file.truncate()
        file.write(json.dumps(me))
        file.flush()
        try:
            yield
        finally:
            file.seek(0)
            file.truncate()  # a clean end leaves no holder behind
