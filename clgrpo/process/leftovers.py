"""What a SIGKILLed clgrpo process leaves behind, and the sweep that removes it at the next clgrpo command.

A SIGKILL runs no ``finally`` block and no ``atexit`` hook, so a killed run keeps its temporary directories (the
sandbox's ``clgrpo-py-*`` session directories above all) and may keep child processes. Everything a clgrpo
process makes for its own lifetime therefore names its owner, ``<pid>-<start>-<pidns>``: the pid, the process's
start time in clock ticks after boot (``/proc/<pid>/stat`` field 22, so a recycled pid is never taken for the
owner) and the inode of its pid namespace (a pid means nothing in another namespace, e.g. a container sharing
/tmp: such entries are never touched).

* temporary directories: ``<tempdir>/clgrpo-<kind>-<owner>-XXXXXXXX`` (``temp_prefix``);
* child processes: ``CLGRPO_OWNER=<owner>`` in their environment. ``claim_children`` puts it into this
  process's environment, which the verifier pool, Prefect's temporary server and llama-server inherit; the
  sandbox's interpreters get it in the clean environment the sandbox builds (``owner_env``).

``sweep`` (run by every CLI command before its work) removes the directories and kills the processes whose owner
is dead: the pid is gone, is a zombie, or belongs to a process with another start time. A live owner's things are
never touched, nor this process and its ancestors. Directories without an owner (the ``clgrpo-py-XXXXXXXX`` names
of earlier versions) are left alone: nothing says whether their process still runs. The terminal gets one line;
what was removed, one record per directory or owner, goes to the ``clgrpo.leftovers`` logger at INFO (in the
CLI that is before the command's log file opens, so there the line is all that is kept).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from types import TracebackType

    import psutil

__all__ = [
    "OWNER_ENV",
    "Owner",
    "Swept",
    "claim_children",
    "on_command_start",
    "owner_env",
    "remove_tree",
    "sweep",
    "temp_prefix",
    "this_owner",
]

log = logging.getLogger("clgrpo.leftovers")

OWNER_ENV = "CLGRPO_OWNER"
SANDBOX_UID = 65534  # uid nobody, to which the sandbox's interpreters drop under root (clgrpo.sandbox.isolation.NOBODY)
TERM_GRACE_S = 2.0  # SIGTERM, then SIGKILL what still runs after this long
# the kinds of temporary directory, and how the terminal line names them
KINDS = {
    "py": ("sandbox directory", "sandbox directories"),
    "llama-build": ("llama-server build directory", "llama-server build directories"),
    "fetch": ("model download directory", "model download directories"),
}
_DIR_NAME = re.compile(r"clgrpo-(?P<kind>[a-z]+(?:-[a-z]+)*)-(?P<owner>\d+-\d+-\d+)-[A-Za-z0-9_]+")


# --- owners -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Owner:
    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    pidns: int  # inode of /proc/<pid>/ns/pid

    @property
    def tag(self) -> str:
        return f"{self.pid}-{self.start}-{self.pidns}"

    def describe(self, uid: int | None = None) -> str:
        """Whose and when, for a user who may not know the pid: "user alice, started 2026-11-26 14:02"."""
        parts = [f"user {_user_name(uid)}"] if uid is not None else []
        started = _wall_clock(self.start)
        if started:
            parts.append(f"started {started}")
        return ", ".join(parts)

    @classmethod
    def parse(cls, tag: str) -> Owner | None:
        parts = tag.strip().split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        return cls(*(int(p) for p in parts))


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _wall_clock(start_ticks: int) -> str | None:
    """A process start (clock ticks after boot) as local time; None where /proc does not say when it booted."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return None
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(boot + start_ticks / ticks))


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from field 3 (state) on; FileNotFoundError when there is no such process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].decode().split()


def _pidns(pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


_this: dict[int, Owner | None] = {}  # by pid: a forked child is another owner


def this_owner() -> Owner | None:
    """This process as an owner; None where /proc cannot tell (not Linux): nothing is tagged then."""
    pid = os.getpid()
    if pid not in _this:
        try:
            _this[pid] = Owner(pid, int(_stat_fields(pid)[19]), _pidns())
        except (OSError, IndexError, ValueError):
            _this[pid] = None
    return _this[pid]


def is_dead(owner: Owner) -> bool:
    """True only when certain: the pid is gone, a zombie, or another process (another start time). An owner in
    another pid namespace, or one /proc cannot tell about, counts as alive."""
    me = this_owner()
    if me is None or owner.pidns != me.pidns:
        return False
    try:
        fields = _stat_fields(owner.pid)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return fields[0] in ("Z", "X") or int(fields[19]) != owner.start
    except (IndexError, ValueError):
        return False


# --- tagging ----------------------------------------------------------------------------------------------
def temp_prefix(kind: str) -> str:
    """The ``prefix`` for ``tempfile.mkdtemp``/``TemporaryDirectory`` of a directory of kind ``kind`` (a key of
    KINDS) that lives as long as this process at most."""
    owner = this_owner()
    return f"clgrpo-{kind}-{owner.tag}-" if owner else f"clgrpo-{kind}-"


def owner_env() -> dict[str, str]:
    """The marker for a child's environment (empty where there is no owner tag)."""
    owner = this_owner()
    return {OWNER_ENV: owner.tag} if owner else {}


def claim_children() -> None:
    """Mark every child this process starts from now on (they inherit its environment) as its own."""
    os.environ.update(owner_env())


# --- the sweep --------------------------------------------------------------------------------------------
@dataclass
class Swept:
    """What one sweep removed (and failed to remove)."""

    owners: dict[int, str] = field(default_factory=dict)  # pid of each dead owner -> whose and when
    dirs: Counter[str] = field(default_factory=Counter)  # kind -> directories removed
    processes: int = 0
    failed: list[str] = field(default_factory=list)  # what could not be removed: paths, "pid N"

    def line(self) -> str | None:
        """The one terminal line; None when nothing was found."""
        if not self.owners:
            return None
        what: Counter[tuple[str, str]] = Counter()  # the terminal's words (one, several) for a kind -> count
        for kind, n in self.dirs.items():
            what[KINDS[kind]] += n
        parts = [f"{n} {words[n != 1]}" for words, n in what.items()]
        if self.processes:
            parts.append(f"{self.processes} process{'es' if self.processes != 1 else ''}")
        if self.failed:
            more = " ..." if len(self.failed) > 3 else ""
            parts.append(f"{len(self.failed)} could not be removed ({', '.join(self.failed[:3])}{more})")
        pids = ", ".join(f"{p} ({who})" if who else str(p) for p, who in sorted(self.owners.items()))
        noun = "process" if len(self.owners) == 1 else "processes"
        return f"swept leftovers of dead clgrpo {noun} {pids}: {', '.join(parts) or 'nothing left'}"


def _allowed_uids() -> set[int]:
    """Whose directories and processes a sweep may remove: this user's; under root also the sandbox's uid."""
    uid = os.geteuid()
    return {uid, SANDBOX_UID} if uid == 0 else {uid}


def _dead_dirs(tmp: str) -> Iterator[tuple[Owner, str, str]]:
    """(owner, kind, path) of the tagged directories in ``tmp`` whose owner is dead."""
    uids = _allowed_uids()
    with os.scandir(tmp) as entries:
        for entry in entries:
            match = _DIR_NAME.fullmatch(entry.name)
            if not match or match["kind"] not in KINDS:
                continue
            owner = Owner.parse(match["owner"])
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if owner and entry.is_dir(follow_symlinks=False) and info.st_uid in uids and is_dead(owner):
                yield owner, match["kind"], entry.path


def _spared() -> set[int]:
    """This process and its ancestors: never killed, whatever their environment says."""
    import psutil

    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def _dead_processes(spared: set[int]) -> Iterator[tuple[Owner, psutil.Process]]:
    """(owner, process) of this user's processes (and the sandbox's) marked with a dead owner."""
    import psutil

    uids = _allowed_uids()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid in spared or proc.info["uids"] is None or proc.info["uids"].real not in uids:
                continue
            tag = proc.environ().get(OWNER_ENV)
        except psutil.Error:
            continue
        owner = Owner.parse(tag) if tag else None
        if owner and is_dead(owner):
            yield owner, proc


def _with_descendants(procs: list[psutil.Process], spared: set[int]) -> list[psutil.Process]:
    import psutil

    found = {p.pid: p for p in procs}
    for proc in procs:
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    return [p for pid, p in found.items() if pid not in spared]


def _running(proc: psutil.Process) -> bool:
    """Still running: a zombie (dead, its parent has not reaped it yet) is not."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after ``timeout_s`` (polled: most are not this process's children, so
    psutil.wait_procs would wait for their zombies to be reaped)."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    return alive


def _terminate(procs: list[psutil.Process], grace_s: float) -> tuple[int, list[psutil.Process]]:
    """SIGTERM, then SIGKILL after ``grace_s``: (how many were signalled, those still running)."""
    import psutil

    signalled = []
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
            signalled.append(proc)
        except psutil.Error:
            pass
    alive = _wait_gone(signalled, grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(signalled), _wait_gone(alive, 1.0)


def _uid_of(proc: psutil.Process) -> int | None:
    import psutil

    try:
        return int(proc.uids().real)
    except psutil.Error:
        return None


def _uid_of_path(path: str) -> int | None:
    """The owner's user, from a directory it made (None for the sandbox's own uid: that says nothing of whose
    run it was)."""
    try:
        uid = os.stat(path, follow_symlinks=False).st_uid
    except OSError:
        return None
    return None if uid == SANDBOX_UID else uid


def _sweep_processes(swept: Swept, grace_s: float) -> None:
    spared = _spared()
    by_owner: dict[Owner, list[psutil.Process]] = defaultdict(list)
    for owner, proc in _dead_processes(spared):
        by_owner[owner].append(proc)
    if not by_owner:
        return
    procs = _with_descendants([p for ps in by_owner.values() for p in ps], spared)
    signalled, alive = _terminate(procs, grace_s)
    for owner, ps in by_owner.items():
        swept.owners[owner.pid] = owner.describe(_uid_of(ps[0]))
    swept.processes += signalled - len(alive)
    swept.failed += [f"pid {p.pid}" for p in alive]
    for owner, ps in by_owner.items():
        log.info("killed the processes of dead clgrpo process %s: %s", owner.tag, ", ".join(str(p.pid) for p in ps))


def remove_tree(directory: str) -> None:
    """Remove a directory even where a sandbox cell took away its own permissions; never touches anything
    outside it (symlinks are not followed, the directory's parent is never changed)."""
    root = Path(directory)
    if not os.path.lexists(root):
        return

    def inside(path: Path) -> bool:
        return path == root or root in path.parents

    def retry(
        func: Callable[[str], object], path: str, exc_info: tuple[type[BaseException], BaseException, TracebackType]
    ) -> None:
        if isinstance(exc_info[1], FileNotFoundError):
            return
        with contextlib.suppress(OSError):
            for target in (Path(os.path.dirname(path)), Path(path)):
                if inside(target) and not stat.S_ISLNK(os.lstat(target).st_mode):
                    os.chmod(target, 0o700)
            func(path)

    shutil.rmtree(root, onerror=retry)


def _sweep_dirs(swept: Swept, tmp: str) -> None:
    found = list(_dead_dirs(tmp))
    if not found:
        return
    for owner, kind, path in found:
        uid = _uid_of_path(path)
        if owner.pid not in swept.owners or uid is not None:
            swept.owners[owner.pid] = owner.describe(uid)
        try:
            remove_tree(path)  # what a sandbox cell made unreadable too; never follows a symlink
        except OSError as exc:
            log.info("could not remove %s (left by dead clgrpo process %s): %s", path, owner.tag, exc)
        if os.path.lexists(path):
            swept.failed.append(path)
        else:
            swept.dirs[kind] += 1
            log.info("removed %s (left by dead clgrpo process %s)", path, owner.tag)


def sweep(tmp: str | None = None, *, grace_s: float = TERM_GRACE_S) -> Swept:
    """Kill the marked processes and remove the tagged directories (in ``tmp``, default the temporary
    directory) of dead clgrpo processes. Processes first: a dying interpreter could still write into its
    directory."""
    swept = Swept()
    if this_owner() is None:
        return swept
    _sweep_processes(swept, grace_s)
    _sweep_dirs(swept, tmp or tempfile.gettempdir())
    return swept


def on_command_start() -> None:
    """For the CLI, before a command runs: sweep (one stderr line if anything was found; a failure is one
    warning line, never the command's failure), then mark this process's children as its own."""
    started = time.monotonic()
    try:
        line = sweep().line()
    except Exception as exc:  # a sweep must never fail a command (logged: the linter accepts it)
        log.debug("sweep failed", exc_info=True)
        line = f"warning: could not sweep the leftovers of dead clgrpo processes: {type(exc).__name__}: {exc}"
    if line:
        print(line, file=sys.stderr)
    log.debug("sweep took %.3f s", time.monotonic() - started)
    claim_children()
