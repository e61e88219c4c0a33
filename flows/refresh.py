"""The nightly experience refresh: learn from the problems that arrived since the last refresh and promote
the new library only when it is measurably better.

One refresh per (name, date): the date of the run's scheduled start (or ``as_of``) in ``config.timezone``
is its idempotency key, ``<name>-<date>``. A refresh

1. takes the new problems: those of the source that arrived up to the cutoff and that no decided refresh
   took before (oldest first, at most ``max_problems``), stored in DuckDB before any training, so a resumed
   refresh trains on exactly the same problems;
2. starts from the latest library promoted by an earlier date (else ``initial_library``, else empty) and
   runs the training flow for ``steps`` steps as a subflow (run id ``<refresh_id>-train``);
3. evaluates the promoted library (baseline) against the trained one on the held-out set with the
   evaluation flow (paired samples, eval id ``<refresh_id>-eval``);
4. promotes only if the lower bound of the gain's confidence interval is above ``margin`` and no task tag of
   the held-out set regressed (``clgrpo.refresh.promotion``: a tag's CI wholly below ``-tag_margin``; the gate's rows in
   table ``refresh_gate``) (with ``review: required``, only the changes a person approves, see
   ``flows.refresh_review``), and records the decision with its reasons (table ``refreshes``). No new problems:
   nothing is trained and that is recorded. A promotion is a new version of the served files
   (``promoted.json``...), kept in ``backups/`` for a rollback (``clgrpo.refresh.adopt``).

A decided date is never run again (its decision is returned); a failed refresh is resumed by retrying its
flow run or running the same date again: stored stages, the training run and the evaluation are read back.
The training and evaluation subflows open the DuckDB file themselves, so this flow closes it before each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.process import stopping
from clgrpo.process.runtime import tune_gc
from clgrpo.refresh.adopt import adoptions
from clgrpo.refresh.promotion import Assessment, Promotion, failing_summary, gate_table, overall_passes, promotion_gate
from clgrpo.refresh.review import (
    ReviewError,
    ReviewPendingError,
    answers_from,
    decide_all,
    library_at,
    settle_expired,
    stored_request,
)
from clgrpo.refresh.sources import read_arrivals, select_new, select_traces, trace_notes
from clgrpo.reports.report import markdown_table
from clgrpo.storage.run_lock import RunLock
from clgrpo.storage.state import remember_db
from clgrpo.storage.store import Store
from domains import domain_for
from flows.evaluate import NO_LIBRARY, EvalOutcome, evaluate
from flows.refresh_review import finish_review, lesson_guard, promote
from flows.stages import StageRunner
from flows.train import train
from schemas.config import BlockedLesson, DatasetConfig, RunConfig
from schemas.records import (
    EvalComparison,
    RefreshDecision,
    RefreshGateRow,
    RefreshInput,
    RefreshReject,
    RefreshWatermark,
    ReviewDecision,
)
from schemas.refresh_config import RefreshConfig
from schemas.stages import Stage
from tasks.common import artifact_key
from tasks.outputs import Selected
from tasks.preflight import check_refresh

METRIC_LABELS = {"mean_at_k": "Mean@k", "pass_at_k": "Pass@k"}


@dataclass(frozen=True)
class Baseline:
    ref: str  # as the evaluation flow resolves it: "none", a file, or RUN_ID:VERSION
    library: ExperienceLibrary


# --- identity -------------------------------------------------------------------------------------------
def refresh_cutoff(config: RefreshConfig, as_of: datetime | None) -> datetime:
    """``as_of`` (without a zone: in the refresh's timezone), else the flow run's scheduled start (stable
    across retries), else now."""
    if as_of is not None:
        return as_of if as_of.tzinfo else as_of.replace(tzinfo=ZoneInfo(config.timezone))
    from prefect.runtime import flow_run

    return datetime.fromisoformat(flow_run.scheduled_start_time.isoformat())


def refresh_date(config: RefreshConfig, cutoff: datetime) -> str:
    return cutoff.astimezone(ZoneInfo(config.timezone)).date().isoformat()


def work_dir(config: RefreshConfig) -> Path:
    return Path(config.work_dir) if config.work_dir else Path(config.training.db_path).parent / "refresh" / config.name


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters
    config = params["config"]
    config = config if isinstance(config, RefreshConfig) else RefreshConfig.model_validate(config)
    as_of = params.get("as_of")
    as_of = datetime.fromisoformat(as_of) if isinstance(as_of, str) else as_of
    return f"refresh-{config.name}-{refresh_date(config, refresh_cutoff(config, as_of))}"


# --- the decision (pure) --------------------------------------------------------------------------------
def overall_verdict(comparison: EvalComparison, margin: float) -> tuple[bool, str]:
    """The overall rule: the lower bound of the gain's CI above the margin; the reason says which way and why.
    (The per-tag gate comes on top: ``clgrpo.refresh.promotion``.)"""
    label = METRIC_LABELS[comparison.metric]
    measured = (
        f"{label} {comparison.baseline_value:.3f} -> {comparison.candidate_value:.3f} on "
        f"{comparison.n_problems} held-out problems: gain {comparison.diff:+.3f}, "
        f"{comparison.ci_level:.0%} CI [{comparison.ci_low:+.3f}, {comparison.ci_high:+.3f}]"
    )
    if overall_passes(comparison, margin):
        return True, f"{measured}; its lower bound is above the margin {margin:+.3f}"
    return False, f"{measured}; its lower bound is not above the margin {margin:+.3f}"


def decision_record(
    config: RefreshConfig,
    refresh_id: str,
    date: str,
    cutoff: datetime,
    n_new: int,
    baseline: Baseline,
    **fields: object,
) -> RefreshDecision:
    return RefreshDecision(
        refresh_id=refresh_id,
        name=config.name,
        refresh_date=date,
        cutoff=cutoff,
        n_new_problems=n_new,
        baseline_ref=baseline.ref,
        metric=config.metric,
        margin=config.margin,
        **fields,
    )


# --- state in DuckDB --------------------------------------------------------------------------------------
def stored_decision(store: Store, refresh_id: str) -> RefreshDecision | None:
    if not store.stage_done(refresh_id, 0, Stage.REFRESH_DECIDE):
        return None
    return store.records(RefreshDecision, refresh_id, 0, Stage.REFRESH_DECIDE)[0]


def promoted_baseline(store: Store, config: RefreshConfig, before_date: str, refresh_id: str = "") -> Baseline:
    """The library served now (the latest promotion or rollback by another refresh, ``clgrpo.refresh.adopt``); in a
    database without adoptions, the latest library promoted by a refresh of an earlier date; else the initial
    library or none."""
    served = [a for a in adoptions(store, config.name) if a.refresh_id != refresh_id]
    if served:
        return Baseline(served[-1].library_ref, library_at(store, served[-1].library_ref))
    promoted = [d for d in store.refresh_decisions(config.name) if d.promoted and d.refresh_date < before_date]
    if promoted and promoted[-1].candidate_ref:
        run_id, _, version = promoted[-1].candidate_ref.partition(":")
        return Baseline(promoted[-1].candidate_ref, store.load_library(run_id, int(version)))
    if config.initial_library:
        return Baseline(config.initial_library, ExperienceLibrary.load(config.initial_library))
    return Baseline(NO_LIBRARY, ExperienceLibrary())


async def take_new_problems(store: Store, config: RefreshConfig, refresh_id: str, cutoff: datetime) -> Selected:
    """The problems this refresh trains on (stage ``refresh-select``, read back when taken before): those of the
    source that arrived up to ``cutoff`` and that no decided refresh took."""
    source = config.source
    same_file = source.kind != "directory" and Path(source.path).resolve() == store.path.resolve()
    if source.kind == "traces":  # rows after the previous decided refresh's watermark; bad rows skipped
        taken = select_traces(
            source,
            domain_for(config.training),
            cutoff,
            store.consumed_problem_keys(config.name),
            store.refresh_watermark(config.name),
            name=config.name,
            max_problems=config.max_problems,
            reported=store.reported_rejects(config.name),
            query=store.query if same_file else None,
        )
        get_run_logger().info(taken.message(cutoff))
        return Selected.from_rows(taken.stage_rows())
    arrivals = read_arrivals(
        source,
        domain_for(config.training),
        cutoff,
        work_dir(config) / refresh_id,
        query=store.query if same_file else None,
    )
    selection = select_new(
        arrivals, store.consumed_problem_keys(config.name), name=config.name, max_problems=config.max_problems
    )
    get_run_logger().info(selection.message(cutoff))
    return Selected(selection.inputs)


def settle_reviews(store: Store, config: RefreshConfig, refresh_id: str) -> None:
    """Earlier refreshes of this name whose review timed out are decided (not promoted); one still waiting for
    its review stops this refresh (run it again once that review is answered or timed out)."""
    settled, waiting = settle_expired(
        store,
        config.name,
        datetime.now(ZoneInfo("UTC")),
        work_dir(config),
        refresh_id,
        release=config.release_timed_out,
    )
    for decision in settled:
        get_run_logger().info("refresh %s: %s", decision.refresh_id, decision.reasons[-1])
    if waiting:
        w = waiting[0]
        raise ReviewPendingError(
            f"refresh {w.refresh_id} still waits for its review (until {w.deadline:%Y-%m-%d %H:%M %Z}): answer it "
            f"in the Prefect UI or with `clgrpo review {w.refresh_id}`, then run this refresh again"
        )


# --- files for the subflows --------------------------------------------------------------------------------
def input_notes(store: Store, refresh_id: str) -> list[str]:
    """What the decision reports about its input beyond the count: a traces source's skipped rows and redactions."""
    watermarks = store.records(RefreshWatermark, refresh_id, 0, Stage.REFRESH_SELECT)
    return trace_notes(
        store.records(RefreshReject, refresh_id, 0, Stage.REFRESH_SELECT), watermarks[0] if watermarks else None
    )


def write_dataset(inputs: list[RefreshInput], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i in inputs:
            fh.write(
                json.dumps(
                    {
                        "id": i.problem_id,
                        "problem": i.problem,
                        "answer": i.answer,
                        "tag": i.tag,
                        "answer_source": i.answer_source,
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    return path


def training_config(
    config: RefreshConfig, refresh_id: str, dataset: Path, start: Path, blocked: list[BlockedLesson] | None = None
) -> RunConfig:
    """The refresh's training run: the template with its run id, dataset, starting library, steps and the lessons
    reviewers rejected lately (``blocked``: not learned again)."""
    template = config.training
    seed = template.dataset.seed if template.dataset else template.seed
    traces = config.source.kind == "traces"  # some traces have an answer (from feedback), some none
    has_answers = traces or config.source.answer_field is not None
    return RunConfig.model_validate(
        {
            **template.model_dump(exclude={"dataset"}),
            "run_id": f"{refresh_id}-train",
            "dataset": DatasetConfig(
                path=str(dataset),
                answer_field="answer" if has_answers else None,
                seed=seed,
                answers_optional=traces,
                answer_source_field="answer_source" if traces else None,
            ),
            "initial_library": str(start),
            "grpo": template.grpo.model_copy(update={"max_steps": config.steps}),
            "learning": template.learning.model_copy(
                update={"blocked": [*template.learning.blocked, *(blocked or [])]}
            ),
        }
    )


def blocked_notes(config: RefreshConfig, run_id: str, remembered: int) -> list[str]:
    """How many proposals repeated a lesson a reviewer rejected (not learned again), for the decision."""
    if not remembered:
        return []
    with Store(config.training.db_path) as store:
        repeats = [
            r
            for _, r in store.operation_results(run_id)
            if r.reason.startswith(("rejected before: rejected in review", "near a lesson rejected before"))
        ]
    return [
        f"{len(repeats)} proposal(s) repeated one of the {remembered} lesson(s) reviewers rejected in the last "
        f"{config.remember_rejected_nights} nights: not learned again"
    ]


def rejected_in_review(store: Store, config: RefreshConfig, date: str) -> list[BlockedLesson]:
    """The lessons reviewers of ``config.name`` rejected in the ``remember_rejected_nights`` nights before
    ``date``, each with who rejected it, why and until when it is remembered."""
    nights = config.remember_rejected_nights
    if nights == 0:
        return []
    today = datetime.fromisoformat(date).date()
    blocked = []
    for decision in store.refresh_decisions(config.name):
        day = datetime.fromisoformat(decision.refresh_date).date()
        if not 0 < (today - day).days <= nights:
            continue
        until = (day + timedelta(days=nights)).isoformat()
        for d in store.records(ReviewDecision, decision.refresh_id):
            if d.decision == "reject" and d.proposed:
                why = f": {d.reason}" if d.reason else ""
                blocked.append(
                    BlockedLesson(
                        text=d.proposed,
                        reason=f"rejected in review of {decision.refresh_id} by {d.reviewer}{why} "
                        f"(remembered until {until})",
                    )
                )
    return blocked


# --- reporting ----------------------------------------------------------------------------------------------
def decision_markdown(decision: RefreshDecision, gate: list[RefreshGateRow] | None = None) -> str:
    rows = [
        ["refresh", decision.refresh_id],
        ["status", decision.status],
        ["new problems", str(decision.n_new_problems)],
        ["started from", decision.baseline_ref],
        ["candidate", decision.candidate_ref or "-"],
        ["training run", decision.train_run_id or "-"],
        ["evaluation", decision.eval_id or "-"],
    ]
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    text = f"# Refresh {decision.refresh_id}: {decision.status}\n\n{markdown_table((['', ''], rows))}\n\n{reasons}\n"
    if gate:
        text += f"\n## Promotion gate ({METRIC_LABELS[gate[0].metric]}, overall and per task tag)\n\n"
        text += markdown_table(gate_table(gate)) + "\n"
    return text


def stored_gate(store: Store, decision: RefreshDecision) -> list[RefreshGateRow]:
    """The gate rows of the library a refresh's decision measured: the candidate, or the reviewed library
    (stored under ``<refresh_id>-served``) when a review changed it; none when nothing was evaluated."""
    if decision.eval_id is None:
        return []
    served = f"{decision.refresh_id}-served"
    return store.records(
        RefreshGateRow, served if decision.eval_id == served else decision.refresh_id, 0, Stage.REFRESH_GATE
    )


async def publish(store: Store, decision: RefreshDecision) -> None:
    gate = stored_gate(store, decision)
    await acreate_markdown_artifact(
        decision_markdown(decision, gate),
        key=artifact_key(decision.name, "refresh"),
        description=f"Refresh {decision.refresh_id}: {decision.status}",
    )
    if gate:
        headers, body = gate_table(gate)
        await acreate_table_artifact(
            [dict(zip(headers, row)) for row in body],
            key=artifact_key(decision.name, "refresh-gate"),
            description=f"Refresh {decision.refresh_id}: the promotion gate, overall and per task tag",
        )
    gates = store.refresh_gates(decision.name)
    history = [
        {
            "date": d.refresh_date,
            "status": d.status,
            "new problems": d.n_new_problems,
            "library": d.candidate_ref if d.promoted else d.baseline_ref,
            "gain": "" if d.diff is None else f"{d.diff:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}]",
            "failing tags": failing_summary(gates.get(d.refresh_id, [])),
        }
        for d in store.refresh_decisions(decision.name)
    ]
    await acreate_table_artifact(
        history,
        key=artifact_key(decision.name, "refresh-history"),
        description=f"Refreshes of {decision.name!r}: decisions and gains",
    )


async def record(config: RefreshConfig, decision: RefreshDecision) -> RefreshDecision:
    with Store(config.training.db_path) as store:
        if not store.stage_done(decision.refresh_id, 0, Stage.REFRESH_DECIDE):  # a concluded review stored it
            store.write_stage(decision.refresh_id, 0, Stage.REFRESH_DECIDE, {RefreshDecision: [decision]})
        await publish(store, decision)
    log = get_run_logger()
    log.info("refresh %s: %s", decision.refresh_id, decision.status)
    for reason in decision.reasons:
        log.info("  %s", reason)
    return decision


def record_gate(config: RefreshConfig, refresh_id: str, outcome: EvalOutcome) -> Promotion:
    """The promotion gate over the evaluation's comparisons, stored as its own stage before the decision."""
    gate = promotion_gate(refresh_id, outcome.comparisons, config)
    with Store(config.training.db_path) as store:
        store.write_stage(refresh_id, 0, Stage.REFRESH_GATE, {RefreshGateRow: gate.rows})
    return gate


# --- the flow -------------------------------------------------------------------------------------------
async def train_and_compare(
    config: RefreshConfig, refresh_id: str, date: str, inputs: list[RefreshInput], baseline: Baseline
) -> dict[str, object]:
    """Train from the baseline on the new problems, then evaluate baseline vs candidate: decision fields."""
    folder = work_dir(config) / refresh_id
    dataset = write_dataset(inputs, folder / "new-problems.jsonl")
    start = baseline.library.dump(folder / "start.seed.json", "seed")  # keeps ids and the next id
    with Store(config.training.db_path) as store:
        blocked = rejected_in_review(store, config, date)
    run_config = training_config(config, refresh_id, dataset, start, blocked)
    trained = await train(run_config)
    candidate_ref = f"{trained.run_id}:{trained.final_version}"
    with Store(config.training.db_path) as store:
        candidate = store.load_library(trained.run_id, trained.final_version)
    fields: dict[str, object] = {"candidate_ref": candidate_ref, "train_run_id": trained.run_id}
    repeats = blocked_notes(config, trained.run_id, len(blocked))
    if trained.stopped:  # a budget stopped training early: never promote a half-trained library
        return {**fields, "status": "not_promoted", "reasons": [f"training stopped early: {trained.stopped}", *repeats]}
    if candidate.content_hash() == baseline.library.content_hash():
        return {
            **fields,
            "status": "not_promoted",
            "reasons": [f"training ran {len(trained.steps)} step(s) and left the library unchanged", *repeats],
        }
    assessment = await assess_library(
        config, run_config, baseline.ref, candidate_ref, eval_id=f"{refresh_id}-eval", gate_id=refresh_id
    )
    reasons = [
        f"trained {len(trained.steps)} step(s) on {len(inputs)} new problem(s): library "
        f"{len(baseline.library)} -> {len(candidate)} experiences",
        *repeats,
        *assessment.reasons,
    ]
    status = "promoted" if assessment.passed else "not_promoted"
    return {**fields, **assessment.fields, "status": status, "reasons": reasons}


async def assess_library(
    config: RefreshConfig, run_config: RunConfig, baseline_ref: str, library_ref: str, *, eval_id: str, gate_id: str
) -> Assessment:
    """Evaluate ``library_ref`` against ``baseline_ref`` (evaluation ``eval_id``), then the overall rule and the
    per-tag gate (its rows stored under ``gate_id``); failed samples and leaks said."""
    outcome: EvalOutcome = await evaluate(
        run_config, config.evaluation, [baseline_ref, library_ref], eval_id=eval_id, train_dataset=run_config.dataset
    )
    comparison = next(c for c in outcome.overall if c.metric == config.metric)
    passes, reason = overall_verdict(comparison, config.margin)
    gate = record_gate(config, gate_id, outcome)
    reasons = [reason, *gate.reasons()]
    if failed := sum(s.n_failed for s in outcome.summaries):
        reasons.append(f"{failed} evaluation sample(s) failed (scored 0); see evaluation {outcome.eval_id}")
    if any(s.leaked_ids for s in outcome.summaries):
        reasons.append(outcome.leakage)
    numbers = ("baseline_value", "candidate_value", "diff", "ci_low", "ci_high", "ci_level")
    fields = {"eval_id": outcome.eval_id, **{name: getattr(comparison, name) for name in numbers}}
    return Assessment(passes and gate.tags_pass, reasons, fields)


async def assess_served(config: RefreshConfig, pending: RefreshDecision, served_ref: str) -> Assessment:
    """A reviewed library that is not the candidate, assessed as the candidate was: the same held-out set,
    sampling and seeds against the same baseline, the same overall rule and per-tag gate (rows stored under
    ``<refresh_id>-served``)."""
    refresh_id = pending.refresh_id
    folder = work_dir(config) / refresh_id
    run_config = training_config(config, refresh_id, folder / "new-problems.jsonl", folder / "start.seed.json")
    served_id = f"{refresh_id}-served"
    assessment = await assess_library(
        config, run_config, pending.baseline_ref, served_ref, eval_id=served_id, gate_id=served_id
    )
    first, *rest = assessment.reasons
    return Assessment(
        passed=assessment.passed,
        reasons=[f"the reviewed library as served ({served_ref}): {first}", *rest],
        fields=assessment.fields,
    )


@flow(
    name="refresh",
    flow_run_name=_flow_run_name,
    persist_result=True,
    log_prints=True,
    on_crashed=[stopping.cancelled_not_crashed],
)
async def refresh(config: RefreshConfig, as_of: datetime | None = None) -> RefreshDecision:
    """Nightly experience refresh of ``config.name`` for the date of ``as_of`` (default: this run's
    scheduled start) in ``config.timezone``."""
    tune_gc()
    return await stopping.flow_body(partial(_refresh, config, as_of))


async def _refresh(config: RefreshConfig, as_of: datetime | None) -> RefreshDecision:
    log = get_run_logger()
    check_refresh(config)
    remember_db(config.training.db_path)  # later commands find a deployment run's database as a CLI run's
    cutoff = refresh_cutoff(config, as_of)
    date = refresh_date(config, cutoff)
    refresh_id = f"{config.name}-{date}"
    with RunLock(config.training.db_path, "refresh", config.name):  # one live refresh per name and database
        with Store(config.training.db_path) as store:
            decided = stored_decision(store, refresh_id)
            if decided is not None:
                log.info(
                    "refresh %s was already decided at %s: %s (nothing to do)",
                    refresh_id,
                    decided.decided_at.isoformat(),
                    decided.status,
                )
                return decided
            settle_reviews(store, config, refresh_id)
            baseline = promoted_baseline(store, config, date, refresh_id)
            take = partial(take_new_problems, store, config, refresh_id, cutoff)
            where = f"{refresh_id} {Stage.REFRESH_SELECT}"  # none arrived in files: not stored, a rerun looks again
            stages = StageRunner(store, refresh_id, log)
            inputs = (
                await stages.run(0, Stage.REFRESH_SELECT, Selected, take, where=where, keep_empty=False)
            ).refresh_inputs
            notes = input_notes(store, refresh_id)
        log.info("refresh %s starts from %s (%d experiences)", refresh_id, baseline.ref, len(baseline.library))
        if not inputs:
            reason = f"no new problems arrived in {config.source.path} up to {cutoff.isoformat()}: nothing trained"
            log.info(reason)
            return await record(
                config,
                decision_record(
                    config, refresh_id, date, cutoff, 0, baseline, status="no_new_data", reasons=[reason, *notes]
                ),
            )
        fields = await train_and_compare(config, refresh_id, date, inputs, baseline)
        reasons = fields["reasons"]
        assert isinstance(reasons, list), "train_and_compare gives a list of reasons"
        fields["reasons"] = [*reasons, *notes]
        decision = decision_record(config, refresh_id, date, cutoff, len(inputs), baseline, **fields)
        if decision.promoted:
            assess = partial(assess_served, config, decision)
            decision = await promote(config, decision, baseline.library, inputs, work_dir(config), assess)
        if decision.status == "awaiting_review":
            return decision
        return await record(config, decision)


# --- a review answered from a terminal ------------------------------------------------------------------------------
@flow(name="review", flow_run_name="review-{refresh_id}", log_prints=True)
async def apply_review(config: RefreshConfig, refresh_id: str, form: dict[str, Any]) -> RefreshDecision:
    """The answers of ``clgrpo review`` for a refresh run outside a deployment (or one whose run is gone):
    decided, measured when they leave a library other than the candidate, promoted or not, recorded. Edits the
    lesson guard refuses were caught by the command before this runs."""
    with Store(config.training.db_path) as store:
        request = stored_request(store, refresh_id)
        inputs = store.records(RefreshInput, refresh_id)
    if request is None:
        raise ReviewError(f"no review requested by refresh {refresh_id!r}")
    answers, reviewer = answers_from(form, request.changes)
    decisions = decide_all(request.changes, answers, reviewer, lesson_guard(config, inputs).check)
    assess = partial(assess_served, config, request.pending)
    return await finish_review(config, request, decisions, work_dir(config), assess)
