"""What the benchmark scripts share: an isolated Prefect, run configs against the latency server, instrumentation
(DuckDB timers, a sampler of the event-loop thread, peak RSS) and the figures of one training run.

Import this module before anything that imports Prefect: it points Prefect at a fresh temporary home.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="clgrpo-bench-prefect-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from critical_path import limits  # noqa: E402
from latency_server import Collected, LatencyModel, LatencyServerProcess  # noqa: E402

from clgrpo.storage.store import Store  # noqa: E402
from clgrpo.testing.scripted_llm import FAMILIES, make_problems, write_jsonl  # noqa: E402
from flows import train as train_module  # noqa: E402
from schemas.config import (  # noqa: E402
    AgentConfig,
    DatasetConfig,
    GRPOConfig,
    LearningConfig,
    LessonValidation,
    LibraryGate,
    ModelConfig,
    RolloutPlacement,
    RunConfig,
    SandboxConfig,
)


@contextmanager
def prefect_harness() -> Iterator[None]:
    """A throw-away Prefect API (temporary database) for the benchmark process."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# --- run specification ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    n_problems: int = 100
    group_size: int = 5
    concurrency: int = 64
    pipeline: bool = True
    batch_size: int | None = None  # None: all problems in one step
    rollout_chunk_size: int = 16
    supports_n: bool = False  # False: G separate policy calls per problem (like DeepSeek's API)
    seed: int = 0
    latency_seed: int = 0  # the server's latency draws (replies do not depend on it)
    mode: str = "direct"  # rollout.mode; "agent": ReAct rollouts with the domain's tools (python sandbox)
    max_turns: int = 6  # agent mode: rollout.agent.max_turns
    protocol: str = "auto"  # agent mode: rollout.agent.protocol
    pool_size: int = 16  # agent mode: rollout.agent.sandbox.pool_size (interpreters alive at once)
    spares: int = 2  # agent mode: rollout.agent.sandbox.spares
    checks: str = "default"  # "default": the product's; "off": no library gate; "trials": lesson trials on too

    @property
    def design(self) -> str:
        return "pipelined" if self.pipeline else "barrier"


CHECKS = {
    "default": LearningConfig(),
    "off": LearningConfig(library_gate=LibraryGate(enabled=False)),
    "trials": LearningConfig(lesson_validation=LessonValidation(enabled=True)),
}


def make_config(spec: RunSpec, base_url: str, workdir: Path, run_id: str) -> RunConfig:
    per_family = math.ceil(spec.n_problems * 1.1 / len(FAMILIES)) + 1  # the loader drops rare duplicates
    dataset = write_jsonl(make_problems(per_family, seed=spec.seed), workdir / f"problems-{spec.n_problems}.jsonl")
    model = ModelConfig(
        model="scripted",
        base_url=base_url,
        api_key_env=None,
        max_tokens=512,
        timeout_s=120,
        supports_n=spec.supports_n,
        seed=spec.seed,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(workdir / f"{run_id}.duckdb"),
        dataset=DatasetConfig(path=str(dataset), limit=spec.n_problems, seed=spec.seed),
        policy=model,
        grpo=GRPOConfig(
            group_size=spec.group_size,
            epochs=1,
            batch_size=spec.batch_size or spec.n_problems,
            rollout_chunk_size=spec.rollout_chunk_size,
        ),
        concurrency=spec.concurrency,
        pipeline=spec.pipeline,
        seed=spec.seed,
        learning=CHECKS[spec.checks],
        rollout=RolloutPlacement(
            mode=spec.mode,
            agent=AgentConfig(
                max_turns=spec.max_turns,
                protocol=spec.protocol,
                sandbox=SandboxConfig(pool_size=spec.pool_size, spares=spec.spares),
            ),
        ),
    )


# --- instrumentation --------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """Wall time inside the store (DuckDB + pandera validation) and the step windows, from the flow's side."""

    store_s: float = 0.0
    steps: list[tuple[float, float]] = field(default_factory=list)  # (start, end) monotonic, run_step..checkpoint
    loop_thread: int | None = None
    _depth: int = 0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.store_s += time.perf_counter() - t0

        return wrapper

    @contextmanager
    def installed(self) -> Iterator["Probe"]:
        trainer = train_module.Trainer
        originals: dict[tuple[type, str], Any] = {}

        def patch(owner: type, name: str, replacement: Any) -> None:
            originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, replacement)

        for name in (
            "write_stage",
            "records",
            "stage_done",
            "save_library",
            "load_library",
            "library_versions",
            "register_run",
            "query",
        ):
            patch(Store, name, self.timed(getattr(Store, name)))
        run_step, checkpoint = trainer.run_step, trainer.checkpoint
        probe = self

        async def timed_step(self_: Any, planned: Any, library: Any) -> Any:
            probe.loop_thread = threading.get_ident()
            probe.steps.append((time.monotonic(), math.nan))
            return await run_step(self_, planned, library)

        async def timed_checkpoint(self_: Any, *args: Any) -> Any:
            try:
                return await checkpoint(self_, *args)
            finally:
                start, _ = probe.steps[-1]
                probe.steps[-1] = (start, time.monotonic())

        patch(trainer, "run_step", timed_step)
        patch(trainer, "checkpoint", timed_checkpoint)
        try:
            yield self
        finally:
            for (owner, name), original in originals.items():
                setattr(owner, name, original)


_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "duckdb",
        (
            "/duckdb/",
            "/pandera/",
            "/pandas/",
            "/clgrpo/storage/store.py",
            "/clgrpo/storage/connection.py",
            "/schemas/tables.py",
            "/schemas/catalog.py",
        ),
    ),
    (
        "llm client",
        ("/openai/", "/httpx/", "/httpcore/", "/anyio/", "/h11/", "/aiohttp/", "/multidict/", "/yarl/", "/clgrpo/llm/"),
    ),
    ("prefect", ("/prefect/", "/tasks/common.py", "/cloudpickle/")),
    ("verify", ("/domains/math/verify.py",)),
    (
        "sandbox",
        (
            "/clgrpo/sandbox/pool.py",
            "/clgrpo/sandbox/isolation.py",
            "/asyncio/unix_events.py",
            "/asyncio/base_subprocess.py",
            "/subprocess.py",
        ),
    ),
    ("pipeline", (f"{ROOT}/tasks/", f"{ROOT}/flows/", f"{ROOT}/domains/", f"{ROOT}/clgrpo/")),
)


def classify(frame: Any) -> str:
    """The category of what a thread is doing: 'idle' when its event loop waits in select, else the innermost
    frame that belongs to a known package (pydantic, asyncio and the stdlib are looked through)."""
    if frame.f_code.co_name in ("select", "poll") and frame.f_code.co_filename.endswith("selectors.py"):
        return "idle"
    while frame is not None:
        path = frame.f_code.co_filename
        for category, needles in _CATEGORIES:
            if any(n in path for n in needles):
                return category
        frame = frame.f_back
    return "other"


class LoopSampler:
    """Samples the event-loop thread's stack every ``interval_s`` (a statistical profile of where the flow's
    process spends the time it is not waiting for the LLM)."""

    def __init__(self, probe: Probe, interval_s: float = 0.005) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.counts: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            ident = self.probe.loop_thread
            if ident is None or not self._in_step():
                continue
            frame = sys._current_frames().get(ident)
            if frame is not None:
                self.counts[classify(frame)] += 1

    def _in_step(self) -> bool:
        return bool(self.probe.steps) and math.isnan(self.probe.steps[-1][1])

    def shares(self) -> dict[str, float]:
        total = sum(self.counts.values()) or 1
        return {k: v / total for k, v in self.counts.items()}

    def __enter__(self) -> "LoopSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end, lo), min(stop, hi)
        if stop > start:
            total += stop - start
            end = stop
    return total


def mean_in_flight(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    busy = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)
    return busy / (hi - lo) if hi > lo else 0.0


# --- one run ------------------------------------------------------------------------------------------------------


def stage_calls(cfg: RunConfig) -> dict[str, dict[str, int]]:
    with Store(cfg.db_path, read_only=True) as store:
        frame = store.query(
            "SELECT stage, count(*) AS calls, sum(tokens_in) AS tokens_in, "
            "sum(tokens_out) AS tokens_out FROM llm_calls WHERE run_id = ? GROUP BY stage "
            "ORDER BY min(started_at)",
            [cfg.run_id],
        )
    return {
        row["stage"]: {k: int(row[k]) for k in ("calls", "tokens_in", "tokens_out")}
        for row in frame.to_dict(orient="records")
    }


def run_once(
    spec: RunSpec, server: LatencyServerProcess, workdir: Path, run_id: str, critical_path: bool = True
) -> dict[str, Any]:
    """One training run (one epoch) against the latency server, with its figures."""
    server.reset(spec.latency_seed)
    load_before = os.getloadavg()[0]
    cfg = make_config(spec, server.base_url, workdir, run_id)
    probe = Probe()
    cpu0 = time.process_time()
    with ExitStack() as stack:
        stack.enter_context(probe.installed())
        sampler = stack.enter_context(LoopSampler(probe))
        t0 = time.monotonic()
        asyncio.run(train_module.train(cfg))
        t1 = time.monotonic()
    cpu = time.process_time() - cpu0
    served = server.collect()
    steps_s = sum(end - start for start, end in probe.steps)
    lo, hi = probe.steps[0][0], probe.steps[-1][1]
    intervals = [(e.started + served.clock_offset_s, e.ended + served.clock_offset_s) for e in served.log]
    llm_busy = union_length(intervals, lo, hi)
    shares = sampler.shares()
    figures: dict[str, Any] = {
        "design": spec.design,
        "n_problems": spec.n_problems,
        "group_size": spec.group_size,
        "concurrency": spec.concurrency,
        "steps": len(probe.steps),
        "flow_wall_s": t1 - t0,
        "step_wall_s": steps_s,
        "llm_busy_s": llm_busy,
        "outside_llm_s": steps_s - llm_busy,
        "store_s": probe.store_s,
        "cpu_s": cpu,
        "loop_busy_share": 1.0 - shares.get("idle", 0.0),
        "loop_prefect_s": shares.get("prefect", 0.0) * steps_s,
        "loop_shares": shares,
        "server_max_in_flight": served.max_in_flight,
        "server_mean_in_flight": mean_in_flight(intervals, lo, hi),
        "llm_calls": len(served.log),
        "median_latency_s": statistics.median(r.service_s for r in served.records) if served.records else 0.0,
        "peak_rss_mib": peak_rss_mib(),
        "load_avg_1m": (load_before, os.getloadavg()[0]),  # other work on the machine during the run
        "per_stage": stage_calls(cfg),
    }
    if critical_path:
        figures.update(critical_figures(served, spec, steps_s))
    return figures


def critical_figures(served: Collected, spec: RunSpec, wall_s: float) -> dict[str, float]:
    bound = limits(served.records, spec.concurrency)
    own = bound.pipelined_s if spec.pipeline else bound.barrier_s
    return {
        "cp_barrier_s": bound.barrier_s,
        "cp_pipelined_s": bound.pipelined_s,
        "cp_lower_bound_s": bound.lower_bound_s,
        "cp_chain_s": bound.chain_s,
        "ratio_own": wall_s / own,
        "ratio_ideal": wall_s / bound.pipelined_s,
    }


# --- aggregation and tables --------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(stats: dict[str, float], digits: int = 2) -> str:
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def machine() -> str:
    import platform

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    )


def start_server(model: LatencyModel, supports_n: bool) -> LatencyServerProcess:
    return LatencyServerProcess(model, supports_n=supports_n)
