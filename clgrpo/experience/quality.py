"""Quality of a library version as a whole, per step: size, tokens, duplicates, confidence, coverage, churn.

- ``size`` and ``examples``: the live experiences, and how many of them are worked examples.
- ``tokens``: the estimated tokens of the rendered lessons (``clgrpo.experience.tokens``; what
  ``library.max_tokens`` bounds; the examples are bounded by count, ``library.examples_shown`` a prompt).
- ``near_duplicates`` / ``duplicate_ratio``: the step's adds and modifies rejected or merged as near-duplicates
  of live experiences, and their share of all adds and modifies of the step's plan.
- ``mean_confidence`` and ``never_cited_share``: over the live experiences' stats (``clgrpo.experience.usefulness``).
- ``coverage``: of the step's problems with summaries (groups with reward variance: only they are summarized),
  the share where at least one attempt's summary cited a lesson it was shown.
- churn, the step's applied operations: ``added`` (new ids: adds, merge results), ``modified``, ``deleted`` (ids
  removed by delete or merge), ``evicted`` (by the token budget); the previous size + added - deleted - evicted
  is the new size (a lesson added and evicted in the same step counts in both).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from clgrpo.experience.library import NEAR_DUPLICATE, ExperienceLibrary
from clgrpo.experience.usefulness import cited_ids
from clgrpo.process.words import counted
from schemas.records import ExperienceStat, LibraryQuality, OperationResult, OpKind, OpStatus, Summary


def near_duplicate_counts(results: Sequence[OperationResult]) -> tuple[int, float]:
    """Near-duplicate outcomes of a step's operations, and their share of its adds and modifies."""
    near = sum(r.reason.startswith(NEAR_DUPLICATE) for r in results)
    edits = sum(r.operation.op in (OpKind.ADD, OpKind.MODIFY) for r in results)
    return near, near / max(1, edits)


def coverage(summaries: Sequence[Summary], shown_ids: Sequence[str]) -> tuple[float | None, int]:
    """Share of the summarized problems where some attempt cited a shown lesson, and how many were summarized."""
    problems: dict[str, bool] = {}
    for summary in summaries:
        if summary.error is not None:
            continue
        cited = bool(cited_ids(summary.text, shown_ids))
        problems[summary.problem_id] = problems.get(summary.problem_id, False) or cited
    if not problems:
        return None, 0
    return sum(problems.values()) / len(problems), len(problems)


def churn(previous: ExperienceLibrary, results: Sequence[OperationResult]) -> dict[str, int]:
    """Applied changes by kind: new ids (adds, merge results), modified texts, ids removed by delete or merge,
    ids evicted by the budget; ``len(previous) + added - deleted - evicted`` is the new size."""
    applied = [r for r in results if r.status == OpStatus.APPLIED]

    def count(kind: OpKind) -> int:
        return sum(r.operation.op == kind for r in applied)

    fresh_adds = sum(r.operation.op == OpKind.ADD and r.result_id not in previous for r in applied)
    merged_away = sum(len(r.operation.target_ids) for r in applied if r.operation.op == OpKind.MERGE)
    return {
        "added": fresh_adds + count(OpKind.MERGE),
        "modified": count(OpKind.MODIFY),
        "deleted": count(OpKind.DELETE) + merged_away,
        "evicted": count(OpKind.EVICT),
    }


def library_quality(
    previous: ExperienceLibrary,
    library: ExperienceLibrary,
    stats: Sequence[ExperienceStat],
    results: Sequence[OperationResult],
    summaries: Sequence[Summary],
) -> LibraryQuality:
    """The quality row of ``library`` (the version after a step) from the step's operations and summaries;
    ``previous``: the version the step's rollouts were shown."""
    live = {s.exp_id: s for s in stats if s.exp_id in library}
    near, ratio = near_duplicate_counts(results)
    share, summarized = coverage(summaries, [e.id for e in previous])
    return LibraryQuality(
        version=library.version,
        size=len(library),
        examples=len(library.examples),
        tokens=library.prompt_tokens(),
        near_duplicates=near,
        duplicate_ratio=ratio,
        mean_confidence=statistics.fmean(s.confidence for s in live.values()) if live else None,
        never_cited_share=sum(not s.cited for s in live.values()) / len(live) if live else None,
        coverage=share,
        coverage_problems=summarized,
        **churn(previous, results),
    )


def describe_quality(q: LibraryQuality, *, usefulness: bool = True) -> str:
    """One line for the step log; ``usefulness``: whether the run measures citations (it summarizes)."""

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    confidence = "-" if q.mean_confidence is None else f"{q.mean_confidence:.2f}"
    cited = (
        f"mean confidence {confidence}, never cited {share(q.never_cited_share)}, coverage {share(q.coverage)} of "
        f"{q.coverage_problems} summarized problems"
        if usefulness
        else "usefulness not measured (no summaries)"
    )
    items = counted(q.size, "lesson")
    if q.examples:
        items = f"{counted(q.size - q.examples, 'lesson')} and {counted(q.examples, 'worked example')}"
    return (
        f"library v{q.version}: {items}, {q.tokens} lesson tokens, duplicate ratio "
        f"{q.duplicate_ratio:.0%}, {cited}, churn +{q.added} ~{q.modified} -{q.deleted} evicted {q.evicted}"
    )
