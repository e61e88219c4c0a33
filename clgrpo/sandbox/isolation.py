"""The sandbox's isolation: what the kernel must offer (probed once per process), and what each interpreter of the
pool (``clgrpo.sandbox.pool``) is confined to: its environment and the restrictions the worker applies
(``clgrpo.sandbox.worker``).

Why the containment holds
-------------------------
Every layer is enforced by the kernel on the interpreter process, is inherited by anything it could start,
and cannot be lifted again by the process itself; so nothing the code does from Python -- ctypes, raw
syscalls, writing to /proc, loading a C extension -- can switch it off. ctypes only reaches the same syscalls
the kernel already filters.

* **seccomp** (a BPF filter, installed with no_new_privs): ``socket()`` fails with EPERM for every address
  family, ``io_uring_setup`` too (io_uring could create sockets without the socket syscall); no new processes
  (fork/vfork; clone without CLONE_THREAD or with a new-namespace flag, so threads still work; clone3
  answers ENOSYS so glibc falls back to clone, whose flags the filter can read), no execve/execveat, no
  ptrace/process_vm_*, no mount/umount/unshare/setns/pivot_root/chroot (nor the new mount API), no bpf,
  perf_event_open, keyrings, kexec, module loading, reboot, userfaultfd, open_by_handle_at. The filter
  checks the audit architecture (a syscall through another ABI, e.g. int 0x80, kills the process) and
  refuses x32 syscall numbers, the two classic ways around a filter written for one syscall table. A filter
  can only be added to, never removed.
* **Landlock** (best ABI the kernel offers): reading is allowed only beneath the Python installation
  (prefixes and ``sys.path`` entries outside the project), /usr, /lib, /lib64, /bin, /etc/ld.so.cache,
  /etc/localtime and /dev/null, /dev/zero, /dev/urandom; reading and writing only beneath the session's
  directory. The project, the database directory, other sessions' directories, /proc (hence the parent's
  memory and environment), /root, /home and the rest of /etc are refused. With ABI >= 4 TCP bind/connect are
  refused as a second network layer, with ABI >= 6 signals and abstract unix sockets cannot reach processes
  outside the sandbox; ptrace of processes outside it is always refused. A Landlock domain can only be
  restricted further.
* **Identity**: under a root parent the worker drops to uid/gid nobody (65534) with no supplementary groups
  before the restrictions, so file modes and the kernel's ptrace checks also stand between it and root's
  processes and files. If the Python installation lies under a directory nobody cannot enter (e.g. /root,
  mode 0700) the worker keeps exactly one capability, CAP_DAC_READ_SEARCH, to read it; Landlock still bounds
  what it can read, and seccomp refuses open_by_handle_at, the one call that capability would open up.
  ``isolation`` says which of the two is in force.
* **Limits**: RLIMIT_AS (``memory_mb``: a memory bomb gets MemoryError, the interpreter survives),
  RLIMIT_FSIZE (``max_file_mb`` per file), RLIMIT_NOFILE 64, no core dumps; per call a CPU timer
  (ITIMER_PROF: ``cpu_s`` raises an error in the cell, the interpreter survives) with a kill by the parent as
  the backstop for C-level loops that never return to Python, and a wall-clock limit enforced by the parent
  (SIGKILL to the interpreter's process group). Between calls, threads a cell left running may not use more
  than ``cpu_s`` either (the parent watches and kills; the next call reports it). The parent reads CPU time
  from /proc, outside the sandbox, so a cell cannot disarm these kills.
* **Environment**: ``python -I -B`` (isolated mode) of the parent's interpreter, a new session, only the
  protocol fds, and a minimal environment (PATH, HOME/TMPDIR, LANG, thread-count variables, and CLGRPO_OWNER,
  the parent's pid and start time for ``clgrpo.process.leftovers``): none of the parent's variables (API keys) reach the
  interpreter.

What it does not protect against
--------------------------------
Kernel bugs (the kernel is the boundary); CPU side channels (Spectre-class, timing) between sessions and the
parent; disk use inside the session's directory beyond ``max_file_mb`` per file (many files can fill the
disk until the session ends); memory pressure from ``pool_size`` x ``memory_mb`` of address space; reading
world-readable files beneath the allowed system trees (/usr, the Python installation), or root-only files
there when CAP_DAC_READ_SEARCH is kept; denial of service of a session by its own code (it can corrupt its
own interpreter). Unix sockets made by ``socketpair()`` are allowed: they connect only to each other. With
Landlock ABI < 6 (Linux < 6.12) all interpreters share uid nobody and nothing stops one from signalling
another (``isolation`` then lacks "signals"); with ABI < 4 the TCP layer is seccomp alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import site
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clgrpo.process.leftovers import owner_env

if TYPE_CHECKING:
    from schemas.config import SandboxConfig

PROJECT = Path(__file__).resolve().parents[2]  # the repository that contains clgrpo/
NOBODY = 65534
NOFILE = 64  # open files of one interpreter
SYSTEM_READ = ["/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime", "/dev/urandom"]
DEVICES_RW = ["/dev/null", "/dev/zero"]
ARCHES = {"x86_64": 317, "aarch64": 277}  # the seccomp syscall's number
THREAD_VARS = (
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot provide its guarantees here, or an interpreter cannot start (infrastructure)."""


# --- the machine probe ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    line: str
    uid: int | None  # drop to this uid/gid; None: the parent is not root, no change
    keep_dac_read_search: bool
    read_paths: tuple[str, ...]


_probe_result: Probe | SandboxUnavailable | None = None


def unavailable(what: str) -> SandboxUnavailable:
    return SandboxUnavailable(f"python sandbox unavailable: {what}; agent mode's python tool refuses to run without it")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _python_read_paths() -> list[str]:
    """The Python installation: prefixes, site-packages and sys.path entries, without anything that is (or
    contains) the project, the parent's cwd or the temporary directory."""
    protected = [PROJECT, Path.cwd().resolve(), Path(tempfile.gettempdir()).resolve()]
    prefixes = []
    for raw in dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]):
        p = Path(raw).resolve()
        if p.exists() and not any(_inside(q, p) for q in protected):
            prefixes.append(p)
    paths = list(prefixes)
    for raw in [*sys.path, *site.getsitepackages()]:
        if not raw:
            continue
        p = Path(raw).resolve()
        if not p.exists() or any(_inside(q, p) for q in protected):  # the project or an ancestor of it
            continue
        if any(_inside(p, q) for q in protected) and not any(_inside(p, pre) for pre in prefixes):
            continue  # inside the project (e.g. its root on sys.path), unless inside a venv that lives there
        if not any(_inside(p, known) for known in paths):
            paths.append(p)
    return [str(p) for p in paths]


def _nobody_can_read(path: str) -> bool:
    """Whether uid nobody (by the 'other' permission bits) can reach and read ``path``."""
    p = Path(path)
    try:
        for ancestor in reversed(p.parents):
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(p).st_mode
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _landlock_abi() -> tuple[int, int]:
    """(Landlock ABI version, errno): landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)."""
    libc = _libc()
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return abi, (ctypes.get_errno() if abi < 0 else 0)


def _seccomp_action_missing(machine: str, action: int) -> int:
    """0 if seccomp filters can return ``action`` (SECCOMP_GET_ACTION_AVAIL), else the errno."""
    libc = _libc()
    ret = libc.syscall(ARCHES[machine], ctypes.c_uint(2), ctypes.c_uint(0), ctypes.byref(ctypes.c_uint32(action)))
    return (ctypes.get_errno() or errno.EINVAL) if ret != 0 else 0


def _probe() -> Probe:
    machine = os.uname().machine
    if machine not in ARCHES:
        raise unavailable(f"no seccomp filter for the {machine} architecture (x86_64 and aarch64 only)")
    abi, err = _landlock_abi()
    if abi < 1:
        if err == errno.EOPNOTSUPP:
            raise unavailable("Landlock is disabled in this kernel (add landlock to the lsm= boot parameter)")
        raise unavailable(
            f"the kernel has no Landlock (needs Linux >= 5.13 with CONFIG_SECURITY_LANDLOCK; {os.strerror(err)})"
        )
    for action, name in ((0x00050000, "errno"), (0x80000000, "kill_process")):
        err = _seccomp_action_missing(machine, action)
        if err:
            raise unavailable(
                f"the kernel has no seccomp filters with the {name} action "
                f"({os.strerror(err)}; needs CONFIG_SECCOMP_FILTER)"
            )
    read_paths = _python_read_paths()
    layers = (
        ["files"]
        + (["tcp bind/connect"] if abi >= 4 else [])
        + (["signals, abstract unix sockets"] if abi >= 6 else [])
    )
    if os.geteuid() == 0:
        keep = not all(_nobody_can_read(p) for p in read_paths)
        uid: int | None = NOBODY
        who = (
            "uid nobody + CAP_DAC_READ_SEARCH (the Python installation is under a directory nobody cannot enter)"
            if keep
            else "uid nobody"
        )
    else:
        uid, keep, who = None, False, f"uid {os.geteuid()} (not root: no uid change)"
    line = (
        f"landlock abi {abi} ({', '.join(layers)}), seccomp (sockets, io_uring, processes, exec, ptrace, "
        f"mounts, namespaces, bpf, perf, keyrings, modules), no_new_privs, {who}, rlimits (address space, "
        "file size, open files, no core), cpu/wall kills, clean env"
    )
    return Probe(line, uid, keep, tuple(read_paths))


def probed() -> Probe:
    """This machine's probe, made once per process (cached); SandboxUnavailable saying what is missing."""
    global _probe_result
    if _probe_result is None:
        try:
            _probe_result = _probe()
        except SandboxUnavailable as exc:
            _probe_result = exc
    if isinstance(_probe_result, SandboxUnavailable):
        raise _probe_result
    return _probe_result


def check_isolation() -> str:
    """Probe this machine once (cached): the ``isolation`` line, or SandboxUnavailable saying what is missing."""
    return probed().line


def isolation_problem() -> str | None:
    """None when the sandbox can give its guarantees on this machine, else one line on why not."""
    try:
        check_isolation()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


# --- what an interpreter is confined to ---------------------------------------------------------------------
def clean_env() -> dict[str, str]:
    """The whole environment of an interpreter: none of the parent's variables (API keys) reach it."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/",
        "TMPDIR": "/",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
    }
    env.update({name: "1" for name in THREAD_VARS})
    env.update(owner_env())  # who started it, for the sweep after a SIGKILL (clgrpo.process.leftovers)
    return env


def confinement(cfg: SandboxConfig, probe: Probe) -> dict[str, Any]:
    """The limits and restrictions an interpreter applies to itself when it is bound to a session (the worker
    reads them from the bind message): resource limits, the identity it drops to, what it may read and write."""
    return {
        "cpu_s": cfg.cpu_s,
        "memory_mb": cfg.memory_mb,
        "max_file_mb": cfg.max_file_mb,
        "output_chars": cfg.output_chars,
        "nofile": NOFILE,
        "uid": probe.uid,
        "gid": probe.uid,
        "keep_dac_read_search": probe.keep_dac_read_search,
        "read": list(probe.read_paths) + SYSTEM_READ,
        "rw_files": DEVICES_RW,
    }
