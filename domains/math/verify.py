"""Answer checking with Hugging Face math-verify, run in a small pool of spawned child processes.

math-verify enforces its time limits with ``signal.alarm``, which works only in a process's main thread, while
the pipeline grades from worker threads. Grading therefore runs in child processes (a pool worker runs its tasks
in its main thread, so the alarms work there). The parent adds a hard deadline as a backstop: when an awaited
item is unfinished and the pool has completed nothing for ``timeout_s`` + a margin, the children are taken to be
hung; the pool is killed (rebuilt on next use) and the item scores 0. Measuring from the pool's last completion,
not from submission, keeps items queued behind other threads' work from counting as hung.
Nothing here raises to the caller.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import AsyncResult, Pool

from domains.base import VerifyResult

Worker = Callable[[str, str, float], VerifyResult]

POOL_PROCESSES = 2
DEADLINE_MARGIN_S = 2.0  # parent-side slack over timeout_s before the children count as hung
STARTUP_TIMEOUT_S = 60.0  # spawning the children and importing math-verify
MAX_LOST_ROUNDS = 3  # a batch gives up after its pool was killed this often by other threads' timeouts
GOLD_PARSE_TIMEOUT_S = 1  # reference answers are short
_POLL_S = 0.05


# --- child side --------------------------------------------------------------------------------------


def _warm_up() -> None:
    """Pool initializer: import math-verify and load its LaTeX parser before the first real item."""
    from math_verify import parse, verify

    verify(parse("\\boxed{1}"), parse("1"))


def _grade_one(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Grade one output in a child process; math-verify's own alarms bound each step."""
    from math_verify import parse, verify

    step_s = max(1, int(timeout_s / 2))  # parsing the output and comparing share the budget
    try:
        predicted = parse(output, parsing_timeout=step_s)
        if not predicted:
            return VerifyResult(0.0, None, "no answer found")
        extracted = str(predicted[1] if len(predicted) > 1 else predicted[0])
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=GOLD_PARSE_TIMEOUT_S)
        if not gold:
            return VerifyResult(0.0, extracted, f"cannot parse the reference answer {answer!r}")
        correct = verify(gold, predicted, timeout_seconds=step_s)
        return VerifyResult(1.0 if correct else 0.0, extracted, None)
    except Exception as exc:  # math-verify swallows most errors itself; this is the backstop
        return VerifyResult(0.0, None, f"verify error: {type(exc).__name__}: {exc}")


# --- the shared pool ---------------------------------------------------------------------------------


class _PoolHolder:
    """The lazily started pool. A generation number tells waiters when their pool was replaced;
    ``last_progress`` is when the current pool last finished an item (or started)."""

    def __init__(self, processes: int) -> None:
        self._processes = processes
        self._lock = threading.Lock()
        self._pool: Pool | None = None
        self._generation = 0
        self.last_progress = time.monotonic()

    def acquire(self) -> tuple[Pool, int]:
        with self._lock:
            if self._pool is None:
                self._pool = self._start()
                self._generation += 1
                self.last_progress = time.monotonic()
            return self._pool, self._generation

    def submit(self, pool: Pool, worker: Worker, args: tuple[str, str, float]) -> AsyncResult:
        return pool.apply_async(worker, args, callback=self._progressed, error_callback=self._progressed)

    def alive(self, generation: int) -> bool:
        return self._pool is not None and self._generation == generation

    def discard(self, generation: int) -> None:
        """Kill the pool of this generation (no-op when another thread already did)."""
        with self._lock:
            if self._pool is not None and self._generation == generation:
                self._pool.terminate()
                self._pool = None

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None

    def _progressed(self, _result: object) -> None:
        self.last_progress = time.monotonic()

    def _start(self) -> Pool:
        with _unimportable_main_hidden():
            pool = multiprocessing.get_context("spawn").Pool(processes=self._processes, initializer=_warm_up)
        try:
            pool.apply_async(time.monotonic).get(timeout=STARTUP_TIMEOUT_S)  # a child is up and warmed
        except BaseException:
            pool.terminate()
            raise
        return pool


@contextmanager
def _unimportable_main_hidden() -> Iterator[None]:
    """Spawned children re-import the parent's main script; when it is no file (``python - <script``) they
    would die at start-up, so hide its path while the children are created (the workers never need it)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = getattr(main, "__spec__", None) is None and path is not None and not os.path.isfile(path)
    if hide:
        del main.__file__
    try:
        yield
    finally:
        if hide:
            main.__file__ = path


_POOL = _PoolHolder(POOL_PROCESSES)
atexit.register(_POOL.close)


# --- public API --------------------------------------------------------------------------------------


def verify(output: str, answer: str, timeout_s: float = 5.0) -> VerifyResult:
    """Grade one output against the reference answer: reward 1.0 when math-verify finds them equal, else 0.0."""
    return verify_batch([(output, answer)], timeout_s=timeout_s)[0]


def verify_batch(
    items: Sequence[tuple[str, str]], timeout_s: float = 5.0, worker: Worker = _grade_one
) -> list[VerifyResult]:
    """Grade (output, answer) pairs in the pool; results in input order.

    An item whose children overrun (see the module notes) scores 0 with a timeout error; its pool is killed
    and the unfinished items go to a fresh pool. ``worker`` must be a picklable module-level function
    (``_grade_one``; tests pass slow ones).
    """
    results: list[VerifyResult | None] = [_precheck(output, answer) for output, answer in items]
    todo = [i for i, result in enumerate(results) if result is None]
    lost_rounds = 0  # rounds cut short by another thread killing the shared pool
    while todo:
        try:
            pool, generation = _POOL.acquire()
        except Exception as exc:  # the children could not be started
            _fail(todo, results, f"verifier unavailable: {type(exc).__name__}: {exc}")
            break
        try:
            handles = [(i, _POOL.submit(pool, worker, (items[i][0], str(items[i][1]), timeout_s))) for i in todo]
        except ValueError:  # "Pool not running": another thread killed it between acquire and submit
            lost = True
        else:
            todo, lost = _collect(handles, generation, timeout_s, results)
        lost_rounds += lost
        if lost_rounds >= MAX_LOST_ROUNDS:
            _fail(todo, results, "verify aborted: the worker pool kept restarting")
            break
    return [result or VerifyResult(0.0, None, "verify error: no result") for result in results]


# --- helpers -----------------------------------------------------------------------------------------


def _precheck(output: str, answer: str | None) -> VerifyResult | None:
    """Results that need no child process."""
    if not isinstance(output, str) or not output.strip():
        return VerifyResult(0.0, None, "empty output")
    if answer is None or not str(answer).strip():
        return VerifyResult(0.0, None, "no reference answer")
    return None


def _fail(todo: list[int], results: list[VerifyResult | None], error: str) -> None:
    for i in todo:
        results[i] = VerifyResult(0.0, None, error)


def _collect(
    handles: list[tuple[int, AsyncResult]], generation: int, timeout_s: float, results: list[VerifyResult | None]
) -> tuple[list[int], bool]:
    """Wait for each handle in turn and store its result.

    Returns the items to submit again, and whether the pool was lost to another thread (not to our own timeout).
    """
    for k, (i, handle) in enumerate(handles):
        outcome = _wait(handle, generation, timeout_s + DEADLINE_MARGIN_S)
        if outcome == "done":
            results[i] = _result_of(handle)
            continue
        if outcome == "timeout":
            results[i] = VerifyResult(0.0, None, f"verify timeout after {timeout_s:g}s")
            _POOL.discard(generation)
            k += 1
        # the pool is gone: keep what finished, resubmit the rest
        unfinished = []
        for j, other in handles[k:]:
            if other.ready():
                results[j] = _result_of(other)
            else:
                unfinished.append(j)
        return unfinished, outcome == "lost"
    return [], False


def _wait(handle: AsyncResult, generation: int, limit_s: float) -> str:
    """'done'; 'timeout' when neither this item nor any other finished for ``limit_s``; or 'lost' when another
    thread killed the pool meanwhile."""
    started = time.monotonic()
    while True:
        if handle.ready():
            return "done"
        if not _POOL.alive(generation):
            return "lost"
        remaining = max(started, _POOL.last_progress) + limit_s - time.monotonic()
        if remaining <= 0:
            return "timeout"
        handle.wait(min(_POLL_S, remaining))


def _result_of(handle: AsyncResult) -> VerifyResult:
    try:
        result = handle.get(timeout=0)
    except Exception as exc:  # the worker raised, or its result could not be pickled
        return VerifyResult(0.0, None, f"verify error: {type(exc).__name__}: {exc}")
    if not isinstance(result, VerifyResult):
        return VerifyResult(0.0, None, f"verify error: worker returned {type(result).__name__}")
    return VerifyResult(min(1.0, max(0.0, float(result.reward))), result.extracted, result.error)
