"""What the in-process backends (transformers, vLLM) share.

An ``Engine`` owns one loaded model and one worker thread. Requests queue up; the thread takes the waiting
ones (up to ``max_rows`` sequences: a request with ``n=G`` is G rows) and runs them in one batched call, so
the G samples of a problem, and the problems of a rollout stage sent together, share one ``generate``. Only
that thread touches the model, so calls on one model are serialised whatever the event loops or threads
the callers run in. A caller that stops waiting (the client's timeout) cancels its queued request.

Engines live in a per-process registry keyed by what was loaded (path, device, dtype): the policy and the
learner on the same weights share one loaded model. Retries, concurrency limits and accounting stay in the
LLM client; a batch function only reports each request's result or error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from clgrpo.llm.backends import Generation, GenRequest, PermanentLLMError, TransientLLMError
from clgrpo.process import stopping

log = logging.getLogger(__name__)

Result = Generation | BaseException
BatchFn = Callable[[Any, list[GenRequest]], list[Result]]  # (loaded model, requests) -> one result per request

GATHER_S = 0.02  # after the first request arrives, wait this long for requests sent at the same time


@dataclass
class EngineStats:
    batches: int = 0
    requests: int = 0
    rows: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    generate_s: float = 0.0
    load_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_out / self.generate_s if self.generate_s else 0.0


@dataclass(frozen=True)
class BatchReport:
    """One batched call, for progress displays (``Engine.on_batch``)."""

    requests: int
    rows: int
    tokens_out: int
    seconds: float


@dataclass
class _Job:
    request: GenRequest
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    def __init__(
        self,
        name: str,
        load: Callable[[], Any],
        run_batch: BatchFn,
        max_rows: int,
        rows_for: Callable[[Any], int] | None = None,
    ) -> None:
        """``max_rows``: sequences per batch; ``rows_for``: when given, the loaded model decides it instead
        (e.g. from the GPU memory left after loading)."""
        self.name = name
        self.max_rows = max_rows
        self._rows_for = rows_for
        self.stats = EngineStats()
        self.on_batch: Callable[[BatchReport], None] | None = None  # called from the worker thread
        self._load_fn = load
        self._run_batch = run_batch
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._thread: threading.Thread | None = None

    # --- callers --------------------------------------------------------------------------------------
    def load(self) -> Any:
        """Load the model now (idempotent, thread-safe); the worker also loads it on first use."""
        with self._load_lock:
            if self._model is None:
                t0 = time.monotonic()
                self._model = self._load_fn()
                self.stats.load_s = time.monotonic() - t0
                if self._rows_for is not None:
                    self.max_rows = self._rows_for(self._model)
                log.info(
                    "%s: loaded in %.1f s, up to %d sequences per batch", self.name, self.stats.load_s, self.max_rows
                )
            return self._model

    def unload(self) -> None:
        """Drop the loaded model (a batch running now finishes with it); the next request loads it again."""
        with self._load_lock:
            self._model = None

    async def generate(self, request: GenRequest) -> Generation:
        job = _Job(request)
        with self._cond:
            self._queue.append(job)
            self._ensure_thread()
            self._cond.notify()
        return await asyncio.wrap_future(job.future)  # cancelling the await cancels the queued job

    # --- the worker thread ----------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name=f"clgrpo-engine-{self.name}", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
            time.sleep(GATHER_S)
            model, failed = self._loaded()  # before taking a batch: its size may depend on the loaded model
            jobs = [j for j in self._take() if j.future.set_running_or_notify_cancel()]
            if jobs and stopping.stopping():  # a stop signal: hand out no new generation
                failed = RuntimeError(f"{self.name}: not generated, a stop signal arrived")
            for job in jobs if failed is not None else []:
                job.future.set_exception(failed)
            if jobs and failed is None:
                self._run(model, jobs)

    def _loaded(self) -> tuple[Any, BaseException | None]:
        """The model, or the error every waiting request gets: a missing or broken model fails permanently."""
        try:
            return self.load(), None
        except Exception as exc:  # noqa: BLE001 - reported to each request
            if isinstance(exc, PermanentLLMError):
                return None, exc
            return None, PermanentLLMError(f"{self.name}: loading failed: {exc}")

    def _take(self) -> list[_Job]:
        """The oldest waiting jobs that fit in ``max_rows`` sequences (always at least one)."""
        with self._cond:
            taken: list[_Job] = []
            rows = 0
            while self._queue and (not taken or rows + self._queue[0].request.n <= self.max_rows):
                job = self._queue.pop(0)
                taken.append(job)
                rows += job.request.n
            return taken

    def _run(self, model: Any, jobs: list[_Job]) -> None:
        results = self._batch(model, [j.request for j in jobs])
        if (
            len(jobs) > 1
            and any(isinstance(r, PermanentLLMError) for r in results)
            and all(isinstance(r, BaseException) for r in results)
        ):
            results = [self._batch(model, [j.request])[0] for j in jobs]  # one bad request must not fail the rest
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

    def _batch(self, model: Any, requests: list[GenRequest]) -> list[Result]:
        t0 = time.monotonic()
        try:
            results = self._run_batch(model, requests)
        except Exception as exc:  # noqa: BLE001 - the batch's failure is each request's (classify: retry or not)
            return [classify(exc)] * len(requests)
        self._account(requests, results, time.monotonic() - t0)
        return results

    def _account(self, requests: list[GenRequest], results: list[Result], seconds: float) -> None:
        done = [r for r in results if isinstance(r, Generation)]
        report = BatchReport(len(requests), sum(q.n for q in requests), sum(r.tokens_out for r in done), seconds)
        s = self.stats
        s.batches += 1
        s.requests += len(done)
        s.rows += sum(len(r.texts) for r in done)
        s.tokens_in += sum(r.tokens_in for r in done)
        s.tokens_out += report.tokens_out
        s.generate_s += seconds
        log.debug("%s: %s", self.name, report)
        if self.on_batch is not None:
            try:
                self.on_batch(report)
            except Exception:  # a display must not stop the engine
                log.exception("%s: on_batch callback failed", self.name)


def classify(exc: BaseException) -> BaseException:
    """Out of memory is worth a retry (the next batch may be smaller); anything else is permanent."""
    if isinstance(exc, (TransientLLMError, PermanentLLMError)):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError":
        return TransientLLMError(text)
    return PermanentLLMError(text)


# --- the registry ----------------------------------------------------------------------------------------

_ENGINES: dict[Hashable, Engine] = {}
_REGISTRY_LOCK = threading.Lock()


def get_engine(key: Hashable, factory: Callable[[], Engine]) -> Engine:
    with _REGISTRY_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = factory()
        return _ENGINES[key]


def release_engines(drop: Callable[[Hashable], bool]) -> int:
    """Remove the engines whose key ``drop`` selects from the registry and free their models (a client still
    holding one loads it again on its next request): how a training run with per-step adapters keeps one
    adapted copy of the policy, not one per step. The number released."""
    with _REGISTRY_LOCK:
        dropped = [(key, engine) for key, engine in _ENGINES.items() if drop(key)]
        for key, _ in dropped:
            del _ENGINES[key]
    for _, engine in dropped:
        engine.unload()
    return len(dropped)


def loaded_engines() -> list[Engine]:
    with _REGISTRY_LOCK:
        return list(_ENGINES.values())


def forget_engines() -> None:
    """Drop the registry (tests); worker threads of dropped engines idle on their empty queues."""
    with _REGISTRY_LOCK:
        _ENGINES.clear()
