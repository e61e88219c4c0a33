"""Answer checking with Hugging Face math-verify, run in a small pool of spawned child processes.

Verification that cannot lie: an outcome is either a genuine grade (``VerifyResult.verified`` True) or an
admission that the verifier could not do its work (``verified`` False, the cause in ``error``; the reward 0.0 is
then a placeholder, not a grade). Nothing here raises to the caller.

Why children: math-verify's own time limits use ``signal.alarm``, which works only in a process's main thread,
while the pipeline grades from worker threads. A pool worker runs its tasks in its main thread.

What a sample's time limit measures -- only the sample's own work:

* In the child, ``timeout_s`` is a budget of *CPU time* (``ITIMER_PROF``: user + system time of the child),
  armed when the item starts and disarmed when it ends. A child starved of CPU by a loaded machine keeps
  working and is not timed out; one that burns its budget is interrupted by ``_CpuBudgetExceeded`` (a
  ``BaseException``, so math-verify's and sympy's ``except Exception`` cannot swallow it; if something swallows
  it anyway, the result is still replaced by the timeout). math-verify's own wall-clock alarms are switched
  off: when they fire, math-verify turns the timeout into "no answer" or "not equal", i.e. a fake grade.
* In the parent, a wall-clock backstop catches a child that is truly hung (blocked, sleeping, stuck in C code,
  or dead): it starts when the child reports that it *started* the item (a marker on a per-pool queue), never at
  submission, so pool start-up and time queued behind other items (this batch's or other threads') never count.
  The limit is generous (``HANG_FACTOR`` x ``timeout_s`` + ``DEADLINE_MARGIN_S``); the pool is then killed, the
  item is reported unverified with a timeout cause, and the batch's unfinished items go to a fresh pool.
* Starting the pool (spawning the children, importing math-verify, a first warm-up parse) has its own generous
  limit, ``STARTUP_TIMEOUT_S``, charged to no sample. ``warm_pool()`` starts it in the background ahead of use.
* An item that never starts while the pool shows no sign of life (no start, finish or ready child) for
  ``STARTUP_TIMEOUT_S`` + the hang limit means a broken pool: it is killed and the items reported unverified.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from clgrpo.experience.example_checks import boxed_at
from clgrpo.sandbox import verify_child as child
from clgrpo.sandbox.verify_child import TIMEOUT_ERROR as _TIMEOUT_ERROR
from clgrpo.sandbox.verify_child import VerifyResult, Worker


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# one child per two usable cores (at most 4): the flow process needs a core of its own, and on a 2-core machine a
# second child's ~0.5 s of start-up CPU competed with the run's start (benchmarks/REPORT.md "Fixed overhead")
POOL_PROCESSES = max(1, min(4, _usable_cores() // 2))
STARTUP_TIMEOUT_S = 120.0  # starting the pool (spawn + import math-verify + warm-up); charged to no sample
POOL_STOP_S = 2.0  # closing the pool: how long terminate() may take before its workers are killed directly
HANG_FACTOR = 4.0  # parent backstop: an item running HANG_FACTOR * timeout_s + DEADLINE_MARGIN_S (wall clock,
DEADLINE_MARGIN_S = 10.0  # from the moment a child started it) without finishing counts as hung
MAX_LOST_ROUNDS = 3  # a batch gives up after its pool was killed this often by other threads' timeouts
_POLL_S = 0.05


# --- child side: clgrpo/sandbox/verify_child.py (imports nothing of clgrpo's packages, so children start fast) ---
_child_init, _run_item, _grade_one = child.child_init, child.run_item, child.grade_one


# --- the shared pool ---------------------------------------------------------------------------------


class _Generation:
    """One started pool and what its children reported on the events queue."""

    def __init__(self, number: int, pool: Pool, events: Any) -> None:
        self.number = number
        self.pool = pool
        self.start_s: float | None = None  # how long starting it took
        self.ready = 0  # children that finished their warm-up
        self.failures: list[str] = []  # children that failed theirs
        self.last_sign_of_life = time.monotonic()  # last child ready, item started or item finished
        self._events = events
        self._started: dict[int, float] = {}  # token -> when (parent clock) a child reported starting it
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, worker: Worker, token: int, output: str, answer: str, timeout_s: float) -> AsyncResult:
        return self.pool.apply_async(
            _run_item, (worker, token, output, answer, timeout_s), callback=self._alive, error_callback=self._alive
        )

    def started_at(self, token: int) -> float | None:
        self.drain()
        return self._started.get(token)

    def forget(self, token: int) -> None:
        self._started.pop(token, None)

    def drain(self) -> None:
        """Read the children's messages. Stamps use the parent's clock, so they can only be late, never early."""
        with self._lock:
            if self._closed:
                return
            try:
                while not self._events.empty():
                    kind, key, info = self._events.get()
                    now = time.monotonic()
                    if kind == "start":
                        self._started[key] = now
                    elif kind == "ready":
                        self.ready += 1
                    elif kind == "failed":
                        self.failures.append(str(info))
                        continue
                    self.last_sign_of_life = now
            except (OSError, EOFError, ValueError):  # the queue broke: the hang / stall limits take over
                pass

    def close(self) -> None:
        # terminate() first takes the task queue's lock, which an idle worker holds while it waits for a task: a
        # worker killed there (a signal to the whole process group, as a Prefect worker's cancel sends) holds it
        # forever. So it gets POOL_STOP_S in a daemon thread; past that the workers are killed directly.
        stopper = threading.Thread(target=self.pool.terminate, name="math-verify-pool-stop", daemon=True)
        stopper.start()
        stopper.join(POOL_STOP_S)
        if stopper.is_alive():
            for process in list(getattr(self.pool, "_pool", [])):
                try:
                    process.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
        with self._lock:
            self._closed = True
            try:
                self._events.close()
            except Exception:  # noqa: BLE001 - closing is best effort: the pool is going away
                pass

    def _alive(self, _result: object) -> None:
        self.last_sign_of_life = time.monotonic()


class _StartAttempt:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.generation: _Generation | None = None
        self.error: BaseException | None = None


class _PoolHolder:
    """The shared pool, started in a background thread (by ``warm`` or the first use) and replaced after a kill.

    A failed start is kept and reported to the callers waiting on it, or else to the next caller; the call after
    that tries again."""

    def __init__(self, processes: int) -> None:
        self._processes = processes
        self._lock = threading.Lock()
        self._current: _Generation | None = None
        self._attempt: _StartAttempt | None = None  # running, or failed and not yet reported
        self._numbers = itertools.count(1)

    def warm(self) -> None:
        with self._lock:
            if self._current is None and self._attempt is None:
                self._attempt = self._launch()

    def acquire(self) -> _Generation:
        """The running pool, starting it (or waiting for the start under way) when there is none."""
        with self._lock:
            if self._current is not None:
                return self._current
            attempt = self._attempt
            if attempt is None:
                attempt = self._attempt = self._launch()
        if not attempt.done.wait(STARTUP_TIMEOUT_S + 30.0):  # the start thread enforces STARTUP_TIMEOUT_S itself
            raise TimeoutError(f"the verifier pool did not start within {STARTUP_TIMEOUT_S:g}s")
        with self._lock:
            if attempt.generation is not None:
                return attempt.generation  # if it was killed meanwhile, submitting fails and the batch retries
            if self._attempt is attempt:
                self._attempt = None  # reported now; the next call starts afresh
        raise attempt.error or RuntimeError("the verifier pool did not start")

    def current(self) -> _Generation | None:
        return self._current

    def alive(self, generation: _Generation) -> bool:
        return self._current is generation

    def discard(self, generation: _Generation) -> None:
        """Kill the pool of this generation (no-op when another thread already did)."""
        with self._lock:
            if self._current is not generation:
                return
            self._current = None
        generation.close()

    def close(self) -> None:
        with self._lock:
            generation, self._current = self._current, None
        if generation is not None:
            generation.close()

    def _launch(self) -> _StartAttempt:
        attempt = _StartAttempt()
        number = next(self._numbers)
        threading.Thread(target=self._start, args=(attempt, number), name="math-verify-pool-start", daemon=True).start()
        return attempt

    def _start(self, attempt: _StartAttempt, number: int) -> None:
        try:
            generation = _start_generation(self._processes, number)
        except BaseException as exc:  # noqa: BLE001 - kept for the callers (see acquire)
            attempt.error = exc
        else:
            with self._lock:
                attempt.generation = generation
                self._current = generation
                if self._attempt is attempt:
                    self._attempt = None
        finally:
            attempt.done.set()


def _start_generation(processes: int, number: int) -> _Generation:
    """Spawn the children and wait (up to ``STARTUP_TIMEOUT_S``) until they are warmed up."""
    started = time.monotonic()
    limit_s = STARTUP_TIMEOUT_S
    context = multiprocessing.get_context("spawn")
    events = context.SimpleQueue()
    with _main_module_hidden():
        pool = context.Pool(processes=processes, initializer=_child_init, initargs=(events,))
    generation = _Generation(number, pool, events)
    try:
        while True:
            generation.drain()
            if generation.failures:
                raise RuntimeError(f"a verifier child failed to start: {generation.failures[0]}")
            if generation.ready >= processes:
                break
            if time.monotonic() - started >= limit_s:
                if generation.ready:  # one child works; the others may still come
                    break
                raise TimeoutError(f"no verifier child was ready within {limit_s:g}s")
            time.sleep(_POLL_S)
    except BaseException:
        generation.close()
        raise
    generation.start_s = time.monotonic() - started
    generation.last_sign_of_life = time.monotonic()
    return generation


_MAIN_LOCK = threading.Lock()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned children re-import the parent's main module (the ``clgrpo`` script, ``prefect.engine``, pytest):
    seconds of imports per child on a loaded machine, and fatal when main is no file (``python - <script``).
    Workers are module-level functions of importable modules and never need it, so hide it while the children
    are created. (A child the pool replaces later, after one died, still imports it.)"""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _MAIN_LOCK:
        saved = {name: vars(main)[name] for name in ("__spec__", "__file__") if name in vars(main)}
        main.__spec__ = None
        if "__file__" in saved:
            del main.__file__
        try:
            yield
        finally:
            for name in ("__spec__", "__file__"):
                if name in saved:
                    setattr(main, name, saved[name])
                elif name in vars(main):
                    delattr(main, name)


_POOL = _PoolHolder(POOL_PROCESSES)
_TOKENS = itertools.count(1)
atexit.register(_POOL.close)


# --- public API --------------------------------------------------------------------------------------


def warm_pool() -> None:
    """Start the verifier pool in the background, ahead of the first grade. Returns at once; idempotent; safe
    from any thread. A failed start is reported (as unverified results) by the first grading call."""
    _POOL.warm()


def pool_is_up() -> bool:
    """Whether a started pool is ready to take items now."""
    return _POOL.current() is not None


def pool_start_seconds() -> float | None:
    """How long starting the current pool took (None when there is none)."""
    generation = _POOL.current()
    return generation.start_s if generation is not None else None


def shutdown_pool() -> None:
    """Kill the pool (the next use or ``warm_pool`` starts a fresh one)."""
    _POOL.close()


def verify_output(output: str, answer: str, timeout_s: float = 5.0) -> VerifyResult:
    """Grade one output against the reference answer: reward 1.0 when math-verify finds them equal, else 0.0;
    ``verified`` False when it could not be graded."""
    return verify_batch([(output, answer)], timeout_s=timeout_s)[0]


def verify_batch(
    items: Sequence[tuple[str, str]], timeout_s: float = 5.0, worker: Worker = _grade_one
) -> list[VerifyResult]:
    """Grade (output, answer) pairs in the pool; results in input order, never raises.

    ``timeout_s`` is each item's budget of CPU time in its child (see the module notes). An item whose child
    hangs is reported unverified with a timeout cause; its pool is killed and the unfinished items go to a fresh
    pool. ``worker`` must be a picklable module-level function (``_grade_one``; tests pass slow ones).
    """
    results: list[VerifyResult | None] = [_precheck(output, answer, worker) for output, answer in items]
    todo = [i for i, result in enumerate(results) if result is None]
    lost_rounds = 0  # rounds cut short by another thread killing the shared pool
    while todo:
        try:
            generation = _POOL.acquire()
        except Exception as exc:  # noqa: BLE001 - the children could not be started
            _fail(todo, results, f"verifier unavailable: {type(exc).__name__}: {exc}")
            break
        try:
            handles = []
            for i in todo:
                token = next(_TOKENS)
                output, answer = items[i]
                handles.append((i, token, generation.submit(worker, token, output, str(answer), timeout_s)))
        except ValueError:  # "Pool not running": another thread killed it between acquire and submit
            outcome = "lost"
        else:
            todo, outcome = _collect(handles, generation, timeout_s, results, submitted_at=time.monotonic())
        if outcome == "stalled":
            _fail(
                todo, results, f"verifier unavailable: the worker pool started nothing for {_stall_limit(timeout_s):g}s"
            )
            break
        lost_rounds += outcome == "lost"
        if lost_rounds >= MAX_LOST_ROUNDS:
            _fail(todo, results, "verify aborted: the worker pool kept restarting")
            break
    return [result or VerifyResult(0.0, None, "verify error: no result", verified=False) for result in results]


# --- helpers -----------------------------------------------------------------------------------------


def _precheck(output: str, answer: str | None, worker: Worker = _grade_one) -> VerifyResult | None:
    """Results that need no child process."""
    if not isinstance(output, str) or not output.strip():
        return VerifyResult(0.0, None, "empty output")
    if answer is None or not str(answer).strip():
        return VerifyResult(0.0, None, "no reference answer", verified=False)
    return integer_answer(output, str(answer)) if worker is _grade_one else None


_INTEGER = re.compile(r"[+-]?\d+")
_BOXED_INTEGER = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")


def integer_answer(output: str, answer: str) -> VerifyResult | None:
    """The grade math-verify would give, without a child process, in the one case that needs no parsing: an
    integer reference (AIME-style) and an output whose only boxed expression is an integer. Two integers are
    equal or not; everything else (other boxes, several boxes, no box, non-integer answers) goes to math-verify.
    At a thousand rollouts a step this saves ~2 ms of CPU per sample (tests/test_math_domain.py checks the
    agreement)."""
    gold = answer.strip()
    if not _INTEGER.fullmatch(gold) or output.count("\\boxed") != 1 or "\\fbox" in output:
        return None
    match = _BOXED_INTEGER.search(output)
    if match is None:
        return None
    return VerifyResult(1.0 if int(match.group(1)) == int(gold) else 0.0, match.group(1), None)


_NUMBER = re.compile(r"[+-]?\d+(?:[.,]\d+)*(?:/\d+)?")


def last_boxed(output: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = output.rfind("\\boxed{")
    if start < 0:
        return None
    return (boxed_at(output, start) or "").strip() or None


def reply_answer(output: str) -> str | None:
    """A reply's final answer without a grader: its last boxed expression, else its last number (a production
    reply need not box its answer); the answer a refresh takes from a thumbs-up trace."""
    boxed = last_boxed(output)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(output)
    return numbers[-1].rstrip(".,") if numbers else None


def _fail(todo: list[int], results: list[VerifyResult | None], error: str) -> None:
    for i in todo:
        results[i] = VerifyResult(0.0, None, error, verified=False)


def _hang_limit(timeout_s: float) -> float:
    return HANG_FACTOR * timeout_s + DEADLINE_MARGIN_S


def _stall_limit(timeout_s: float) -> float:
    return STARTUP_TIMEOUT_S + _hang_limit(timeout_s)


def _collect(
    handles: list[tuple[int, int, AsyncResult]],
    generation: _Generation,
    timeout_s: float,
    results: list[VerifyResult | None],
    submitted_at: float,
) -> tuple[list[int], str]:
    """Wait for each handle in turn and store its result (``submitted_at``: when the batch went to the pool).

    Returns the items still to grade and how the round ended: 'done'; 'timeout' (an item hung: our pool was
    killed, the rest go to a fresh one); 'lost' (another thread killed the pool); 'stalled' (the pool ran nothing).
    """
    for k, (i, token, handle) in enumerate(handles):
        outcome, waited = _wait(handle, token, generation, timeout_s, submitted_at)
        if outcome == "done":
            results[i] = _result_of(handle)
            generation.forget(token)
            continue
        if outcome == "timeout":
            results[i] = VerifyResult(
                0.0,
                None,
                f"{_TIMEOUT_ERROR}: the worker was still busy {waited:.1f}s after starting the item "
                f"(hang limit {_hang_limit(timeout_s):g}s for a {timeout_s:g}s CPU budget); it was killed",
                verified=False,
            )
            k += 1
        if outcome in ("timeout", "stalled"):
            _POOL.discard(generation)
        # the pool is gone: keep what finished, resubmit the rest
        unfinished = []
        for j, _token, other in handles[k:]:
            if other.ready():
                results[j] = _result_of(other)
            else:
                unfinished.append(j)
        return unfinished, outcome
    # Read the children's start markers even when every item was done before we looked: a marker is written to a
    # pipe for each item, and markers nobody reads fill it (~2,000 items) until the children block writing them
    generation.drain()
    for _, token, _ in handles:
        generation.forget(token)  # markers read just now (their items are done)
    return [], "done"


def _wait(
    handle: AsyncResult, token: int, generation: _Generation, timeout_s: float, submitted_at: float
) -> tuple[str, float]:
    """Wait for one item: ('done', _); ('timeout', seconds it ran) when a child started it more than the hang
    limit ago; ('stalled', _) when it never started and the pool showed no sign of life for the stall limit since
    the batch was submitted (an idle pool's last sign of life is old: idleness is no stall); ('lost', _) when
    another thread killed the pool meanwhile."""
    hang_s = _hang_limit(timeout_s)
    stall_s = _stall_limit(timeout_s)
    while True:
        if handle.ready():
            return "done", 0.0
        if not _POOL.alive(generation):
            return "lost", 0.0
        started = generation.started_at(token)
        now = time.monotonic()
        if started is not None:
            remaining = started + hang_s - now
            if remaining <= 0:
                return "timeout", now - started
        else:
            remaining = max(generation.last_sign_of_life, submitted_at) + stall_s - now
            if remaining <= 0:
                return "stalled", 0.0
        handle.wait(min(_POLL_S, remaining))


def _result_of(handle: AsyncResult) -> VerifyResult:
    try:
        result = handle.get(timeout=0)
    except Exception as exc:  # noqa: BLE001 - the worker raised, or its result could not be pickled
        return VerifyResult(0.0, None, f"verify error: {type(exc).__name__}: {exc}", verified=False)
    if not isinstance(result, VerifyResult):
        return VerifyResult(0.0, None, f"verify error: worker returned {type(result).__name__}", verified=False)
    verified = bool(getattr(result, "verified", True))
    reward = min(1.0, max(0.0, float(result.reward))) if verified else 0.0
    return VerifyResult(reward, result.extracted, result.error, verified=verified)
