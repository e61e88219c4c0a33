"""Stage: checkpoint a step, the last stage of every step and the one place that does it.

A step is done when its checkpoint is stored. The checkpoint exports the library files, computes each live
lesson's usefulness and the library's quality after the step (stored as the stage ``checkpoint``: tables
``experience_stats`` and ``library_quality``), publishes the step's Prefect artifacts (library, operations,
per-step counts, quality) and logs the step's lines. The flow reads what it needs from the store
(``StepCheckpoint``) and writes the stage's rows through ``write``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.experience.quality import describe_quality, library_quality, near_duplicate_counts
from clgrpo.experience.usefulness import describe_stat
from schemas.config import AgentConfig, RunConfig
from schemas.records import (
    ExperienceStat,
    GroupAdvantage,
    LibraryQuality,
    LibraryVersion,
    LLMCall,
    OperationResult,
    OpStatus,
    Proposal,
    Reward,
    Rollout,
    Summary,
)
from schemas.stages import Stage
from tasks.common import artifact_key, stage_task
from tasks.group_advantage import call_failed
from tasks.rationalize import REFUSED, was_refused


@dataclass(frozen=True)
class StepReport:
    run_id: str
    step: int
    epoch: int
    n_problems: int
    accuracy: float  # mean reward over this step's graded rollouts
    rollouts_failed: int
    rollouts_truncated: int  # cut off at max_tokens (graded, marked)
    verify_failed: int  # samples the verifier could not grade (not counted in accuracy)
    groups_total: int
    groups_selected: int
    summaries_failed: int
    proposals_total: int
    proposals_parsed: int
    proposals_failed: int  # unusable replies and failed calls
    proposals_call_failed: int  # of which the learner call itself failed
    operations_proposed: int
    consolidation_failed: bool
    operations_applied: int
    operations_rejected: int
    library_size: int
    llm_calls: int  # calls (a call's retried attempts count once)
    llm_requests: int  # requests sent, retries included: what the endpoint saw
    llm_retries: int
    llm_rate_limited: int  # requests answered 429
    llm_failed: int  # calls that failed after their retries
    tokens_in: int
    tokens_out: int
    cost_usd: float
    tool_calls: int = 0  # agent rollouts: tool calls, and how many returned an error
    tool_errors: int = 0
    model_turns: int = 0  # policy replies of the step's rollouts (one per direct rollout)
    near_duplicates: int = 0  # adds / modifies rejected or merged as near-duplicates of live experiences
    duplicate_ratio: float = 0.0  # near_duplicates / adds and modifies of the plan
    # stage rationalize (counted in proposals_* too: one not kept is a bad proposal in the step table); a reply not
    # kept (the verifier did not accept it) is its expected outcome, not a problem of the step
    rationalizations: int = 0
    rationalizations_kept: int = 0
    rationalizations_call_failed: int = 0  # of rationalizations, calls that failed after their retries
    rationalizations_refused: int = 0  # requests the learner refused (``tasks.rationalize.REFUSED``)
    rationalize_refusal: str = ""  # the first refusal's cause

    def as_row(self) -> dict:
        return asdict(self)


def step_report(
    *,
    run_id: str,
    step: int,
    epoch: int,
    rollouts: list[Rollout],
    rewards: list[Reward],
    advantages: list[GroupAdvantage],
    summaries: list[Summary],
    proposals: list[Proposal],
    consolidation_plans: list[Proposal],
    results: list[OperationResult],
    library_size: int,
    calls: list[LLMCall],
    rationales: Sequence[Proposal] = (),
) -> StepReport:
    """``proposals``: the group proposals; ``rationales``: stage rationalize's, counted with them and apart."""
    near, duplicate_ratio = near_duplicate_counts(results)
    refusals = [p for p in rationales if was_refused(p)]
    proposals = [*proposals, *rationales]
    return StepReport(
        run_id=run_id,
        step=step,
        epoch=epoch,
        n_problems=len({r.problem_id for r in rollouts}),
        accuracy=statistics.fmean(graded) if (graded := [r.reward for r in rewards if r.reward is not None]) else 0.0,
        rollouts_failed=sum(r.error is not None for r in rollouts),
        rollouts_truncated=sum(r.truncated for r in rollouts),
        verify_failed=sum(not r.verified for r in rewards),
        groups_total=len(advantages),
        groups_selected=sum(a.selected for a in advantages),
        summaries_failed=sum(s.error is not None for s in summaries),
        proposals_total=len(proposals),
        proposals_parsed=sum(p.parse_error is None for p in proposals),
        proposals_failed=sum(p.parse_error is not None for p in proposals),
        proposals_call_failed=sum(call_failed(p) for p in proposals),
        operations_proposed=sum(len(p.operations) for p in proposals),
        consolidation_failed=any(p.parse_error for p in consolidation_plans),
        operations_applied=sum(r.status == OpStatus.APPLIED for r in results),
        operations_rejected=sum(r.status == OpStatus.REJECTED for r in results),
        library_size=library_size,
        llm_calls=len({c.call_id or id(c) for c in calls}),
        llm_requests=len(calls),
        llm_retries=sum(c.retries > 0 for c in calls),
        llm_rate_limited=sum(c.rate_limited for c in calls),
        llm_failed=sum(c.final and not c.ok for c in calls),
        tokens_in=sum(c.tokens_in for c in calls),
        tokens_out=sum(c.tokens_out for c in calls),
        cost_usd=round(sum(c.cost_usd for c in calls), 6),
        tool_calls=sum(r.tool_calls for r in rollouts),
        tool_errors=sum(r.tool_errors for r in rollouts),
        model_turns=sum(r.n_turns for r in rollouts),
        near_duplicates=near,
        duplicate_ratio=duplicate_ratio,
        rationalizations=len(rationales),
        rationalizations_kept=sum(p.parse_error is None for p in rationales),
        rationalizations_call_failed=sum(call_failed(p) for p in rationales),
        rationalizations_refused=len(refusals),
        rationalize_refusal=(refusals[0].parse_error or "").removeprefix(REFUSED) if refusals else "",
    )


def step_problems(report: StepReport, agent: AgentConfig | None = None) -> list[str]:
    """What went wrong in a stored step, for a WARNING line: failures, retries, unusable learner replies."""
    not_kept = report.rationalizations - report.rationalizations_kept - report.rationalizations_call_failed
    group_calls_failed = report.proposals_call_failed - report.rationalizations_call_failed
    found = [
        (report.rollouts_failed, "policy samples failed"),
        (report.verify_failed, "samples could not be verified"),
        (report.rollouts_truncated, "replies were cut off at max_tokens (graded, marked)"),
        (report.summaries_failed, "summaries failed"),
        (group_calls_failed, "learner calls for group proposals failed"),
        (report.proposals_failed - report.proposals_call_failed - not_kept, "group proposals were unusable replies"),
        (report.rationalizations_call_failed, "learner calls for rationalizations failed"),
        (
            report.rationalizations_refused,
            f"rationalizations not made: the learner refused the request ({report.rationalize_refusal}); "
            "learning.examples: rollouts takes worked examples from the rollouts alone",
        ),
        (report.llm_retries, "requests were retries"),
        (report.llm_rate_limited, "requests were rate limited (429)"),
    ]
    problems = [f"{n} {what}" for n, what in found if n]
    if report.consolidation_failed:
        problems.append("the consolidation reply was unusable: no operations")
    elif report.operations_proposed and not (report.operations_applied or report.operations_rejected):
        problems.append(
            f"the consolidation plan kept none of the {report.operations_proposed} proposed operations "
            f"(the learner's decision; learning.consolidation: passthrough applies the group proposals)"
        )
    if agent is not None and report.tool_calls == 0 and report.model_turns:
        hint = (
            "the endpoint may ignore `tools` (some local servers accept and drop them): try "
            "rollout.agent.protocol: text"
            if agent.protocol != "text"
            else "the model wrote no action"
        )
        problems.append(f"agent mode, but no rollout called a tool: {hint}")
    group_proposals = report.proposals_total - report.rationalizations
    if report.groups_selected and report.proposals_parsed - report.rationalizations_kept == 0:
        learned = "no lesson" if report.rationalizations_kept else "nothing"
        problems.append(f"all {group_proposals} group proposals failed: this step learned {learned}")
    return problems


ARTIFACT_ROWS = 200  # a Prefect artifact past ~1 MB is refused: the rest is in DuckDB (`clgrpo library ops`)


def operations_markdown(step: int, results: list[OperationResult]) -> str:
    lines = [
        f"## Operations of step {step}",
        "",
        "| # | op | ids | text | status | reason | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results[:ARTIFACT_ROWS]:
        op = r.operation
        text = (op.text or "").replace("|", "\\|")
        lines.append(
            f"| {r.seq} | {op.op.value} | {', '.join(op.target_ids)} | {text} | {r.status.value} "
            f"| {r.reason} | {r.result_id or ''} |"
        )
    if not results:
        lines.append("| | (no operations this step) | | | | | |")
    if len(results) > ARTIFACT_ROWS:
        lines.append(
            f"\n... and {len(results) - ARTIFACT_ROWS} more operations "
            f"({sum(r.status == OpStatus.REJECTED for r in results[ARTIFACT_ROWS:])} rejected): "
            "`clgrpo library ops RUN --step N` lists them all"
        )
    return "\n".join(lines)


def library_table(library: ExperienceLibrary, stats: Sequence[ExperienceStat] = ()) -> list[dict]:
    """The library artifact's rows, with each lesson's usefulness when ``stats`` has it."""
    usefulness = {s.exp_id: describe_stat(s) for s in stats}
    return [
        {
            "id": e.id,
            "text": e.text,
            "created_step": e.created_step,
            "updated_step": e.updated_step,
            "parents": ", ".join(e.parent_ids),
            "sources": ", ".join(e.source_groups),
            "domain": e.domain_tag or "",
            "usefulness": usefulness.get(e.id, ""),
        }
        for e in library
    ]


def export_dir(config: RunConfig) -> Path:
    return Path(config.db_path).resolve().parent / config.require_run_id()


def export_library(library: ExperienceLibrary, directory: Path) -> list[Path]:
    """``library_v{N}.json`` (reference format) and ``library_latest.json``/``.txt``."""
    return [
        library.dump(directory / f"library_v{library.version}.json"),
        library.dump(directory / "library_latest.json"),
        library.dump(directory / "library_latest.txt", fmt="text"),
    ]


@stage_task(Stage.CHECKPOINT, run_name="checkpoint-step{step}")
def checkpoint_task(config: RunConfig, step: int, library: LibraryVersion) -> list[str]:
    paths = export_library(ExperienceLibrary.from_version(library), export_dir(config))
    return [str(p) for p in paths]


@dataclass(frozen=True)
class StepCheckpoint:
    """What the checkpoint of a stored step reads (the flow reads it from the store)."""

    config: RunConfig
    step: int
    epoch: int
    library: ExperienceLibrary  # after the step
    previous: ExperienceLibrary  # before it
    stats: list[ExperienceStat]  # usefulness and confidence of the live lessons, this step's citations counted
    operations: list[OperationResult]
    summaries: list[Summary]
    reports: list[StepReport]  # the steps of this run so far, this one last


async def checkpoint_step(
    ck: StepCheckpoint,
    *,
    write: Callable[[dict[type, Sequence[Any]]], object],
    quality_history: Callable[[], list[LibraryQuality]],
    log: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Export, artifacts, the stage's rows (through ``write``), the quality artifact (``quality_history``: every
    version's quality once written) and the step's log lines."""
    run_id, step, library = ck.config.require_run_id(), ck.step, ck.library
    paths = checkpoint_task(ck.config, step, library.to_version())
    await acreate_table_artifact(
        library_table(library, ck.stats) or [{"id": "", "text": "(empty library)"}],
        key=artifact_key(run_id, "library"),
        description=f"Library after step {step} (version {library.version})",
    )
    await acreate_markdown_artifact(
        operations_markdown(step, ck.operations),
        key=artifact_key(run_id, "operations"),
        description=f"Operations applied and rejected at step {step}",
    )
    await acreate_table_artifact(
        [r.as_row() for r in ck.reports],
        key=artifact_key(run_id, "counts"),
        description="Per-step counts: groups, proposals, operations, tokens, cost",
    )
    quality = library_quality(ck.previous, library, ck.stats, ck.operations, ck.summaries)
    write({ExperienceStat: ck.stats, LibraryQuality: [quality]})
    await acreate_table_artifact(
        [q.model_dump() for q in quality_history()],
        key=artifact_key(run_id, "quality"),
        description="Library quality per version: size, tokens, duplicates, confidence, coverage, churn",
    )
    log.info("step %d: %s", step, describe_quality(quality, usefulness=ck.config.learning.summarize))
    log_step(ck, paths[0], log)


def log_step(ck: StepCheckpoint, exported: str, log: logging.Logger | logging.LoggerAdapter) -> None:
    """The step's summary line, and a WARNING line with what went wrong in it."""
    report = ck.reports[-1]
    log.info(
        "step %d (epoch %d): accuracy %.3f, groups %d/%d selected, proposals %d parsed / %d failed, "
        "operations %d applied / %d rejected, library %d, %d calls (%d requests), tokens %d in / %d out, "
        "cost $%.4f; exported %s",
        ck.step,
        ck.epoch + 1,
        report.accuracy,
        report.groups_selected,
        report.groups_total,
        report.proposals_parsed,
        report.proposals_failed,
        report.operations_applied,
        report.operations_rejected,
        report.library_size,
        report.llm_calls,
        report.llm_requests,
        report.tokens_in,
        report.tokens_out,
        report.cost_usd,
        exported,
    )
    if problems := step_problems(report, agent=ck.config.rollout.agent_settings()):
        log.warning("step %d: %s (details: clgrpo report %s)", ck.step, "; ".join(problems), ck.config.run_id)
