"""After a refresh's gate passed: promote the candidate, or first have a person review it change by change.

``review: none``: the candidate is adopted (``clgrpo.refresh.adopt``). ``review: required``: the changes are stored as a
review request and published as a markdown artifact, then

* a deployment run suspends (``suspend_flow_run`` with a form built from the changes, ``clgrpo.refresh.review``): the
  Prefect UI shows the form on the paused run, ``clgrpo review`` answers it from a terminal. Resumed, a worker
  starts the flow again: every stage before this one is read back from DuckDB, the same suspend (same key)
  returns the answers, and the baseline plus the adopted changes is promoted. Not resumed within
  ``review_timeout_s``, Prefect fails the run; the next refresh of the name (or ``clgrpo review``) records the
  refresh as not promoted, "review timed out".
* a run outside a deployment (``clgrpo refresh run``) cannot be suspended: it returns ``awaiting_review`` and
  ``clgrpo review REFRESH_ID`` takes the answers and promotes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.refresh.adopt import adopt
from clgrpo.refresh.promotion import Assessment
from clgrpo.refresh.review import (
    answer_form,
    answers_from,
    changes_between,
    close_review,
    conclude,
    decide_all,
    describe_decision,
    field_name,
    library_at,
    review_sources,
    reviewed_version,
    store_decisions,
    stored_decisions,
    stored_request,
    timed_out,
    timeout_reason,
)
from clgrpo.reports.report import markdown_table
from clgrpo.storage.store import Store
from domains.guard import LessonGuard
from schemas.records import LessonChange, RefreshDecision, RefreshInput, ReviewDecision, ReviewRequest, utcnow
from schemas.refresh_config import RefreshConfig
from schemas.stages import Stage
from tasks.common import artifact_key


def review_key(refresh_id: str) -> str:
    return f"review-{refresh_id}"


def deployment_run_id() -> str | None:
    """This flow run's id when it comes from a deployment (only those can be suspended), else None."""
    from prefect.runtime import deployment, flow_run

    return str(flow_run.id) if deployment.id else None


def lesson_guard(config: RefreshConfig, inputs: list[RefreshInput]) -> LessonGuard:
    """The guard training applied, with the refresh's problems as the texts a lesson may not leak."""
    return LessonGuard(config.training.learning.guard, [i.to_problem() for i in inputs])


# --- the request ---------------------------------------------------------------------------------------------------
def open_request(
    store: Store, config: RefreshConfig, pending: RefreshDecision, baseline: ExperienceLibrary
) -> ReviewRequest:
    """The stored request of this refresh, else a new one (stored)."""
    found = stored_request(store, pending.refresh_id)
    if found is not None:
        return found
    candidate = library_at(store, pending.candidate_ref or "none")
    changes = changes_between(baseline, candidate, **review_sources(store, pending.train_run_id or "", candidate))
    now = utcnow()
    request = ReviewRequest(
        refresh_id=pending.refresh_id,
        name=config.name,
        flow_run_id=deployment_run_id(),
        timeout_s=config.review_timeout_s,
        deadline=now + timedelta(seconds=config.review_timeout_s),
        changes=changes,
        pending=pending,
        config_json=config.model_dump_json(),
        created_at=now,
    )
    store.write_stage(pending.refresh_id, 0, Stage.REVIEW_REQUEST, {ReviewRequest: [request]})
    return request


def _change_markdown(c: LessonChange) -> str:
    lines = [f"### {c.change_id}: {c.op} {c.exp_id}  (form field `{field_name(c)}`)"]
    if c.before is not None:
        lines.append(f"- before: {c.before}")
    if c.proposed is not None:
        lines.append(f"- {'after' if c.before else 'new'}: {c.proposed}")
    if c.source_groups:
        lines.append(f"- from problems: {', '.join(c.source_groups)}")
    lines += [f"- operation: `{o}`" for o in c.origin]
    lines += [f"- evidence: {e}" for e in c.evidence]
    return "\n".join(lines)


def review_markdown(request: ReviewRequest) -> str:
    d = request.pending
    gate = [
        ["refresh", d.refresh_id],
        ["baseline (promoted)", d.baseline_ref],
        ["candidate", d.candidate_ref or "-"],
        ["training run", d.train_run_id or "-"],
        ["evaluation", d.eval_id or "-"],
        [d.metric, f"{d.baseline_value:.3f} -> {d.candidate_value:.3f}"],
        ["gain", f"{d.diff:+.3f}, {d.ci_level:.0%} CI [{d.ci_low:+.3f}, {d.ci_high:+.3f}], margin {d.margin:+.3f}"],
    ]
    changes = "\n\n".join(_change_markdown(c) for c in request.changes)
    return (
        f"# Review {d.refresh_id}: {len(request.changes)} change(s)\n\n"
        f"Answer each change (approve / edit / reject) in the paused run's **Resume** form, or with "
        f"`clgrpo review {d.refresh_id}`, before {request.deadline:%Y-%m-%d %H:%M %Z}.\n\n"
        f"{markdown_table((['', ''], gate))}\n\n"
        + "\n".join(f"- {r}" for r in d.reasons)
        + f"\n\n## Changes\n\n{changes}\n"
    )


async def publish_request(request: ReviewRequest) -> None:
    await acreate_markdown_artifact(
        review_markdown(request),
        key=artifact_key(request.name, "review"),
        description=f"Refresh {request.refresh_id}: changes awaiting review",
    )


# --- after the gate --------------------------------------------------------------------------------------------------
Assess = Callable[[str], Awaitable[Assessment]]  # a reviewed library's ref -> its assessment against the baseline


async def promote(
    config: RefreshConfig,
    pending: RefreshDecision,
    baseline: ExperienceLibrary,
    inputs: list[RefreshInput],
    folder: Path,
    assess: Assess,
) -> RefreshDecision:
    """A candidate that passed the gate: adopted at once, or reviewed first (see the module notes); ``folder``
    holds the served files; ``assess`` evaluates a reviewed library that is not the candidate. Returns the
    decision to record, or an ``awaiting_review`` one (not recorded) for a terminal run."""
    with Store(config.training.db_path) as store:
        if config.review == "none":
            candidate = library_at(store, pending.candidate_ref or "none")
            adopt(
                store,
                config.name,
                folder,
                candidate,
                pending.candidate_ref or "none",
                pending.refresh_id,
                actor="refresh",
                reason="passed the gate (no review required)",
            )
            return pending
        request = open_request(store, config, pending, baseline)
        decided = stored_decisions(store, pending.refresh_id)
    if decided is None and utcnow() >= request.deadline:  # a retried or rerun review past its deadline
        if config.review_after_timeout == "decide":
            return await record_timeout(config, request, folder)
        request = reopen(config, request)
    if decided is None:
        await publish_request(request)
        answers = await _ask(config, request)
        if answers is None:
            return _awaiting(request)
        decided = await _with_fixed_edits(config, request, inputs, answers)
    return await finish_review(config, request, decided, folder, assess)


async def finish_review(
    config: RefreshConfig,
    request: ReviewRequest,
    decisions: list[ReviewDecision],
    folder: Path,
    assess: Assess,
) -> RefreshDecision:
    """Store the answers; when they leave a library other than the candidate (an edit, a rejection), measure it
    like the candidate was and serve it only if it passes the same gate; record the decision; update the review
    artifact with the outcome."""
    with Store(config.training.db_path) as store:
        store_decisions(store, request, decisions)
        served = reviewed_version(store, request, decisions)
    check = await assess(served[1]) if served is not None and not served[2] else None
    with Store(config.training.db_path) as store:
        decision = close_review(store, request, decisions, folder, served, check)
    await publish_outcome(request, decisions, decision)
    get_run_logger().info("refresh %s: review answered, %s", request.refresh_id, decision.status)
    return decision


async def record_timeout(config: RefreshConfig, request: ReviewRequest, folder: Path) -> RefreshDecision:
    """The review's deadline passed unanswered: recorded as timed out (nothing promoted), its problems given
    back to the next refresh when ``release_timed_out``."""
    release = config.release_timed_out
    decisions = timed_out(request.changes, timeout_reason(request, release))
    with Store(config.training.db_path) as store:
        decision = conclude(store, request, decisions, folder, released=release)
    await publish_outcome(request, decisions, decision)
    get_run_logger().info("refresh %s: %s", request.refresh_id, decisions[0].reason)
    return decision


def reopen(config: RefreshConfig, request: ReviewRequest) -> ReviewRequest:
    """The same changes asked again with a new deadline (``review_after_timeout: reopen``); stored."""
    now = utcnow()
    fresh = request.model_copy(
        update={"deadline": now + timedelta(seconds=config.review_timeout_s), "created_at": now,
                "flow_run_id": deployment_run_id()}
    )  # fmt: skip
    with Store(config.training.db_path) as store:
        store.write_stage(request.refresh_id, 0, Stage.REVIEW_REQUEST, {ReviewRequest: [fresh]})
    get_run_logger().info(
        "refresh %s: the review's deadline passed unanswered; asked again until %s",
        request.refresh_id,
        f"{fresh.deadline:%Y-%m-%d %H:%M %Z}",
    )
    return fresh


async def _with_fixed_edits(
    config: RefreshConfig, request: ReviewRequest, inputs: list[RefreshInput], answers: tuple[dict, str]
) -> list[ReviewDecision]:
    """The decisions; an edit the lesson guard refuses is asked again (the form says why) until it passes or is
    answered otherwise, never dropped in silence."""
    check = lesson_guard(config, inputs).check
    by_change, reviewer = answers
    for attempt in range(1, MAX_EDIT_ROUNDS + 1):
        decisions = decide_all(request.changes, by_change, reviewer, check)
        refused = [c for c, d in zip(request.changes, decisions) if d.decision == "refused_edit"]
        if not refused or utcnow() >= request.deadline:
            return decisions
        reasons = {c.change_id: d.reason for c, d in zip(request.changes, decisions) if d.decision == "refused_edit"}
        get_run_logger().info(
            "refresh %s: %d edit(s) refused by the lesson guard, asked again: %s",
            request.refresh_id,
            len(refused),
            "; ".join(f"{k}: {v}" for k, v in reasons.items()),
        )
        again = await _ask(config, request, refused, reasons, round_=attempt)
        if again is None:
            return decisions
        by_change = {**by_change, **again[0]}
    return decide_all(request.changes, by_change, reviewer, check)


MAX_EDIT_ROUNDS = 3


class SuspensionIsNotAnError(logging.Filter):
    """Prefect's async flow engine logs "Finished in state Suspended" at ERROR like a failure; a run waiting for
    its reviewer is expected, so that line is logged at INFO (the UI and the worker's log stop showing an error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(
            ("Finished in state Suspended", "Finished in state Paused")
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_suspension() -> None:
    """Installs ``SuspensionIsNotAnError`` on Prefect's flow-run logger once per process."""
    logger = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, SuspensionIsNotAnError) for f in logger.filters):
        logger.addFilter(SuspensionIsNotAnError())


async def _ask(
    config: RefreshConfig,
    request: ReviewRequest,
    changes: list[LessonChange] | None = None,
    refused: dict[str, str] | None = None,
    *,
    round_: int = 0,
) -> tuple[dict, str] | None:
    """The reviewer's answers: suspends a deployment run until they come (the key names the deadline and the
    round, so a retried run asks afresh instead of reading a spent answer); None outside a deployment."""
    from prefect.flow_runs import asuspend_flow_run
    from prefect.input import RunInput

    if deployment_run_id() is None:
        return None
    changes = changes or request.changes
    left = max(60, int((request.deadline - utcnow()).total_seconds()))
    get_run_logger().info(
        "refresh %s: %d change(s) await review; answer in the UI (Resume) or with `clgrpo review %s` by %s",
        request.refresh_id,
        len(changes),
        request.refresh_id,
        f"{request.deadline:%Y-%m-%d %H:%M %Z}",
    )
    quiet_suspension()
    form = answer_form(changes, base=RunInput, refused=refused)
    key = f"{review_key(request.refresh_id)}-{int(request.deadline.timestamp())}-{round_}"
    filled: Any = await asuspend_flow_run(wait_for_input=form, timeout=left, key=key)
    return answers_from(filled, changes)


def _awaiting(request: ReviewRequest) -> RefreshDecision:
    hint = (
        f"{len(request.changes)} change(s) await review: run `clgrpo review {request.refresh_id}` before "
        f"{request.deadline:%Y-%m-%d %H:%M %Z} (a run outside a deployment cannot be suspended)"
    )
    get_run_logger().info(hint)
    return request.pending.model_copy(update={"status": "awaiting_review", "reasons": [*request.pending.reasons, hint]})


def outcome_markdown(request: ReviewRequest, decisions: list[ReviewDecision], decision: RefreshDecision) -> str:
    lines = [
        f"# Review {request.refresh_id}: answered, {decision.status}",
        "",
        *[f"- {describe_decision(d)}" for d in decisions],
        "",
        *[f"- {r}" for r in decision.reasons],
    ]
    return "\n".join(lines) + "\n"


async def publish_outcome(request: ReviewRequest, decisions: list[ReviewDecision], decision: RefreshDecision) -> None:
    """The review artifact after the answer: what was decided and what is served (it said "awaiting review")."""
    await acreate_markdown_artifact(
        outcome_markdown(request, decisions, decision),
        key=artifact_key(request.name, "review"),
        description=f"Refresh {request.refresh_id}: review answered, {decision.status}",
    )
