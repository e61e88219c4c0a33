"""Lesson-by-lesson human review of a refresh's candidate library (``RefreshConfig.review: required``).

The candidate's changes to the promoted library (``clgrpo.experience.library.diff``) become ``LessonChange``s: an added,
modified or deleted lesson with its source (the training operations that made it, their problems) and its
evidence (validation trials, citation statistics). A reviewer answers each with approve, edit (new text) or
reject and a reason. ``apply_answers`` builds the library to promote: the baseline plus the approved and edited
changes only, ids kept (the candidate's next id too, so a rejected lesson's id is never reused); an edit the
lesson guard refuses is recorded as ``refused_edit`` and not adopted.

Prefect-free: the flow (``flows.refresh_review``) builds its suspend form from ``answer_form`` and the
``clgrpo review`` command uses the same model for terminal answers and ``--decisions`` files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from clgrpo.experience.library import ExperienceLibrary, describe_operation, diff, item_text, normalize_text
from clgrpo.experience.usefulness import describe_stat
from clgrpo.experience.usefulness import measured as usefulness_measured
from clgrpo.refresh.adopt import adopt
from clgrpo.refresh.promotion import Assessment
from clgrpo.storage.connection import StoreError
from clgrpo.storage.store import Store, parse_library_ref
from schemas.records import (
    Experience,
    ExperienceStat,
    LessonChange,
    LessonTrial,
    LibraryVersion,
    OperationResult,
    OpStatus,
    RefreshDecision,
    ReviewDecision,
    ReviewRequest,
    utcnow,
)
from schemas.stages import Stage

Choice = Literal["approve", "edit", "reject"]
Check = Callable[[str, Sequence[str]], str | None]  # (text, source groups) -> the guard's refusal, or None
CHOICE_HELP = "approve: adopt as proposed; edit: adopt with the text below; reject: leave the library as it was"


class ReviewError(ValueError):
    """Answers that do not fit the changes (a missing or unknown change, no reviewer)."""


class ChangeAnswer(BaseModel):
    """A reviewer's answer for one change."""

    model_config = ConfigDict(extra="forbid")
    decision: Choice
    text: str = ""  # the new lesson text, for edit
    reason: str = ""


# --- candidate -> changes -----------------------------------------------------------------------------------
def _touches(r: OperationResult, exp_id: str) -> bool:
    return r.status == OpStatus.APPLIED and (r.result_id == exp_id or exp_id in r.operation.target_ids)


def _trial_lines(trials: Iterable[tuple[int, LessonTrial]], exp_id: str, text: str | None) -> list[str]:
    key = normalize_text(text) if text else None
    lines = []
    for step, t in trials:
        same_text = key is not None and t.operation.text and normalize_text(t.operation.text) == key
        if same_text or (not t.operation.text and exp_id in t.operation.target_ids):
            gain = "" if t.gain is None else f": {t.mean_without:.2f} -> {t.mean_with:.2f} (gain {t.gain:+.2f})"
            lines.append(
                f"step {step} validation {t.verdict} on {t.pairs} pair(s){gain}" + (f"; {t.reason}" if t.reason else "")
            )
    return lines


def _change(
    n: int,
    op: Literal["add", "modify", "delete"],
    exp_id: str,
    before: Experience | None,
    after: Experience | None,
    operations: Sequence[tuple[int, OperationResult]],
    trials: Sequence[tuple[int, LessonTrial]],
    stats: Mapping[str, ExperienceStat],
) -> LessonChange:
    made_by = [(step, r) for step, r in operations if _touches(r, exp_id)]
    groups = dict.fromkeys(g for _, r in made_by for g in r.operation.source_groups)
    groups.update(dict.fromkeys(after.source_groups if after else ()))
    evidence = _trial_lines(trials, exp_id, after.text if after else None)
    if exp_id in stats and op != "delete":
        evidence.append(f"in training: {describe_stat(stats[exp_id])}")
    return LessonChange(
        change_id=f"c{n}",
        op=op,
        exp_id=exp_id,
        before=item_text(before) if before else None,  # an example: its problem, provenance and solution
        proposed=item_text(after) if after else None,
        source_groups=list(groups),
        origin=[describe_operation(step, r).strip() for step, r in made_by],
        evidence=evidence,
    )


def changes_between(
    baseline: ExperienceLibrary,
    candidate: ExperienceLibrary,
    operations: Sequence[tuple[int, OperationResult]] = (),
    trials: Sequence[tuple[int, LessonTrial]] = (),
    stats: Mapping[str, ExperienceStat] | None = None,
) -> list[LessonChange]:
    """Every change from ``baseline`` to ``candidate`` (adds, then modifies, then deletes), numbered c1, c2..."""
    d, stats = diff(baseline, candidate), stats or {}
    found: list[tuple[Literal["add", "modify", "delete"], str, Experience | None, Experience | None]] = [
        *(("add", e.id, None, e) for e in d.added),
        *(("modify", old.id, old, new) for old, new in d.modified),
        *(("delete", e.id, e, None) for e in d.removed),
    ]
    return [
        _change(n, op, exp_id, before, after, operations, trials, stats)
        for n, (op, exp_id, before, after) in enumerate(found, start=1)
    ]


# --- the answer form ------------------------------------------------------------------------------------------
def field_name(change: LessonChange) -> str:
    """The form field of a change: ``c1_add_E7``."""
    return f"{change.change_id}_{change.op}_{change.exp_id}"


def change_title(change: LessonChange) -> str:
    return f"{change.change_id}: {change.op} {change.exp_id}"


def change_summary(change: LessonChange) -> str:
    if change.op == "add":
        return f"new lesson: {change.proposed}"
    if change.op == "delete":
        return f"delete lesson: {change.before}"
    return f"before: {change.before} | after: {change.proposed}"


def _answer_model(change: LessonChange, refusal: str | None = None) -> type[BaseModel]:
    """A change's own answer model, so its form group can carry the change's text as the edit default (and, for
    an edit the lesson guard refused, why: the reviewer answers again)."""
    edit_help = "the lesson as it will read if you choose edit"
    if refusal:
        edit_help = f"YOUR EDIT WAS REFUSED ({refusal}); write another text, or approve or reject"
    return create_model(
        f"Change_{change.change_id}",
        __base__=ChangeAnswer,
        decision=(Choice, Field(title="Decision", description=CHOICE_HELP)),
        text=(str, Field(change.proposed or "", title="Lesson text (for edit)", description=edit_help)),
        reason=(str, Field("", title="Reason", description="why (stored with the decision)")),
    )


def answer_form(
    changes: Sequence[LessonChange], base: type[BaseModel] = BaseModel, refused: Mapping[str, str] | None = None
) -> type[BaseModel]:
    """The review form: one group per change (titled with its id and op) and the reviewer's name; ``refused``:
    change id -> why its edit was refused (shown with it)."""
    refused = refused or {}
    fields: dict[str, Any] = {
        field_name(c): (
            _answer_model(c, refused.get(c.change_id)),
            Field(title=change_title(c), description=change_summary(c)),
        )
        for c in changes
    }
    fields["reviewer"] = (
        str,
        Field(title="Reviewer", description="your name, stored with every decision", min_length=1),
    )
    return create_model("LessonReview", __base__=base, **fields)


def answers_from(
    form: BaseModel | Mapping[str, Any], changes: Sequence[LessonChange]
) -> tuple[dict[str, ChangeAnswer], str]:
    """Answers by change id and the reviewer, from a filled form or a dict (``--decisions`` file); a dict may key
    changes by their id (``c1``) or form field (``c1_add_E7``)."""
    data = form.model_dump() if isinstance(form, BaseModel) else dict(form)
    reviewer = str(data.get("reviewer") or "").strip()
    if not reviewer:
        raise ReviewError("the review names no reviewer")
    answers, missing = {}, []
    for c in changes:
        raw = data.get(field_name(c), data.get(c.change_id))
        if raw is None:
            missing.append(c.change_id)
            continue
        try:
            answers[c.change_id] = ChangeAnswer.model_validate(raw)
        except ValidationError as exc:
            raise ReviewError(f"change {c.change_id}: {exc.errors()[0]['msg']}") from None
    known = {field_name(c) for c in changes} | {c.change_id for c in changes} | {"reviewer"}
    unknown = sorted(set(data) - known)
    if missing or unknown:
        raise ReviewError(
            "the answers do not fit the changes: "
            + "; ".join(
                ([f"no answer for {', '.join(missing)}"] if missing else [])
                + ([f"unknown change(s) {', '.join(unknown)}"] if unknown else [])
            )
        )
    return answers, reviewer


def uniform_answers(
    changes: Sequence[LessonChange], choice: Literal["approve", "reject"], reviewer: str, reason: str
) -> dict[str, Any]:
    """Every change answered alike (``--approve-all`` / ``--reject-all``), as form data."""
    return {**{field_name(c): {"decision": choice, "reason": reason} for c in changes}, "reviewer": reviewer}


# --- answers -> library and decision rows ----------------------------------------------------------------------
def _decide(change: LessonChange, answer: ChangeAnswer, reviewer: str, check: Check) -> ReviewDecision:
    base = {
        "change_id": change.change_id,
        "op": change.op,
        "exp_id": change.exp_id,
        "before": change.before,
        "proposed": change.proposed,
        "reviewer": reviewer,
        "reason": answer.reason,
    }
    if answer.decision == "reject":
        return ReviewDecision(**base, decision="reject", adopted=False, after=change.before)
    if answer.decision == "approve":
        return ReviewDecision(**base, decision="approve", adopted=True, after=change.proposed)
    text = " ".join(answer.text.split())
    refusal = (
        "a deleted lesson has no text to edit: approve or reject the delete"
        if change.op == "delete"
        else "the edited text is empty"
        if not text
        else check(text, change.source_groups)
    )
    if refusal:
        return ReviewDecision(
            **{**base, "reason": f"edit refused by the lesson guard: {refusal}"},
            decision="refused_edit",
            adopted=False,
            after=change.before,
        )
    return ReviewDecision(**base, decision="edit", adopted=True, after=text)


def decide_all(
    changes: Sequence[LessonChange], answers: Mapping[str, ChangeAnswer], reviewer: str, check: Check
) -> list[ReviewDecision]:
    return [_decide(c, answers[c.change_id], reviewer, check) for c in changes]


def timed_out(changes: Sequence[LessonChange], reason: str) -> list[ReviewDecision]:
    """The rows of a review nobody answered in time: nothing adopted."""
    return [
        ReviewDecision(
            change_id=c.change_id,
            op=c.op,
            exp_id=c.exp_id,
            before=c.before,
            proposed=c.proposed,
            after=c.before,
            decision="timed_out",
            adopted=False,
            reason=reason,
            reviewer="nobody",
        )
        for c in changes
    ]


def reviewed_library(
    baseline: ExperienceLibrary, candidate: ExperienceLibrary, decisions: Sequence[ReviewDecision]
) -> ExperienceLibrary:
    """The baseline with the adopted changes applied; ids as in the candidate, its next id kept."""
    lessons = dict(baseline.by_id)
    retired = set(baseline.retired_ids)
    for d in decisions:
        if not d.adopted:
            continue
        if d.op == "delete":
            lessons.pop(d.exp_id, None)
            retired.add(d.exp_id)
        else:
            lessons[d.exp_id] = candidate.by_id[d.exp_id].model_copy(update={"text": d.after})
    order = {e.id: i for i, e in enumerate(candidate)}  # the candidate's order, baseline-only lessons after
    ranked = sorted(lessons.values(), key=lambda e: (order.get(e.id, len(order)), e.id))
    return ExperienceLibrary.from_version(
        LibraryVersion(
            version=candidate.version,
            step=candidate.step,
            parent_version=baseline.version,
            experiences=ranked,
            retired_ids=sorted(retired),
            next_id=candidate.next_id,
            id_prefix=candidate.id_prefix,
        )
    )


def describe_decision(d: ReviewDecision) -> str:
    """One line: ``c2 modify E3: edit by ana, adopted "text" (reason)``."""
    outcome = "adopted" if d.adopted else "not adopted"
    text = f' "{d.after}"' if d.adopted and d.after else ""
    reason = f" ({d.reason})" if d.reason else ""
    return f"{d.change_id} {d.op} {d.exp_id}: {d.decision} by {d.reviewer}, {outcome}{text}{reason}"


# --- stored reviews ----------------------------------------------------------------------------------------------
class ReviewPendingError(StoreError):
    """An earlier refresh of the same name still waits for its review."""


def stored_request(store: Store, refresh_id: str) -> ReviewRequest | None:
    found = store.records(ReviewRequest, refresh_id, 0, Stage.REVIEW_REQUEST)
    return found[0] if found else None


def stored_decisions(store: Store, refresh_id: str) -> list[ReviewDecision] | None:
    if not store.stage_done(refresh_id, 0, Stage.REVIEW_DECIDE):
        return None
    return store.records(ReviewDecision, refresh_id, 0, Stage.REVIEW_DECIDE)


def is_open(store: Store, request: ReviewRequest) -> bool:
    """Neither answered nor decided (a timed-out review is decided)."""
    return not store.stage_done(request.refresh_id, 0, Stage.REFRESH_DECIDE)


def library_at(store: Store, ref: str) -> ExperienceLibrary:
    """A refresh's baseline or candidate by its ref: "none", RUN_ID:VERSION in the store, or a file."""
    if ref.strip().lower() == "none":
        return ExperienceLibrary()
    run_id, version = parse_library_ref(ref)
    if not Path(ref).is_file() and store.library_versions(run_id):
        return store.load_library(run_id, version)
    return ExperienceLibrary.load(ref)


def review_sources(store: Store, train_run_id: str, candidate: ExperienceLibrary) -> dict[str, Any]:
    """What ``changes_between`` shows with each change: the training run's operations, lesson trials and the
    citation statistics at the candidate's step (none where the run did not measure them: no summaries, so a
    lesson is not called "never cited")."""
    trials = [(int(row_step), t) for row_step, t in _trials_by_step(store, train_run_id)]
    cited = store.is_run(train_run_id) and usefulness_measured(store.run_config(train_run_id))
    rows = store.records(ExperienceStat, train_run_id, candidate.step) if cited else []
    stats = {s.exp_id: s for s in rows}
    return {"operations": store.operation_results(train_run_id), "trials": trials, "stats": stats}


def _trials_by_step(store: Store, run_id: str) -> list[tuple[int, LessonTrial]]:
    frame = store.frame(LessonTrial, run_id)
    return list(zip(frame["step"].tolist(), store.records(LessonTrial, run_id)))


def _outcome(
    request: ReviewRequest,
    decisions: Sequence[ReviewDecision],
    library_ref: str | None,
    check: Assessment | None = None,
) -> RefreshDecision:
    counts = {k: sum(d.decision == k for d in decisions) for k in ("approve", "edit", "reject", "refused_edit")}
    summary = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n)
    reviewer = decisions[0].reviewer if decisions else "nobody"
    pending = request.pending
    if library_ref is None:
        reason = f"review by {reviewer}: no change adopted ({summary}): nothing promoted"
        return pending.model_copy(
            update={"status": "not_promoted", "decided_at": utcnow(), "reasons": [*pending.reasons, reason]}
        )
    adopted = sum(d.adopted for d in decisions)
    reviewed = f"review by {reviewer}: {adopted} of {len(decisions)} change(s) adopted ({summary})"
    if check is None:  # every change as proposed: the candidate, which the gate measured, is what is served
        return pending.model_copy(
            update={
                "status": "promoted",
                "decided_at": utcnow(),
                "reasons": [*pending.reasons, f"{reviewed}; promoted library {library_ref}"],
            }
        )
    labelled = [f"the candidate as proposed (before review): {r}" for r in pending.reasons]
    verdict = (
        f"{reviewed}; the reviewed library {library_ref} passed the gate: promoted"
        if check.passed
        else f"{reviewed}; the reviewed library {library_ref} failed the gate: nothing promoted"
    )
    return pending.model_copy(
        update={
            **check.fields,
            "status": "promoted" if check.passed else "not_promoted",
            "decided_at": utcnow(),
            "reasons": [*labelled, *check.reasons, verdict],
        }
    )


def store_decisions(store: Store, request: ReviewRequest, decisions: Sequence[ReviewDecision]) -> None:
    store.write_stage(request.refresh_id, 0, Stage.REVIEW_DECIDE, {ReviewDecision: list(decisions)})


def reviewed_version(
    store: Store, request: ReviewRequest, decisions: Sequence[ReviewDecision]
) -> tuple[ExperienceLibrary, str, bool] | None:
    """The library the review leaves (the baseline plus the adopted changes), its ref (the candidate's when
    every change was taken as proposed, else a version saved as ``<refresh_id>-review``), and whether it is the
    candidate; None when nothing was adopted."""
    if not any(d.adopted for d in decisions):
        return None
    pending = request.pending
    candidate_ref = pending.candidate_ref or "none"
    candidate = library_at(store, candidate_ref)
    library = reviewed_library(library_at(store, pending.baseline_ref), candidate, decisions)
    if library.content_hash() == candidate.content_hash():
        return library, candidate_ref, True
    store.save_library(f"{request.refresh_id}-review", library)
    return library, f"{request.refresh_id}-review:{library.version}", False


def close_review(
    store: Store,
    request: ReviewRequest,
    decisions: Sequence[ReviewDecision],
    folder: Path,
    served: tuple[ExperienceLibrary, str, bool] | None,
    check: Assessment | None = None,
    *,
    released: bool = False,
) -> RefreshDecision:
    """Adopt the reviewed library when there is one and it may be served (the candidate, or a reviewed version
    that passed ``check``), and store the refresh's decision."""
    if served is not None and (check is None or check.passed):
        library, ref, _ = served
        adopt(
            store,
            request.name,
            folder,
            library,
            ref,
            request.refresh_id,
            actor=decisions[0].reviewer,
            reason="; ".join(describe_decision(d) for d in decisions),
        )
    decision = _outcome(request, decisions, served[1] if served else None, check)
    if any(d.decision == "timed_out" for d in decisions):
        decision = decision.model_copy(
            update={"reasons": [*request.pending.reasons, decisions[0].reason], "released": released}
        )
    store.write_stage(request.refresh_id, 0, Stage.REFRESH_DECIDE, {RefreshDecision: [decision]})
    return decision


def conclude(
    store: Store,
    request: ReviewRequest,
    decisions: Sequence[ReviewDecision],
    folder: Path,
    *,
    released: bool = False,
) -> RefreshDecision:
    """Store the decisions, promote the baseline plus the adopted changes (if any) and store the refresh's
    decision, without measuring a reviewed version (timeouts, tests; ``flows.refresh_review.finish_review``
    measures). Run again with the same decisions, it does the same (the promotion is kept once)."""
    store_decisions(store, request, decisions)
    return close_review(
        store, request, decisions, folder, reviewed_version(store, request, decisions), released=released
    )


def timeout_reason(request: ReviewRequest, released: bool = False) -> str:
    given_back = "; its problems go back to the next refresh" if released else ""
    return (
        f"review timed out after {request.timeout_s} s (no answer by {request.deadline:%Y-%m-%d %H:%M %Z}): "
        f"nothing promoted{given_back}"
    )


def settle_expired(
    store: Store, name: str, now: datetime, folder: Path, skip: str, *, release: bool = False
) -> tuple[list[RefreshDecision], list[ReviewRequest]]:
    """Open reviews of ``name`` (other than refresh ``skip``): those past their deadline are decided as timed out
    (returned; ``release``: their problems go back to the next refresh), the others are returned as still
    waiting."""
    settled, waiting = [], []
    for request in store.review_requests(name):
        if request.refresh_id == skip or not is_open(store, request):
            continue
        if now >= request.deadline:
            decisions = timed_out(request.changes, timeout_reason(request, release))
            settled.append(conclude(store, request, decisions, folder, released=release))
        else:
            waiting.append(request)
    return settled, waiting
