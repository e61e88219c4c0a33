"""llama.cpp's HTTP server (``llama-server``): the fastest engine measured for GGUF models on a CPU.

It serves the OpenAI chat API (``backend: openai`` talks to it like to any endpoint) with continuous batching
over parallel slots, a prompt cache per slot (the system prompt and library shared by a step's rollouts are
prefilled once per slot, not once per request), JSON-schema constrained decoding and the model's own chat
template. On this project's 2-core machine it decoded Qwen2.5-Coder-0.5B at about 65 tokens/s over 8 slots,
against 37 tokens/s for the transformers backend batching 32 rows (benchmarks/REPORT.md "Engines").

No prebuilt binary runs everywhere, so it is built once from source: the llama.cpp tree vendored in the pinned
``llama-cpp-python`` source distribution on PyPI (``pip download --no-binary``, sha256-checked), configured with
cmake for this CPU, only the ``llama-server`` target (about 6 minutes on 2 cores; needs cmake and a C++
compiler). The binary is cached in ``<cache>/bin``. ``LlamaServer`` starts it on a free loopback port, waits
until it serves, and stops it (it also dies with the process that started it).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clgrpo.leftovers import temp_prefix
from clgrpo.models import ModelError, cache_root, pip_download_source, sha256_of

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp with the server sources
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
BINARY_ENV = "CLGRPO_LLAMA_SERVER"  # a llama-server binary of your own instead of the built one
READY_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """The server could not be built or started; the message says why and what to do."""


def binary_path(cache: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache) / "bin" / f"llama-server-{LLAMA_CPP_PYTHON}"


def find_binary(cache: str | os.PathLike[str] | None = None) -> Path | None:
    """``$CLGRPO_LLAMA_SERVER``, else the built binary in the cache, else None."""
    own = os.environ.get(BINARY_ENV)
    if own:
        if not Path(own).is_file():
            raise ServerError(f"{BINARY_ENV}={own}: no such file")
        return Path(own)
    built = binary_path(cache)
    return built if built.is_file() else None


def build_server(
    cache: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
    jobs: int | None = None,
) -> Path:
    """Build ``llama-server`` once into the cache (see the module text); returns the binary."""
    target = binary_path(cache)
    if target.is_file() and not force:
        return target
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise ServerError(f"building llama-server needs {' and '.join(missing)} (Debian: apt-get install cmake g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=temp_prefix("llama-build")) as tmp:
        source = _unpacked_source(Path(tmp), log)
        build = Path(tmp) / "build"
        started = time.monotonic()
        log(
            f"building llama-server from llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON} sources; about 6 minutes "
            "on 2 cores, once) ..."
        )
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], Path(tmp) / "cmake.log")
        _run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
            Path(tmp) / "build.log",
        )
        partial = target.with_name(target.name + ".partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(target)
        log(f"built {target} in {time.monotonic() - started:.0f} s")
    return target


def _unpacked_source(tmp: Path, log: Callable[[str], None]) -> Path:
    log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} source distribution from PyPI (77 MB) ...")
    archive = pip_download_source("llama-cpp-python", LLAMA_CPP_PYTHON, tmp / "sdist")
    if sha256_of(archive) != SDIST_SHA256:
        raise ServerError(f"sha256 mismatch for {archive.name}: expected {SDIST_SHA256} (not the pinned release)")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp / "src", members=members, filter="data")
    return tmp / "src" / prefix


def _run(cmd: list[str], log_file: Path) -> None:
    with log_file.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
        raise ServerError(f"{' '.join(cmd[:3])} ... failed (exit {done.returncode}): {' / '.join(tail)}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started it dies (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class LlamaServer:
    """One ``llama-server`` process serving ``gguf`` as ``alias`` on 127.0.0.1. Use as a context manager or
    call ``start`` / ``stop``. Start it from the main thread: it is stopped when the starting thread ends."""

    gguf: Path
    alias: str
    slots: int = 8  # parallel sequences (continuous batching); 8 was the best of 4/8/16 on 2 cores
    threads: int | None = None  # None: every usable core
    context_per_slot: int = 4096
    port: int = 0  # 0: a free port
    cache: str | os.PathLike[str] | None = None
    log_path: Path | None = None  # the server's own output (default: a file next to the cached binary)
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self, binary: Path) -> list[str]:
        threads = self.threads or len(os.sched_getaffinity(0))
        return [
            str(binary),
            "--model",
            str(self.gguf),
            "--alias",
            self.alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--threads",
            str(threads),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.slots * self.context_per_slot),
            *self.extra_args,
        ]

    def start(self) -> "LlamaServer":
        binary = find_binary(self.cache)
        if binary is None:
            raise ServerError("llama-server is not built: run `clgrpo model build-server` once (about 6 minutes)")
        if not Path(self.gguf).is_file():
            raise ModelError(f"GGUF file not found: {self.gguf}")
        self.port = self.port or free_port()
        self.log_path = self.log_path or binary.parent / f"llama-server-{self.port}.log"
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with Path(self.log_path).open("w") as out:
            self.process = subprocess.Popen(
                self.command(binary),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(
                    f"llama-server exited with {self.process.returncode} while loading "
                    f"{self.gguf.name}: {self._log_tail()}"
                )
            if self._healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"llama-server did not serve within {READY_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                return reply.status == 200 and json.loads(reply.read() or b"{}").get("status") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = Path(self.log_path or "").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no server log)"
        return " / ".join(text[-lines:]) or "(empty server log)"

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
