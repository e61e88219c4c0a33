"""The code that runs inside one sandboxed Python interpreter (started by ``clgrpo.sandbox.pool``).

Started as ``python -I -B worker.py RESULT_FD`` with a clean environment. It imports everything it
needs, says "ready" and waits (a spare). The parent then binds it to a session with one message naming the
session's temporary directory and the limits; the worker sets its resource limits, drops to uid nobody, turns
on no_new_privs, Landlock and seccomp (see ``clgrpo.sandbox.isolation`` for why each layer holds), moves into the
directory, and from then on runs code cells in one persistent namespace until its stdin is closed or it is
killed.

Protocol (each message is a 4-byte big-endian length and a JSON object): commands come on stdin (moved to a
private fd, stdin itself becomes /dev/null so user code cannot read them), replies go to RESULT_FD. The cells'
output never travels in replies: Python-level stdout/stderr go through a capped writer straight to fds 1/2 (a
pipe the parent drains), so output written before a crash or a kill is kept, and C-level writes to fds 1/2
land in the same place and cannot corrupt the protocol.

This file imports nothing from the project: after the restrictions the project's files cannot be read.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import errno
import faulthandler
import io
import json
import linecache
import os
import resource
import signal
import stat
import struct
import sys
import traceback
import types

WORKER_FILE = os.path.abspath(__file__)

CMD_FD = os.dup(0)  # the parent's commands; fd 0 becomes /dev/null for user code
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
RES_FD = int(sys.argv[1])
os.set_inheritable(RES_FD, False)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.restype = ctypes.c_int

# --- prctl / capability constants (linux/prctl.h, linux/capability.h) ------------------------------------
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAP_DAC_READ_SEARCH = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# --- Landlock (linux/landlock.h) --------------------------------------------------------------------------
NR_LANDLOCK_CREATE_RULESET, NR_LANDLOCK_ADD_RULE, NR_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # all arches
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER = 1 << 13  # ABI 2: rename/link across directories
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
# rights that make sense on a file (the kernel refuses directory rights in a rule for a file)
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


# --- seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h) ---------------------------------------------
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
OFF_NR, OFF_ARCH, OFF_ARG0_LO = 0, 4, 16  # struct seccomp_data; args[0]'s low 32 bits (little endian)
CLONE_THREAD = 0x00010000
# CLONE_NEWTIME | NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NEW_NAMESPACES = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000

# syscall numbers per architecture: (audit arch, seccomp, {name: nr}); checked against the kernel headers
_COMMON_DENY = (
    "socket",
    "io_uring_setup",
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "unshare",
    "setns",
    "pivot_root",
    "chroot",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "open_by_handle_at",
    "userfaultfd",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
)
ARCHES = {
    "x86_64": (
        0xC000003E,
        317,
        {
            "socket": 41,
            "clone": 56,
            "fork": 57,
            "vfork": 58,
            "execve": 59,
            "ptrace": 101,
            "pivot_root": 155,
            "chroot": 161,
            "mount": 165,
            "umount2": 166,
            "reboot": 169,
            "init_module": 175,
            "delete_module": 176,
            "kexec_load": 246,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "perf_event_open": 298,
            "open_by_handle_at": 304,
            "setns": 308,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "finit_module": 313,
            "kexec_file_load": 320,
            "bpf": 321,
            "execveat": 322,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "clone3": 435,
            "mount_setattr": 442,
        },
    ),
    "aarch64": (
        0xC00000B7,
        277,
        {  # asm-generic numbering; no fork/vfork syscalls (glibc uses clone)
            "umount2": 39,
            "mount": 40,
            "pivot_root": 41,
            "chroot": 51,
            "unshare": 97,
            "kexec_load": 104,
            "init_module": 105,
            "delete_module": 106,
            "ptrace": 117,
            "reboot": 142,
            "socket": 198,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "execve": 221,
            "perf_event_open": 241,
            "open_by_handle_at": 265,
            "setns": 268,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "finit_module": 273,
            "bpf": 280,
            "execveat": 281,
            "userfaultfd": 282,
            "kexec_file_load": 294,
            "io_uring_setup": 425,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "clone3": 435,
            "mount_setattr": 442,
        },
    ),
}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


# --- the restrictions -------------------------------------------------------------------------------------
def drop_privileges(uid: int, gid: int, keep_dac_read_search: bool) -> None:
    """Become uid/gid ``uid``/``gid`` with no supplementary groups. With ``keep_dac_read_search`` the process
    keeps exactly one capability, CAP_DAC_READ_SEARCH (read files and search directories regardless of their
    modes), for a Python installation nobody cannot reach (e.g. under /root, mode 0700); Landlock still
    limits what may be read, and seccomp refuses open_by_handle_at, the one call that cap would otherwise
    open up."""
    os.setgroups([])
    if keep_dac_read_search:
        _check(libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if keep_dac_read_search:
        header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (CapData * 2)()  # 64 capability bits as two 32-bit words
        data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
        _check(libc.capset(ctypes.byref(header), data), "capset")
        _check(libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # none expected; EINVAL on old kernels
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise OSError(errno.EPERM, "the uid/gid change did not take effect")


def landlock_abi() -> int:
    return libc.syscall(
        NR_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )


def apply_landlock(read_paths: list[str], rw_dirs: list[str], rw_files: list[str]) -> int:
    """Restrict this (single-threaded) process and everything it could start to: read+execute beneath
    ``read_paths``, read+write beneath ``rw_dirs`` and on ``rw_files``, nothing else on the file system; with
    ABI >= 4 no TCP bind/connect; with ABI >= 6 no signals to, nor abstract unix sockets of, processes
    outside this domain. Returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not available")
    handled_fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        handled_fs |= FS_REFER
    if abi >= 3:
        handled_fs |= FS_TRUNCATE
    if abi >= 5:
        handled_fs |= FS_IOCTL_DEV
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0  # handled with no rule: all refused
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(handled_fs, handled_net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # older kernels refuse fields they do not know
    ruleset = _check(
        libc.syscall(NR_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    write = (
        FS_READ_FILE
        | FS_READ_DIR
        | FS_WRITE_FILE
        | FS_REMOVE_DIR
        | FS_REMOVE_FILE
        | FS_MAKE_DIR
        | FS_MAKE_REG
        | FS_MAKE_SOCK
        | FS_MAKE_FIFO
        | FS_MAKE_SYM
        | FS_REFER
        | FS_TRUNCATE
    )
    try:
        rules = [(p, read) for p in read_paths] + [(p, write) for p in rw_dirs + rw_files]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                allowed = (access if is_dir else access & FS_FILE_RIGHTS) & handled_fs
                rule = PathBeneathAttr(allowed, fd)
                _check(
                    libc.syscall(
                        NR_LANDLOCK_ADD_RULE,
                        ctypes.c_int(ruleset),
                        ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule({path})",
                )
            finally:
                os.close(fd)
        _check(
            libc.syscall(NR_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self"
        )
    finally:
        os.close(ruleset)
    return abi


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k) instructions: kill a syscall of another ABI (i386 via int 0x80),
    EPERM for x32 numbers and for every denied syscall, ENOSYS for clone3 (glibc then falls back to clone,
    whose flags a filter can read; clone3's are behind a pointer), EPERM for clone with a new namespace or
    without CLONE_THREAD (a new process; threads keep working), allow the rest."""
    arch, _, nrs = ARCHES[machine]
    deny = [nrs[name] for name in _COMMON_DENY] + [nrs[name] for name in ("fork", "vfork") if name in nrs]
    eperm = RET_ERRNO | errno.EPERM
    prog = [
        (BPF_LD_W_ABS, 0, 0, OFF_ARCH),
        (BPF_JEQ_K, 1, 0, arch),  # our ABI: skip the kill
        (BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, OFF_NR),
    ]
    if machine == "x86_64":
        prog += [(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, eperm)]
    for nr in deny:
        prog += [(BPF_JEQ_K, 0, 1, nr), (BPF_RET_K, 0, 0, eperm)]
    prog += [(BPF_JEQ_K, 0, 1, nrs["clone3"]), (BPF_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]
    prog += [
        (BPF_JEQ_K, 0, 3, nrs["clone"]),  # not clone: jump to ALLOW
        (BPF_LD_W_ABS, 0, 0, OFF_ARG0_LO),  # clone's flags (all of them are in the low word)
        (BPF_JSET_K, 2, 0, CLONE_NEW_NAMESPACES),  # any new namespace: EPERM
        (BPF_JSET_K, 0, 1, CLONE_THREAD),  # a thread: ALLOW, else (a new process) EPERM
        (BPF_RET_K, 0, 0, RET_ALLOW),
        (BPF_RET_K, 0, 0, eperm),
    ]
    return prog


def apply_seccomp(machine: str) -> None:
    prog = seccomp_program(machine)
    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    nr_seccomp = ARCHES[machine][1]
    _check(
        libc.syscall(
            nr_seccomp,
            ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
            ctypes.c_uint(SECCOMP_FILTER_FLAG_TSYNC),
            ctypes.byref(fprog),
        ),
        "seccomp(SECCOMP_SET_MODE_FILTER)",
    )


def self_test() -> None:
    """The restrictions are in force: a socket is refused, /proc cannot be read."""
    if libc.socket(2, 1, 0) >= 0 or ctypes.get_errno() != errno.EPERM:
        raise OSError(errno.EPERM, "seccomp did not refuse socket()")
    try:
        os.close(os.open("/proc/self/status", os.O_RDONLY))
    except PermissionError:
        pass
    else:
        raise OSError(errno.EPERM, "Landlock did not refuse reading /proc")


# --- output capture ---------------------------------------------------------------------------------------
class Capture:
    """stdout + stderr of a cell: the first ``cap`` characters go to fd 1 (the parent's pipe) as they are
    written, the rest is only counted."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.total = cap, 0, 0

    def reset(self) -> None:
        self.kept = self.total = 0

    def write(self, text: str) -> int:
        n = len(text)
        self.total += n
        room = self.cap - self.kept
        if room > 0 and n:
            part = text if n <= room else text[:room]
            self.kept += len(part)
            data = memoryview(part.encode("utf-8", "backslashreplace"))
            while data:
                data = data[os.write(1, data) :]
        return n


class CapturedStream(io.TextIOBase):
    encoding = "utf-8"
    errors = "backslashreplace"

    def __init__(self, capture: Capture, name: str) -> None:
        self._capture, self._name = capture, name
        self.buffer = _BytesShim(self)

    @property
    def name(self) -> str:
        return self._name

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        return self._capture.write(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        pass


class _BytesShim:
    """``sys.stdout.buffer``: bytes are decoded and captured like text."""

    def __init__(self, stream: CapturedStream) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(bytes(data).decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        pass


# --- running cells ----------------------------------------------------------------------------------------
class CpuLimitExceeded(BaseException):  # not an Exception: `except Exception` in a cell does not swallow it
    pass


class State:
    mode = "spare"  # spare | idle | user | worker
    cpu_s = 10.0
    memory_mb = 1024
    max_file_mb = 64
    cells = 0


def _on_sigprof(signum: int, frame: types.FrameType | None) -> None:
    if State.mode == "user":
        raise CpuLimitExceeded(f"CPU time limit of {State.cpu_s:g}s exceeded")


def _arm(seconds: float, interval: float = 0.0) -> None:
    signal.setitimer(signal.ITIMER_PROF, seconds, interval)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell_line(tb: types.TracebackType | None, filename: str) -> int | None:
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _note(exc: BaseException) -> str:
    """Why the sandbox refused, for errors it causes."""
    if not isinstance(exc, OSError):
        return ""
    if exc.errno == errno.EPERM:
        frames = traceback.extract_tb(exc.__traceback__)
        names = " ".join(f"{f.filename} {f.line or ''}" for f in frames).lower()
        if "socket" in names:
            return " (sockets are not allowed in this sandbox)"
        if any(w in names for w in ("fork", "subprocess", "spawn", "exec", "popen", "multiprocessing", "system")):
            return " (new processes are not allowed in this sandbox)"
        return " (not allowed in this sandbox)"
    if exc.errno == errno.EACCES and exc.filename is not None:
        path = os.path.abspath(os.fsdecode(exc.filename))
        if os.path.commonpath([path, os.getcwd()]) != os.getcwd():
            return " (outside the working directory: not allowed in this sandbox)"
    if exc.errno == errno.EFBIG:
        return f" (file size limit of {State.max_file_mb} MB)"
    return ""


def _show_traceback(exc: BaseException, out: CapturedStream) -> None:
    """The traceback as a REPL prints it, without the worker's own frames."""
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != WORKER_FILE])
        out.write("".join(te.format()))
    except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting: the error line is enough
        pass


def run_cell(code: str, ns: dict, out: CapturedStream) -> str | None:
    """Run one cell in ``ns``; its trailing expression's repr is printed like a REPL. Returns the error line."""
    State.cells += 1
    filename = f"<cell {State.cells}>"
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(final := tree.body[-1], ast.Expr):
            tree.body.pop()
            last = ast.Expression(final.value)
        body = compile(tree, filename, "exec")
        tail = compile(last, filename, "eval") if last is not None else None
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        out.write("".join(traceback.format_exception_only(type(exc), exc)))
        line = getattr(exc, "lineno", None)
        return _one_line(f"{type(exc).__name__}: {getattr(exc, 'msg', None) or exc}") + (
            f" (line {line})" if line else ""
        )
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    State.mode = "user"
    _arm(State.cpu_s, 0.05)  # then every 50 ms: a cell that catches the exception gets it again
    try:
        exec(body, ns)
        if tail is not None:
            value = eval(tail, ns)
            if value is not None:
                builtins.__dict__["_"] = value  # the REPL's last value
                out.write(repr(value) + "\n")
        return None
    except CpuLimitExceeded as exc:
        State.mode = "worker"
        _arm(0)
        line = _cell_line(exc.__traceback__, filename)
        _show_traceback(exc, out)
        return f"CPU time limit of {State.cpu_s:g}s exceeded" + (f" (line {line})" if line else "")
    except MemoryError as exc:
        State.mode = "worker"
        _arm(0)
        line = _cell_line(exc.__traceback__, filename)
        del exc  # free the frames (and what they hold) before formatting anything
        return f"MemoryError: memory limit of {State.memory_mb} MB exceeded" + (f" (line {line})" if line else "")
    except SystemExit as exc:
        State.mode = "worker"
        _arm(0)
        return f"SystemExit: {exc.code} (the interpreter does not exit: its variables are kept)"
    except BaseException as exc:  # noqa: BLE001 - anything the cell raises is the cell's error
        State.mode = "worker"
        _arm(0)
        _show_traceback(exc, out)
        line = _cell_line(exc.__traceback__, filename)
        try:
            message = str(exc)
        except BaseException:  # noqa: BLE001 - a cell's exception class with a broken __str__
            message = "<exception str() failed>"
        head = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        return _one_line(head + _note(exc)) + (f" (line {line})" if line else "")
    finally:
        State.mode = "worker"
        _arm(0)


# --- protocol ---------------------------------------------------------------------------------------------
def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv() -> dict | None:
    head = _read_exact(CMD_FD, 4)
    if head is None:
        return None
    body = _read_exact(CMD_FD, struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def send(message: dict) -> None:
    data = json.dumps(message).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(RES_FD, view) :]


def bind(msg: dict) -> str:
    """Limits, identity, restrictions, then the session's directory. Returns what is in force."""
    import tempfile

    State.cpu_s, State.memory_mb, State.max_file_mb = msg["cpu_s"], msg["memory_mb"], msg["max_file_mb"]
    directory = msg["dir"]
    machine = os.uname().machine
    if machine not in ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for architecture {machine}")
    if sum(1 for _ in os.scandir("/proc/self/task")) != 1:  # Landlock restricts the calling thread only
        raise OSError(errno.EBUSY, "the worker is not single-threaded")
    mem = msg["memory_mb"] << 20
    fsize = msg["max_file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (msg["nofile"], msg["nofile"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write fails with EFBIG instead of killing
    done = []
    if msg.get("uid") is not None:
        drop_privileges(msg["uid"], msg["gid"], msg["keep_dac_read_search"])
        done.append("uid")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    abi = apply_landlock(msg["read"], [directory], msg["rw_files"])
    apply_seccomp(machine)
    self_test()
    os.chdir(directory)
    for key in ("HOME", "TMPDIR"):
        os.environ[key] = directory
    tempfile.tempdir = None
    # the uid change cleared the parent-death signal: set it again, then make sure the parent is still there
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != msg["parent_pid"]:
        os._exit(1)
    return f"landlock abi {abi}, seccomp, " + ", ".join(done)


def main() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if sys.__stderr__ is not None:  # the parent always gives one
        faulthandler.enable(file=sys.__stderr__)  # a crash leaves "Fatal Python error: ..." in the output
    signal.signal(signal.SIGPROF, _on_sigprof)
    send({"ready": os.getpid()})
    msg = recv()
    if msg is None:
        return
    try:
        applied = bind(msg)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as an infrastructure failure
        send({"error": _one_line(f"{type(exc).__name__}: {exc}")})
        return
    capture = Capture(msg["output_chars"])
    sys.stdout = CapturedStream(capture, "<stdout>")
    sys.stderr = CapturedStream(capture, "<stderr>")
    # the cells' namespace is a fresh __main__ module (pickle, dataclasses and `import __main__` find it)
    main_module = types.ModuleType("__main__")
    main_module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    ns = main_module.__dict__
    send({"ok": applied})
    State.mode = "idle"
    while True:  # between calls the parent watches the CPU time of threads a cell left running
        msg = recv()
        State.mode = "worker"
        if msg is None:
            return
        capture.reset()
        start = _cpu()
        try:
            error = run_cell(msg["code"], ns, sys.stdout)
        except CpuLimitExceeded:  # the timer fired between the cell's end and the disarm
            error = f"CPU time limit of {State.cpu_s:g}s exceeded"
        except MemoryError:
            error = f"MemoryError: memory limit of {State.memory_mb} MB exceeded"
        sys.stdout, sys.stderr = CapturedStream(capture, "<stdout>"), CapturedStream(capture, "<stderr>")
        send({"error": error, "kept": capture.kept, "total": capture.total, "cpu_s": _cpu() - start})
        State.mode = "idle"


if __name__ == "__main__":
    main()
