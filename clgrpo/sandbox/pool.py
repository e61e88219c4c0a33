"""The sandboxed Python tool of agent rollouts: a pool of interpreters, one per rollout (session).

Each session gets its own interpreter in a separate process (``clgrpo/sandbox/worker.py``), started lazily at
its first ``run()``, with one persistent namespace for the session's calls, a fresh temporary directory as
cwd/HOME/TMPDIR (removed when the session ends), and per-call limits. At most ``pool_size`` interpreters are
alive at once; ``spares`` of them are started ahead (Python started, worker imported, waiting) and bound to a
session at its first call. What an interpreter is confined to, and why that holds, is ``clgrpo.sandbox.isolation``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import struct
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

from clgrpo.process.leftovers import remove_tree, temp_prefix
from clgrpo.sandbox.isolation import SandboxUnavailable, clean_env, confinement, probed, unavailable

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from schemas.config import SandboxConfig

__all__ = ["PythonSandbox", "PythonSession", "RunResult", "sandbox_for"]

WORKER = Path(__file__).resolve().with_name("worker.py")
START_TIMEOUT_S = 60.0  # Python start-up + the worker's imports (generous: a loaded machine)
BIND_TIMEOUT_S = 30.0
POLL_S = 0.1  # how often the parent checks a running call's CPU time
MAX_REPLY = 1 << 20  # replies are small JSON objects; anything larger is a corrupted channel
IDLE_CHECK_S = 0.5  # how often the parent checks the CPU time of interpreters between calls


@dataclass(frozen=True)
class RunResult:
    output: str  # stdout + stderr of the call (capped at output_chars), then a trailing expression's repr
    error: str | None  # None: the code ran to completion; else one line for the model
    truncated: bool  # output was cut at output_chars
    output_total_chars: int  # how many chars the call produced in all
    restarted: bool  # the interpreter was killed during this call; the next run() starts a fresh one
    cpu_s: float  # CPU time of the call
    wall_s: float  # wall time of the call
    wait_s: float  # time spent waiting for an interpreter (pool full / start-up)


# --- one interpreter process ------------------------------------------------------------------------------
class _ChannelError(Exception):
    """The interpreter's reply channel closed (``eof``) or carried garbage."""

    def __init__(self, message: str, eof: bool = False) -> None:
        super().__init__(message)
        self.eof = eof


class _Interp:
    """One worker process: its reply channel, its output pipe (drained into a capped buffer) and its kill."""

    def __init__(self, out_cap: int) -> None:
        self.out_cap = out_cap  # bytes of output kept per call
        self.out = bytearray()
        self.out_dropped = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.reader: asyncio.StreamReader | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.out_fd: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.released = False
        self.closed = False
        self.stopped_idle = False  # killed between calls: threads left running used the CPU limit

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def process(self) -> asyncio.subprocess.Process:
        """The worker process, which start() created."""
        assert self.proc is not None, "the interpreter was not started"
        return self.proc

    @property
    def channel(self) -> asyncio.StreamReader:
        """The reply channel, which start() opened."""
        assert self.reader is not None, "the interpreter was not started"
        return self.reader

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop start() ran in, which watches the output pipe."""
        assert self.loop is not None, "the interpreter was not started"
        return self.loop

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-B",
                str(WORKER),
                str(res_w),
                stdin=asyncio.subprocess.PIPE,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(res_w,),
                env=clean_env(),
                cwd="/",
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            for fd in (res_r, out_r):
                os.close(fd)
            raise
        finally:
            os.close(res_w)
            os.close(out_w)
        self.out_fd = out_r
        os.set_blocking(out_r, False)
        loop.add_reader(out_r, self._on_output, out_r)
        self.reader = reader = asyncio.StreamReader()
        self.transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(res_r, "rb", buffering=0)
        )
        try:
            ready = await asyncio.wait_for(self.recv(), START_TIMEOUT_S)
        except (asyncio.TimeoutError, _ChannelError) as exc:
            raise SandboxUnavailable(f"the sandboxed Python interpreter did not start ({self._why(exc)})") from None
        if "ready" not in ready:
            raise SandboxUnavailable("the sandboxed Python interpreter did not start (unexpected first message)")

    def _why(self, exc: BaseException) -> str:
        if isinstance(exc, asyncio.TimeoutError):
            return f"no reply in {START_TIMEOUT_S:g}s"
        self.drain()
        last = [ln for ln in self.out.decode("utf-8", "replace").splitlines() if ln.strip()]
        return last[-1].strip() if last else str(exc)

    async def bind(self, message: dict) -> None:
        try:
            await self.send(message)
            reply = await asyncio.wait_for(self.recv(), BIND_TIMEOUT_S)
        except (asyncio.TimeoutError, _ChannelError) as exc:
            raise SandboxUnavailable(
                f"the sandboxed Python interpreter could not apply its restrictions ({self._why(exc)})"
            ) from None
        if "ok" not in reply:
            raise unavailable(f"the interpreter could not apply its restrictions: {reply.get('error')}")
        self.out.clear()
        self.out_dropped = 0

    async def send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        stdin = self.process.stdin
        assert stdin is not None, "started with stdin=PIPE"
        try:
            stdin.write(struct.pack(">I", len(data)) + data)
            await stdin.drain()
        except (ConnectionError, RuntimeError, OSError) as exc:
            raise _ChannelError(f"command channel closed: {exc}", eof=True) from None

    async def recv(self) -> dict:
        try:
            head = await self.channel.readexactly(4)
            size = struct.unpack(">I", head)[0]
            if size > MAX_REPLY:
                raise _ChannelError(f"reply of {size} bytes")
            reply = json.loads(await self.channel.readexactly(size))
        except asyncio.IncompleteReadError:
            raise _ChannelError("the interpreter closed its reply channel", eof=True) from None
        except ValueError as exc:
            raise _ChannelError(f"unreadable reply: {exc}") from None
        if not isinstance(reply, dict):
            raise _ChannelError("unreadable reply")
        return reply

    def _keep(self, chunk: bytes) -> None:
        room = self.out_cap - len(self.out)
        if room > 0:
            self.out += chunk[:room]
        self.out_dropped += max(0, len(chunk) - max(room, 0))

    def _on_output(self, fd: int, max_reads: int = 16) -> bool:
        """Read what the output pipe ``fd`` holds (at most ``max_reads`` chunks). Returns False at end of file."""
        for _ in range(max_reads):
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self.event_loop.remove_reader(fd)
                return False
            self._keep(chunk)
        return True

    def drain(self) -> None:
        """Everything written to fds 1/2 before now (bounded: a thread that writes forever cannot stall us)."""
        if self.out_fd is not None and not self.closed:
            self._on_output(self.out_fd, max_reads=256)

    def take_output(self) -> tuple[str, int]:
        """The output since the last call as text, and its length counting what was dropped."""
        text = self.out.decode("utf-8", "replace")
        total = len(text) + self.out_dropped
        self.out.clear()
        self.out_dropped = 0
        return text, total

    def cpu_s(self) -> float | None:
        """CPU time of the process (all threads) from /proc; None if it cannot be read."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Kill, reap, keep the last output in the buffer, close every fd (idempotent)."""
        self.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self.closed:
            return
        self.drain()
        self.closed = True
        if self.out_fd is not None:
            self.event_loop.remove_reader(self.out_fd)
            os.close(self.out_fd)
        if self.transport is not None:
            self.transport.close()
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()


def _kill_and_remove(interps: set[_Interp], dirs: set[str]) -> None:
    """Last resort when a pool is dropped without aclose() (or at exit): no process or directory survives."""
    for interp in list(interps):
        interp.kill()
    for directory in list(dirs):
        remove_tree(directory)


# --- sessions and the pool --------------------------------------------------------------------------------
class PythonSession:
    """One rollout's interpreter: variables persist across run() calls; started at the first call."""

    def __init__(self, pool: PythonSandbox) -> None:
        self._pool = pool
        self._interp: _Interp | None = None
        self._dir: str | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def run(self, code: str) -> RunResult:
        """Run ``code`` in the session's namespace. Never raises for what the code does; raises
        SandboxUnavailable only when an interpreter cannot be provided."""
        async with self._lock:
            if self._closed:
                raise SandboxUnavailable("python sandbox: the session has ended")
            start = time.monotonic()
            interp = self._interp
            if interp is not None:
                self._pool._busy(interp)
                if interp.stopped_idle or interp.process.returncode is not None:  # died since the last call
                    return await self._died_between_calls(interp)
            if interp is None:
                if self._dir is None:
                    self._dir = self._pool._new_dir()
                interp = self._interp = await self._pool._acquire(self._dir)
            wait_s = time.monotonic() - start
            try:
                result = await self._call(interp, code)
            except asyncio.CancelledError:  # the caller gave up: the interpreter's state is unknown
                self._interp = None
                interp.kill()
                self._pool._background(self._pool._release(interp))
                raise
            if result.restarted:
                self._interp = None
                await self._pool._release(interp)
            else:
                self._pool._idle(interp)
            return replace(result, wait_s=wait_s)

    async def _call(self, interp: _Interp, code: str) -> RunResult:
        cfg = self._pool.cfg
        start = time.monotonic()
        cpu_start = interp.cpu_s() or 0.0
        cpu_seen = cpu_start
        grace = 1.0 + 0.25 * cfg.cpu_s
        reply: dict | None = None
        killed: str | None = None
        try:
            await interp.send({"code": code})
            pending = asyncio.ensure_future(interp.recv())
            try:
                while True:
                    remaining = cfg.wall_s - (time.monotonic() - start)
                    if remaining <= 0:
                        killed = (
                            f"wall-time limit of {cfg.wall_s:g}s exceeded: the interpreter was restarted, "
                            "variables are lost"
                        )
                        break
                    done, _ = await asyncio.wait({pending}, timeout=min(POLL_S, remaining))
                    if done:
                        reply = pending.result()
                        break
                    cpu_seen = interp.cpu_s() or cpu_seen
                    if cpu_seen - cpu_start > cfg.cpu_s + grace:  # a C-level loop never saw the CPU timer
                        killed = (
                            f"CPU time limit of {cfg.cpu_s:g}s exceeded: the interpreter was killed (the "
                            "computation did not return to Python), variables are lost"
                        )
                        break
            finally:
                if not pending.done():
                    pending.cancel()
        except _ChannelError as exc:
            reply = None
            if not exc.eof:
                killed = "the interpreter's reply channel was corrupted: it was restarted, variables are lost"
            else:  # the process is exiting: let it finish, so its own exit status is reported, not our kill
                try:
                    await asyncio.wait_for(interp.process.wait(), 2.0)
                except asyncio.TimeoutError:
                    killed = "the interpreter closed its reply channel: it was restarted, variables are lost"
        wall_s = time.monotonic() - start
        if reply is not None:
            try:
                kept_by_worker, total, cpu_s = int(reply["kept"]), int(reply["total"]), float(reply["cpu_s"])
                error = None if reply["error"] is None else " ".join(str(reply["error"]).split())
            except (KeyError, TypeError, ValueError):  # the cell wrote to the reply channel itself
                reply = None
                killed = "the interpreter's reply channel was corrupted: it was restarted, variables are lost"
        if reply is not None:
            interp.drain()
            text, received = interp.take_output()
            total += max(0, received - kept_by_worker)  # C-level writes to fds 1/2 that bypassed the cap
            return self._result(text, total, error, restarted=False, cpu_s=cpu_s, wall_s=wall_s)
        cpu_seen = interp.cpu_s() or cpu_seen
        await interp.close()
        if killed is None:
            killed = self._death(interp.process.returncode)
        text, total = interp.take_output()
        return self._result(text, total, killed, restarted=True, cpu_s=max(0.0, cpu_seen - cpu_start), wall_s=wall_s)

    def _result(
        self, text: str, total: int, error: str | None, *, restarted: bool, cpu_s: float, wall_s: float
    ) -> RunResult:
        cap = self._pool.cfg.output_chars
        output = text[:cap]
        total = max(total, len(text))
        return RunResult(
            output=output,
            error=error,
            truncated=total > len(output),
            output_total_chars=total,
            restarted=restarted,
            cpu_s=cpu_s,
            wall_s=wall_s,
            wait_s=0.0,
        )

    def _death(self, returncode: int | None, stopped_idle: bool = False) -> str:
        if stopped_idle:
            how = (
                f"was stopped between calls: threads left running used more than the CPU time limit of "
                f"{self._pool.cfg.cpu_s:g}s"
            )
        elif returncode is not None and returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            how = f"crashed ({name})"
        else:
            how = f"exited (status {returncode})"
        return f"the interpreter {how}: it was restarted, variables are lost"

    async def _died_between_calls(self, interp: _Interp) -> RunResult:
        self._interp = None
        await interp.close()
        text, total = interp.take_output()
        error = self._death(interp.process.returncode, interp.stopped_idle) + " (the code was not run)"
        await self._pool._release(interp)
        return self._result(text, total, error, restarted=True, cpu_s=0.0, wall_s=0.0)

    async def _close(self) -> None:
        self._closed = True
        interp, self._interp = self._interp, None
        if interp is not None:
            interp.kill()
            await asyncio.shield(self._pool._release(interp))
        if self._dir is not None:
            self._pool._remove_dir(self._dir)


class PythonSandbox:
    """The pool of sandboxed interpreters; one per event loop (asyncio subprocesses are loop-bound)."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._probe = probed()  # SandboxUnavailable here if the kernel lacks Landlock or seccomp
        self.isolation: str = self._probe.line
        self._alive = 0  # interpreters started and not yet reaped (spares included)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._spares: list[asyncio.Task] = []
        self._interps: set[_Interp] = set()
        self._dirs: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._between_calls: dict[_Interp, float] = {}  # bound, between calls: CPU time at the last call's end
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self._keeper: asyncio.Task | None = None  # sandbox_for's pools: closes the pool when the loop ends
        self._finalizer = weakref.finalize(self, _kill_and_remove, self._interps, self._dirs)

    # -- public --
    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[PythonSession]:
        session = PythonSession(self)
        self._refill()  # a spare gets a head start while the rollout's first model call runs
        try:
            yield session
        finally:
            await session._close()

    def session(self) -> contextlib.AbstractAsyncContextManager[PythonSession]:
        """One per agent rollout; its interpreter starts at the first run() and is killed at exit."""
        return self._session()

    async def start(self) -> None:
        """Start the spares now (idempotent)."""
        self._check_open()
        self._refill()

    async def aclose(self) -> None:
        """Kill every interpreter, remove every temporary directory."""
        self._closed = True
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(SandboxUnavailable("python sandbox: the pool was closed"))
        spares, self._spares = self._spares, []
        for task in spares:
            task.cancel()
        for task in spares:
            with contextlib.suppress(BaseException):
                interp = await task
                await self._release(interp)
        await asyncio.gather(*(self._release(interp) for interp in list(self._interps)), return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(BaseException):
                await self._watcher
        for directory in list(self._dirs):
            self._remove_dir(directory)

    # -- slots --
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxUnavailable("python sandbox: the pool was closed")

    async def _take_slot(self) -> None:
        if self._alive < self.cfg.pool_size and not self._waiters:
            self._alive += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # _give_slot counted us in
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_slot()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def _give_slot(self) -> None:
        self._alive -= 1
        while self._waiters and self._alive < self.cfg.pool_size:
            fut = self._waiters.popleft()
            if not fut.done():
                self._alive += 1
                fut.set_result(None)
        self._refill()

    def _refill(self) -> None:
        if self._closed:
            return
        want = min(self.cfg.spares, self.cfg.pool_size)
        while len(self._spares) < want and self._alive < self.cfg.pool_size and not self._waiters:
            self._alive += 1
            task = asyncio.get_running_loop().create_task(self._spare())
            task.add_done_callback(_retrieve)
            self._spares.append(task)

    # -- interpreters --
    async def _spawn(self) -> _Interp:
        """A started, ready interpreter (the caller holds its slot)."""
        interp = _Interp(out_cap=4 * self.cfg.output_chars)
        self._interps.add(interp)
        try:
            await interp.start()
        except BaseException as exc:
            interp.kill()
            await asyncio.shield(interp.close())
            self._interps.discard(interp)
            if isinstance(exc, (OSError, ValueError)):
                raise SandboxUnavailable(f"the sandboxed Python interpreter cannot start: {exc}") from exc
            raise
        return interp

    async def _spare(self) -> _Interp:
        try:
            return await self._spawn()
        except BaseException:
            self._give_slot()
            raise

    async def _acquire(self, directory: str) -> _Interp:
        """An interpreter bound to ``directory``: a spare if one is there, else a cold start (waiting for a
        slot when ``pool_size`` are alive)."""
        self._check_open()
        if self._spares:
            task = self._spares.pop(0)
            try:
                interp = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.add_done_callback(self._discard)
                raise
        else:
            await self._take_slot()
            try:
                interp = await self._spawn()
            except BaseException:
                self._give_slot()
                raise
        try:
            await interp.bind(self._bind_message(directory))
        except BaseException:
            interp.kill()
            await asyncio.shield(self._release(interp))
            raise
        self._refill()
        return interp

    def _bind_message(self, directory: str) -> dict:
        return {"dir": directory, **confinement(self.cfg, self._probe), "parent_pid": os.getpid()}

    def _discard(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            interp = task.result()
            interp.kill()
            self._background(self._release(interp))

    async def _release(self, interp: _Interp) -> None:
        """Kill and reap ``interp``, then free its slot (idempotent)."""
        if interp.released:
            return
        interp.released = True
        self._busy(interp)
        try:
            await interp.close()
        finally:
            self._interps.discard(interp)
            self._give_slot()

    def _idle(self, interp: _Interp) -> None:
        """``interp`` is between calls: from now on only threads a cell left running can use CPU."""
        cpu = interp.cpu_s()
        if cpu is None or self._closed:
            return
        self._between_calls[interp] = cpu
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_between_calls())

    def _busy(self, interp: _Interp) -> None:
        self._between_calls.pop(interp, None)

    async def _watch_between_calls(self) -> None:
        """Kill an interpreter whose left-over threads use more than ``cpu_s`` between two calls (the next
        run() reports it). Runs while some interpreter is between calls."""
        while self._between_calls and not self._closed:
            await asyncio.sleep(IDLE_CHECK_S)
            for interp, mark in list(self._between_calls.items()):
                cpu = interp.cpu_s()
                if cpu is not None and cpu - mark > self.cfg.cpu_s:
                    interp.stopped_idle = True
                    interp.kill()
                    self._between_calls.pop(interp, None)

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- directories --
    def _new_dir(self) -> str:
        self._check_open()
        directory = tempfile.mkdtemp(prefix=temp_prefix("py"))  # owner-tagged: swept if this process is killed
        self._dirs.add(directory)
        if self._probe.uid is not None:
            os.chown(directory, self._probe.uid, self._probe.uid)
        return directory

    def _remove_dir(self, directory: str) -> None:
        if directory in self._dirs:
            remove_tree(directory)
            self._dirs.discard(directory)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a spare that failed to start is reported to the session that takes it


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, PythonSandbox]] = weakref.WeakKeyDictionary()


def sandbox_for(cfg: SandboxConfig) -> PythonSandbox:
    """The shared pool for this config and the running event loop (created on first use). It is closed when
    the loop's remaining tasks are cancelled at its end (``asyncio.run`` does that), so its interpreters never
    outlive the loop that owns their subprocess transports."""
    loop = asyncio.get_running_loop()
    pools = _pools.setdefault(loop, {})
    key = cfg.model_dump_json() if hasattr(cfg, "model_dump_json") else repr(cfg)
    pool = pools.get(key)
    if pool is None or pool._closed:
        pool = pools[key] = PythonSandbox(cfg)
        pool._keeper = loop.create_task(_close_at_loop_end(pool), name="clgrpo-sandbox-pool")
    return pool


async def _close_at_loop_end(pool: PythonSandbox) -> None:
    try:
        await asyncio.get_running_loop().create_future()  # until cancelled: the loop is ending
    finally:
        await pool.aclose()
