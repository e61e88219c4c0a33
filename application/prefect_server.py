"""Prefect's temporary API server, bound to the process that started it.

Without ``PREFECT_API_URL`` Prefect starts a temporary server (``SubprocessASGIServer``: ``python -m uvicorn
... prefect.server.api.server:create_app``) and stops it from an ``atexit`` hook. A SIGKILL runs no ``atexit``
hook, so every killed ``clgrpo train`` used to leave that server (about 200 MB) running forever.

``install()`` makes Prefect launch that server through this file instead of ``-m uvicorn``, with the same
arguments and the same environment::

    python .../application/prefect_server.py --parent-pid <pid of the process that started it> <uvicorn arguments>

It runs uvicorn in-process (so Prefect's ``stop()`` still signals the server itself) plus a daemon thread that
checks ``os.getppid()`` twice a second: once the parent is gone (the child was re-parented, to init or a
subreaper) it sends itself SIGTERM (uvicorn's graceful shutdown), and hard-exits if that has not ended the
process within a few seconds.

Why a ``getppid`` watchdog and not ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread* that
forked the child exits, not the process, and Prefect starts the server from whichever thread first needs the
API (``get_client()`` in the flow engine, but also the log and event worker threads, which come and go), so a
death signal could kill a healthy server mid-run. It would also need ctypes and is Linux-only. The watchdog
only depends on the parent pid, which is passed on the command line so a parent that dies before the launcher
starts is noticed too.

Why this file is run by path and not as ``-m application.prefect_server``: it imports only the standard library and
uvicorn, so the server starts whether or not ``clgrpo`` is importable in the child's environment, and it is
always this copy of the file. ``install()`` changes nothing when the command Prefect builds does not look as
expected (another Prefect version): the server then starts as before, and a warning says so.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.path:
    # Run by path, Python put this file's directory (application/) first on sys.path, where its modules could shadow
    # others (even the imports below); ``python -m uvicorn`` would have put the working directory there.
    import os

    sys.path[0] = os.getcwd()

import os
import signal
import subprocess
import threading
import time
from typing import Any

LAUNCHER = os.path.abspath(__file__)
CHECK_INTERVAL_S = 0.5
STOP_GRACE_S = 4.0
DISABLE_ENV = "CLGRPO_PREFECT_SERVER_WATCHDOG"  # "0": launch Prefect's server as Prefect does

_MARK = "_clgrpo_parent_bound"
_install_lock = threading.Lock()
_launching = threading.local()  # set while SubprocessASGIServer._run_uvicorn_command runs in this thread
_warned = False


# --- the server process -------------------------------------------------------------------------------
def _watch_parent(parent_pid: int, interval: float = CHECK_INTERVAL_S, grace: float = STOP_GRACE_S) -> None:
    """Runs in a daemon thread of the server: ends the process once ``parent_pid`` is no longer its parent."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    # Nothing is printed: the parent's terminal or pipe may be gone, and a failed write must not stop the exit.
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down gracefully (Prefect's lifespan, its database)
    except OSError:
        pass
    time.sleep(grace)
    os._exit(1)


def serve(argv: list[str]) -> None:
    """``--parent-pid PID <uvicorn arguments>``: watch PID, then run uvicorn as ``python -m uvicorn`` would
    (exit code 3 on a port already in use, which Prefect relies on to pick another port)."""
    if len(argv) >= 2 and argv[0] == "--parent-pid":
        parent_pid, argv = int(argv[1]), argv[2:]
    else:
        parent_pid = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(args=argv, prog_name="uvicorn")  # a click command: raises SystemExit with uvicorn's code


# --- the parent: make Prefect launch the server through this file --------------------------------------
def launch_args(args: list[str], parent_pid: int) -> list[str] | None:
    """``[python, -m, uvicorn, *rest]`` -> ``[python, LAUNCHER, --parent-pid, PID, *rest]``; None when ``args``
    is not Prefect's uvicorn command for its API."""
    if len(args) >= 3 and list(args[1:3]) == ["-m", "uvicorn"] and "prefect.server.api.server:create_app" in args:
        return [args[0], LAUNCHER, "--parent-pid", str(parent_pid), *args[3:]]
    return None


class _ParentBoundPopen(subprocess.Popen):
    """``subprocess.Popen`` that, inside ``_run_uvicorn_command``, starts the server through the launcher."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        if getattr(_launching, "active", False) and isinstance(args, (list, tuple)):
            bound = launch_args([str(a) for a in args], os.getpid())
            if bound is not None:
                args = bound
            else:
                _warn_once(
                    f"Prefect's server command {list(args)!r} is not the expected '-m uvicorn' one: "
                    "started as is, without the parent watchdog"
                )
        super().__init__(args, *rest, **kwargs)


class _SubprocessModule:
    """What ``prefect.server.api.server`` sees as ``subprocess``: the real module, but its ``Popen`` is
    ``_ParentBoundPopen`` (which changes nothing outside ``_run_uvicorn_command``)."""

    Popen = _ParentBoundPopen

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        import logging

        logging.getLogger("clgrpo.prefect_server").warning(message)  # the name its warnings always had


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in {"0", "false", "no", "off"}


def install(*, only_if_ephemeral: bool = False) -> bool:
    """Make every temporary Prefect server this process starts (``get_client()`` without ``PREFECT_API_URL``,
    ``prefect_test_harness``) die with this process. Idempotent and thread-safe; call it before the first
    flow or client. ``only_if_ephemeral``: do nothing when an API URL is configured (no temporary server will
    start, and importing Prefect's server module costs 1-2 s). True when installed (False when
    ``CLGRPO_PREFECT_SERVER_WATCHDOG=0``, or skipped)."""
    if _disabled():
        return False
    if only_if_ephemeral:
        from prefect.settings import get_current_settings

        if get_current_settings().api.url:
            return False
    with _install_lock:
        from prefect.server.api import server as prefect_server

        cls = prefect_server.SubprocessASGIServer
        if not isinstance(prefect_server.subprocess, _SubprocessModule):
            # a stand-in for the module that watches what the server launches
            prefect_server.subprocess = _SubprocessModule(prefect_server.subprocess)  # type: ignore[assignment]
        if getattr(cls._run_uvicorn_command, _MARK, False):
            return True
        original = cls._run_uvicorn_command

        def _run_uvicorn_command(self: Any) -> subprocess.Popen[Any]:
            previous = getattr(_launching, "active", False)
            _launching.active = True
            try:
                return original(self)
            finally:
                _launching.active = previous

        _run_uvicorn_command.__doc__ = original.__doc__
        _run_uvicorn_command.__wrapped__ = original  # type: ignore[attr-defined]  # functions take attributes
        setattr(_run_uvicorn_command, _MARK, True)
        cls._run_uvicorn_command = _run_uvicorn_command  # type: ignore[method-assign]  # the patch itself
        return True


def installed() -> bool:
    """Whether ``install()`` is in effect in this process."""
    from prefect.server.api import server as prefect_server

    return bool(getattr(prefect_server.SubprocessASGIServer._run_uvicorn_command, _MARK, False))


if __name__ == "__main__":
    serve(sys.argv[1:])
