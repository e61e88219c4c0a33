"""How SIGTERM, SIGINT and SIGHUP end a command: all three the same way, never with a traceback.

The first stop signal is recorded and turned into an asyncio cancellation of the innermost running flow body
(``flow_body``) or command coroutine (``run_command``): no new work is handed out, in-flight model calls and tool
interpreters are cancelled, the flow stores what it finished and ends as Prefect ``Cancelled``, and the
command prints one ``error: terminated (SIGTERM) ...`` line and exits 128 + the signal number. Outside any
event loop the handler raises ``Stopped`` instead. The handler never raises inside a running event loop (an
exception thrown into asyncio internals, e.g. a pending pipe write, can be swallowed); it schedules the
cancellation with ``call_soon_threadsafe`` and repeats it until the flow acknowledges it, so no signal is lost.

A second signal, or a shutdown longer than ``CLGRPO_STOP_GRACE_S`` (default 8 s), exits at once with the same
kind of line: what finished is in DuckDB and the work journal, the run resumes from there, and the next clgrpo
command sweeps what the process could not clean up (``clgrpo.process.leftovers``).

Flows started by a Prefect worker get the same handling from ``flow_body``: a cancel from the UI (or
``prefect flow-run cancel``) reaches the flow process as SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_ENV = "CLGRPO_STOP_GRACE_S"
DEFAULT_GRACE_S = 8.0
RECANCEL_S = 2.0  # a cancellation swallowed by some library is sent again this often


class Stopped(BaseException):
    """The command was stopped by a signal (a BaseException, like KeyboardInterrupt: nothing catches it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated ({signal_name(signum)})")
        self.signum = signum


@dataclass
class _Target:
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task
    acknowledged: bool = False


_lock = threading.RLock()
_signum: int | None = None
_where: str | None = None  # what the run was doing when the signal came (set by the flows)
_resume_hint: str | None = None  # how to resume, set by the command
_targets: list[_Target] = []
_stopping = threading.Event()  # for worker threads (in-process generation checks it between tokens)
_timers: list[threading.Timer] = []


# --- what code asks ----------------------------------------------------------------------------------------
def requested() -> int | None:
    """The stop signal received, or None."""
    return _signum


def stopping() -> bool:
    """Whether a stop signal arrived (cheap; safe from any thread)."""
    return _stopping.is_set()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    return 128 + signum


def note_stage(where: str | None) -> None:
    """What the run is doing now ("step 2 rollout"), named when it is stopped."""
    global _where
    _where = where


def set_resume_hint(hint: str | None) -> None:
    """The command that resumes this work, printed with the stop line."""
    global _resume_hint
    _resume_hint = hint


def describe(signum: int | None = None) -> str:
    """``terminated (SIGTERM) during step 2 rollout``."""
    signum = signum if signum is not None else (_signum or signal.SIGTERM)
    where = f" during {_where or 'start-up'}"
    return f"terminated ({signal_name(signum)}){where}"


def stop_line(signum: int | None = None) -> str:
    """The one line a stopped command prints (without ``error: ``)."""
    resume = f"; resume with: {_resume_hint}" if _resume_hint else ""
    return f"{describe(signum)}: finished work is stored{resume}"


def _stop_grace_timers() -> None:
    with _lock:
        for timer in _timers:
            timer.cancel()
        _timers.clear()


def reset() -> None:
    """Forget a stop signal that was the expected end of a command (``model serve``: Ctrl-C stops it)."""
    global _signum
    with _lock:
        _signum = None
        _stopping.clear()
    _stop_grace_timers()


# --- the handler -------------------------------------------------------------------------------------------
def install_handlers() -> None:
    """Route the stop signals to this module (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, _frame: object) -> None:
    global _signum
    with _lock:
        if _signum is not None:
            _force_exit(signum, "a second signal during shutdown: exiting now")
        _signum = signum
        _stopping.set()
        target = _targets[-1] if _targets else None
    _start_grace_timer(signum)
    if target is None:
        if _loop_running_here():  # a loop nobody registered: never raise into it
            return
        raise Stopped(signum)
    _cancel_until_acknowledged(target)


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _cancel_until_acknowledged(target: _Target) -> None:
    def cancel() -> None:
        if target.acknowledged or target.task.done():
            return
        target.task.cancel(describe())
        target.loop.call_later(RECANCEL_S, cancel)

    try:
        target.loop.call_soon_threadsafe(cancel)
    except RuntimeError:  # the loop is closed: nothing left to cancel there
        pass


def _start_grace_timer(signum: int) -> None:
    try:
        grace = float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE_S)
    except ValueError:
        grace = DEFAULT_GRACE_S
    timer = threading.Timer(grace, _force_exit, (signum, f"shutdown took longer than {grace:g} s: exiting now"))
    timer.daemon = True
    _timers.append(timer)
    timer.start()


def _force_exit(signum: int, why: str) -> None:
    """Exit at once (no cleanup that could hang); children die with this process, the next command sweeps."""
    resume = f"; resume with: {_resume_hint}" if _resume_hint else ""
    line = f"error: {describe(signum)}; {why} (finished work is stored{resume})\n"
    try:
        os.write(2, line.encode("utf-8", "replace"))
    finally:
        os._exit(exit_code(signum))


# --- scopes ------------------------------------------------------------------------------------------------
class _Scope:
    """Makes the current task the one a stop signal cancels, and (in the main thread) installs the handlers
    (Prefect's flow engine replaces SIGTERM's with its own; it gets it back on exit)."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "a stop scope is entered inside a task"
        self.target = _Target(asyncio.get_running_loop(), task)
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_Scope":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, _on_signal)
        with _lock:
            _targets.append(self.target)
        return self

    def acknowledge(self) -> None:
        """The cancellation was seen: stop repeating it and let the cleanup await again."""
        self.target.acknowledged = True
        task = self.target.task
        while task.cancelling():
            task.uncancel()

    def __exit__(self, *exc: object) -> None:
        with _lock:
            if self.target in _targets:
                _targets.remove(self.target)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def is_stop(exc: BaseException) -> bool:
    """Whether ``exc`` is how a stop signal surfaced (a cancellation, a cancelled subflow, ``Stopped``)."""
    if _signum is None:
        return False
    if isinstance(exc, (asyncio.CancelledError, Stopped)):
        return True
    from prefect.exceptions import CancelledRun, TerminationSignal

    return isinstance(exc, (CancelledRun, TerminationSignal))


async def flow_body(body: Callable[[], Awaitable[T]]) -> T | Any:
    """Run a flow's body so that a stop signal ends it as a Prefect ``Cancelled`` state (returned: Prefect
    makes it the flow run's final state) after the body's own cleanup ran."""
    from prefect.states import Cancelled

    with _Scope() as scope:
        try:
            return await body()
        except BaseException as exc:
            if not is_stop(exc):
                raise
            scope.acknowledge()
            return Cancelled(message=describe())


async def cancelled_not_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow's ``on_crashed`` hook: a flow run that crashed because a stop signal arrived while Prefect's
    engine was starting or ending it (outside ``flow_body``) is set Cancelled, as a stop inside the body is."""
    if _signum is None:
        return
    with _lock:  # the engine has seen the cancellation: stop repeating it while the state is sent
        for target in _targets:
            target.acknowledged = True
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    async with get_client() as client:
        await client.set_flow_run_state(flow_run.id, Cancelled(message=describe()), force=True)


def run_command(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` for a command: a stop signal cancels it; raises ``Stopped`` when it was stopped."""

    async def main() -> T:
        with _Scope() as scope:
            try:
                return await coro
            except BaseException as exc:
                if is_stop(exc):
                    scope.acknowledge()
                    raise Stopped(_signum or signal.SIGTERM) from None
                raise

    return asyncio.run(main())
