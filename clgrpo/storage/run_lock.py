"""One live process per run: a lock file per (database, run id).

The DuckDB file is held only while the store works (``clgrpo.storage.store``), so it no longer keeps a second process
from running the same run. A ``RunLock`` does: an exclusive ``flock`` on
``<db dir>/.locks/<db name>/<kind>-<id>.lock`` (kinds: ``train`` per run id, ``eval`` per evaluation id,
``refresh`` per refresh name), holding the owner's pid and start time, taken for the whole flow and released on
exit; the kernel releases it when the process dies, even on SIGKILL. Readers (``clgrpo runs list``) ask
``holder()`` whether a live process holds a lock, and which.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from clgrpo.storage.connection import StoreLockedError

LOCK_DIR = ".locks"
ACQUIRE_WAIT_S = 1.0  # a reader's probe holds a shared lock for microseconds: wait that out, not a live owner
_WHAT = {
    "train": "run {name} is being trained",
    "eval": "evaluation {name} is being run",
    "refresh": "refresh {name} is being run",
}


class RunLockedError(StoreLockedError):
    """Another live process runs this run id on this database."""


@dataclass(frozen=True)
class Holder:
    pid: int | None  # None: the owner has not written its pid yet
    started: str  # local time, as the owner wrote it


def lock_path(db_path: str | os.PathLike[str], kind: str, name: str) -> Path:
    db = Path(db_path).expanduser().resolve()
    return db.parent / LOCK_DIR / db.name / f"{kind}-{quote(name, safe='')}.lock"


def _read_holder(fd: int) -> Holder:
    text = os.pread(fd, 200, 0).decode("utf-8", "replace").split(maxsplit=1)
    pid = int(text[0]) if text and text[0].isdigit() else None
    return Holder(pid, text[1].strip() if len(text) > 1 else "?")


def holder(db_path: str | os.PathLike[str], kind: str, name: str) -> Holder | None:
    """The live process holding the lock of ``name``, or None when it is free."""
    try:
        fd = os.open(lock_path(db_path, kind, name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        found = _read_holder(fd)
        os.close(fd)
        return found
    os.close(fd)  # closing releases the probe's shared lock
    return None


def locked_message(kind: str, name: str, found: Holder) -> str:
    pid = found.pid if found.pid is not None else "?"
    return (
        f"{_WHAT[kind].format(name=name)} by process {pid} (started {found.started}); "
        f"wait for it or stop it (kill {pid})"
    )


def refuse_if_running(db_path: str | os.PathLike[str], kind: str, name: str) -> None:
    """``RunLockedError`` when a live process holds the lock of ``name`` (a check before any work; the flow
    takes the lock itself)."""
    found = holder(db_path, kind, name)
    if found is not None:
        raise RunLockedError(locked_message(kind, name, found))


class RunLock:
    """``with RunLock(db_path, "train", run_id):`` the run is this process's until the block ends."""

    def __init__(self, db_path: str | os.PathLike[str], kind: str, name: str) -> None:
        self.path = lock_path(db_path, kind, name)
        self.kind, self.name = kind, name
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + ACQUIRE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    found = _read_holder(fd)
                    os.close(fd)
                    raise RunLockedError(locked_message(self.kind, self.name, found)) from None
                time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {datetime.now():%Y-%m-%d %H:%M:%S}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no owner named any more
        finally:
            os.close(fd)  # closing releases the lock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
