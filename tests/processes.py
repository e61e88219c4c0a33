"""Process helpers shared by the tests that start real servers and kill processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie nobody has reaped yet counts: it holds no memory, port or file)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_detached(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    """A process in its own session (so ``stop_group`` reaches its children), output to ``log``."""
    with open(log, "w") as handle:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the process's session, SIGKILL it if it does not stop in ``timeout`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 150) -> None:
    """Until ``{url}/health`` answers (a Prefect API), failing with the log's tail if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {timeout}s: {log.read_text()[-3000:]}")


@dataclass
class PrefectApi:
    url: str
    home: Path


# a real server's SQLite waits up to 60 s for a lock (Prefect's default, 10 s, lost the scheduler's insert of a run
# to "database is locked" on a loaded 2-core machine)
SERVER_ENV = {"PREFECT_SERVER_DATABASE_TIMEOUT": "60"}


def real_prefect_server(home: Path) -> Iterator[PrefectApi]:
    """A real ``prefect server`` in its own session, healthy, until the generator is closed (then stopped with
    its process group)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home / "server-home"), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.update(SERVER_ENV)
    log = home / "server.log"
    server = start_detached(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
        env,
        log,
        cwd=home,
    )
    try:
        wait_healthy(url, server, log, timeout=180)
        yield PrefectApi(url, home)
    finally:
        stop_group(server, timeout=30)  # its own session: the server and its uvicorn child
