"""llama.cpp's HTTP server (``llama-server``): the fastest engine measured for GGUF models on a CPU.

It serves the OpenAI chat API (``backend: openai`` talks to it like to any endpoint) with continuous batching
over parallel slots, a prompt cache per slot (the system prompt and library shared by a step's rollouts are
prefilled once per slot, not once per request), JSON-schema constrained decoding and the model's own chat
template. On this project's 2-core machine it decoded Qwen2.5-Coder-0.5B at about 54 tokens/s over 8 slots
(benchmarks/REPORT.md "Engines").

The engine is ``$CLGRPO_LLAMA_SERVER`` (a binary of your own) or the one built once into the cache
(``application.llama_build``: portable, ggml picks the CPU kernels at run time). Before an engine is trusted on a
machine it passes a smoke test there (``ensure_engine``): the tiny embedded model (SmolLM2-135M) loaded and one
short completion answered; a crash is retried with the weight repacking off (``--no-repack``: the workaround
for CPU kernels that fault at load), and what worked, or why nothing did, is kept per machine (CPU model and
flags) and engine, so a binary that failed is not tried again there. ``LlamaServer`` starts a server on a free
loopback port, waits until it serves, stops it (it also dies with the process that started it), and says in
words when it crashes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from application.llama_build import BuildError, build_engine, built_binary, cpu_flags
from clgrpo.models.weights import SMOLLM2, ModelError, cache_root, fetch_model

BINARY_ENV = "CLGRPO_LLAMA_SERVER"  # a llama-server binary of your own instead of the built one
READY_TIMEOUT_S = 180.0
SMOKE_TIMEOUT_S = 120.0
# what each smoke-test attempt adds to the command line, in order: as built, then without weight repacking
SMOKE_LADDER: tuple[tuple[str, ...], ...] = ((), ("--no-repack",))
_PR_SET_PDEATHSIG = 1
_SIGNAL_WORDS = {
    "SIGSEGV": "a segmentation fault",
    "SIGILL": "an instruction this CPU does not run",
    "SIGBUS": "a bus error",
    "SIGABRT": "aborted",
    "SIGKILL": "killed, e.g. out of memory",
    "SIGFPE": "an arithmetic fault",
}

Log = Callable[[str], None]


class ServerError(RuntimeError):
    """The server could not be built, trusted or started; the message says why and what to do."""


class ServerCrashed(ServerError):
    """The server process died by a signal or an error exit (at load or while serving)."""


@dataclass(frozen=True)
class LlamaEngine:
    """A llama-server binary and the arguments this machine needs for it (from its smoke test)."""

    binary: Path
    args: tuple[str, ...] = ()
    source: str = "built"  # "built" or "$CLGRPO_LLAMA_SERVER"

    def describe(self) -> str:
        extra = f" with {' '.join(self.args)}" if self.args else ""
        return f"{self.binary} ({self.source}{extra})"


# --- which engine, and whether this machine can trust it -------------------------------------------------
def find_engine(cache: str | os.PathLike[str] | None = None) -> LlamaEngine | None:
    """``$CLGRPO_LLAMA_SERVER``, else the built engine in the cache, else None; with what this machine's smoke
    test chose, if it ran (no test here: see ``ensure_engine``). One that failed its test here is refused."""
    own = os.environ.get(BINARY_ENV)
    if own:
        if not Path(own).is_file():
            raise ServerError(f"{BINARY_ENV}={own}: no such file")
        engine = LlamaEngine(Path(own), source=f"${BINARY_ENV}")
    else:
        built = built_binary(cache)
        if built is None:
            return None
        engine = LlamaEngine(built)
    verdict = _verdicts(cache).get(_trust_key(engine))
    if verdict is None:
        return engine
    if not verdict.get("ok"):
        raise ServerError(
            f"llama-server {engine.binary} does not work on this machine: {verdict.get('reason')} (its smoke test, "
            f"{verdict.get('checked_at', '?')}; rebuild with `clgrpo model build-server --force`, or use "
            f"--engine transformers)"
        )
    return LlamaEngine(engine.binary, tuple(verdict.get("args", ())), engine.source)


def ensure_engine(
    cache: str | os.PathLike[str] | None = None,
    *,
    log: Log = print,
    build: bool = True,
    smoke_model: Path | None = None,
) -> LlamaEngine:
    """The engine this machine can trust: found or (``build``) built, and smoke-tested here once. A ServerError
    when there is none: not built, cannot be built, or it failed here (now or before)."""
    engine = find_engine(cache)
    if engine is None:
        if not build:
            raise ServerError("llama-server is not built: run `clgrpo model build-server` once (4 to 8 minutes)")
        try:
            build_engine(cache, log=log)
        except BuildError as exc:
            raise ServerError(str(exc)) from exc
        engine = find_engine(cache)
        assert engine is not None, "build_engine leaves a built engine"
    key = _trust_key(engine)
    verdict = _verdicts(cache).get(key)
    if verdict is None:
        verdict = _smoke_test(engine, cache, log, smoke_model)
        _remember(cache, key, verdict)
    return find_engine(cache) or engine  # as this machine's verdict says (a failure is raised there)


def cpu_model_name() -> str:
    """This CPU's model name (/proc/cpuinfo), or "" where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")


def machine_key() -> str:
    """This CPU, as far as compiled code cares: its model name and instruction-set flags."""
    return hashlib.sha256(f"{cpu_model_name()}|{' '.join(sorted(cpu_flags()))}".encode()).hexdigest()[:16]


def _trust_key(engine: LlamaEngine) -> str:
    """The engine's identity (its file's size and time: a rebuild is a new engine) and this machine."""
    try:
        info = engine.binary.stat()
        identity = f"{engine.binary.resolve()}|{info.st_size}|{info.st_mtime_ns}"
    except OSError:
        identity = str(engine.binary)
    return f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}@{machine_key()}"


def _verdicts_path(cache: str | os.PathLike[str] | None) -> Path:
    return cache_root(cache) / "bin" / "engine-checks.json"


def _verdicts(cache: str | os.PathLike[str] | None) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_verdicts_path(cache).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(cache: str | os.PathLike[str] | None, key: str, verdict: dict[str, Any]) -> None:
    path = _verdicts_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _verdicts(cache) | {key: verdict}
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


def _smoke_test(
    engine: LlamaEngine, cache: str | os.PathLike[str] | None, log: Log, smoke_model: Path | None
) -> dict[str, Any]:
    """Load the tiny model and answer one completion, as built and then along ``SMOKE_LADDER``; the verdict."""
    if smoke_model is None:
        try:
            smoke_model = fetch_model(SMOLLM2, cache, log=lambda m: None, convert=False).gguf
        except ModelError as exc:
            raise ServerError(f"cannot smoke-test llama-server: the tiny model could not be fetched: {exc}") from exc
    log(f"checking llama-server on this machine (load {smoke_model.name}, answer one request) ...")
    failures: list[str] = []
    for extra in SMOKE_LADDER:
        failure = _smoke_once(engine, extra, smoke_model, cache)
        stamp = time.strftime("%Y-%m-%d %H:%M")
        if failure is None:
            how = f" with {' '.join(extra)} (as built it failed: {failures[0]})" if extra else ""
            log(f"llama-server works on this machine{how}")
            return {"ok": True, "args": list(extra), "checked_at": stamp, "failed_first": failures}
        failures.append(failure)
        log(f"  llama-server{' with ' + ' '.join(extra) if extra else ''} failed its smoke test: {failure}")
    return {"ok": False, "reason": "; ".join(failures), "checked_at": stamp}


def _smoke_once(
    engine: LlamaEngine, extra: tuple[str, ...], gguf: Path, cache: str | os.PathLike[str] | None
) -> str | None:
    name = "-".join(a.lstrip("-") for a in extra) or "as-built"
    log_path = cache_root(cache) / "bin" / f"llama-server-smoke-test-{name}.log"  # one per attempt: both kept
    server = LlamaServer(
        gguf,
        "smoke-test",
        slots=1,
        context_per_slot=1024,
        engine=LlamaEngine(engine.binary, extra, engine.source),
        log_path=log_path,
        ready_timeout_s=SMOKE_TIMEOUT_S,
    )
    try:
        server.start()
        server.complete("Say OK.", max_tokens=4, timeout_s=SMOKE_TIMEOUT_S)
    except ServerError as exc:
        return str(exc)
    finally:
        server.stop()
    return None


# --- one server ----------------------------------------------------------------------------------------------
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


def how_it_ended(returncode: int) -> str:
    """An exit status in words: "crashed (SIGSEGV, a segmentation fault)" or "exited with code 1"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"crashed (signal {-returncode})"
        words = _SIGNAL_WORDS.get(name)
        return f"crashed ({name}, {words})" if words else f"crashed ({name})"
    return f"exited with code {returncode}"


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
    log_path: Path | None = None  # the server's own output (default: a file next to the engine)
    extra_args: list[str] = field(default_factory=list)
    engine: LlamaEngine | None = None  # None: find_engine(cache)
    ready_timeout_s: float = READY_TIMEOUT_S
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self, engine: LlamaEngine) -> list[str]:
        threads = self.threads or len(os.sched_getaffinity(0))
        return [
            str(engine.binary),
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
            *engine.args,
            *self.extra_args,
        ]

    def start(self) -> LlamaServer:
        engine = self.engine or find_engine(self.cache)
        if engine is None:
            raise ServerError("llama-server is not built: run `clgrpo model build-server` once (4 to 8 minutes)")
        if not Path(self.gguf).is_file():
            raise ModelError(f"GGUF file not found: {self.gguf}")
        self.port = self.port or free_port()
        self.log_path = self.log_path or engine.binary.parent / f"llama-server-{self.port}.log"
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with Path(self.log_path).open("w") as out:
            self.process = subprocess.Popen(
                self.command(engine),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise self._ended("while loading")
            if self._healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(
            f"llama-server did not serve {Path(self.gguf).name} within {self.ready_timeout_s:.0f} s: "
            f"{self._log_tail()} (log: {self.log_path})"
        )

    def _ended(self, when: str) -> ServerError:  # when: "while loading", "while serving", ...
        """The error for a server process that ended: crashed (a signal) or exited, when, the log's last line."""
        assert self.process is not None and self.process.returncode is not None
        code = self.process.returncode
        cls = ServerCrashed if code != 0 else ServerError
        return cls(
            f"llama-server {how_it_ended(code)} {when} {Path(self.gguf).name}: {self._log_tail(1)} "
            f"(log: {self.log_path})"
        )

    def died(self) -> ServerError | None:
        """If the process ended by itself (a crash while serving): the error that says so; else None."""
        if self.process is None or self.process.poll() is None:
            return None
        return self._ended("while serving")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                return reply.status == 200 and json.loads(reply.read() or b"{}").get("status") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def complete(self, prompt: str, *, max_tokens: int = 8, timeout_s: float = 60.0) -> str:
        """One chat completion (the smoke test's request); a ServerError if it fails or the server dies."""
        body = json.dumps(
            {"model": self.alias, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        ).encode()
        request = urllib.request.Request(
            f"{self.base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                answer = json.loads(reply.read())
            return str(answer["choices"][0]["message"]["content"])
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            if self.process is not None:
                try:
                    self.process.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            if self.process is not None and self.process.poll() is not None:
                raise self._ended("while answering a request with") from exc
            raise ServerError(f"llama-server did not answer a completion: {type(exc).__name__}: {exc}") from exc

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = Path(self.log_path or "").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no server log)"
        return " / ".join(line.strip() for line in text[-lines:]) or "(empty server log)"

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

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
