"""The stage integrity rule: a stage whose failed items exceed its tolerance is not stored as done.

A failed item is work the stage could not do: a policy sample or learner call that failed after its
retries, or a sample the verifier could not grade. (A learner reply that could not be parsed is the model's
answer, not a failure of the stage: it is stored and counted, not retried.) Beyond
``tolerance.max_failed_fraction.<stage>`` the run stops with one line naming the stage, the step, the count, the
first cause and what to do; a retry or rerun redoes only the failed items (the work journal keeps the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.ddl import VALIDATE_STAGE
from tasks.group_advantage import STAGE as GROUP_ADVANTAGE
from tasks.group_advantage import call_failed
from tasks.rollout import STAGE as ROLLOUT
from tasks.summarize import STAGE as SUMMARIZE
from tasks.validate_lessons import STAGE as VALIDATE_LESSONS
from tasks.verify import STAGE as VERIFY

UNGRADED_CAUSES = ("rollout failed", "could not verify")


class StageFailedError(RuntimeError):
    """A stage left more failed items than its tolerance; nothing of it was marked done."""


class BudgetExhaustedError(RuntimeError):
    """The run's recorded calls reached its budget: it stops before the next stage."""


@dataclass(frozen=True)
class FailedItems:
    stage: str
    failed: int
    total: int
    unit: str
    first_cause: str | None

    @property
    def fraction(self) -> float:
        return self.failed / self.total if self.total else 0.0

    def describe(self) -> str:
        return f"{self.failed}/{self.total} {self.unit} failed ({self.fraction:.0%})"


def _count(stage: str, unit: str, items: Sequence[Any], is_failed: Any, cause: Any) -> FailedItems:
    failed = [x for x in items if is_failed(x)]
    return FailedItems(stage, len(failed), len(items), unit, cause(failed[0]) if failed else None)


def failed_items(stage: str, outputs: dict[str, list[Any]]) -> FailedItems | None:
    """What failed in a stage's outputs; None for stages without items that can fail this way."""
    if stage == ROLLOUT:
        return _count(stage, "samples", outputs["rollouts"], lambda r: r.error is not None, lambda r: r.error)
    if stage == VERIFY:
        attempted = [r for r in outputs["rewards"] if r.graded or not r.verified]
        return _count(stage, "verifications", attempted, lambda r: not r.verified, lambda r: r.error)
    if stage == SUMMARIZE:
        return _count(stage, "summaries", outputs["summaries"], lambda s: s.error is not None, lambda s: s.error)
    if stage == GROUP_ADVANTAGE:
        return _count(stage, "group proposals", outputs["proposals"], call_failed, lambda p: p.parse_error)
    if stage == VALIDATE_LESSONS:
        return _count(
            stage, "lesson validation attempts", outputs["trial_samples"], lambda s: s.reward is None, lambda s: s.error
        )
    if stage == VALIDATE_STAGE:
        return _count(
            stage,
            "validation samples",
            outputs["eval_results"],
            lambda s: (s.error or "").startswith(UNGRADED_CAUSES),
            lambda s: s.error,
        )
    return None


def stage_failed_message(items: FailedItems, step: int, tolerance: float, run_id: str) -> str:
    cause = (items.first_cause or "").replace("\n", " ")
    cause = cause if len(cause) <= 300 else cause[:300] + "..."
    setting = "validation" if items.stage == VALIDATE_STAGE else items.stage  # tolerance.max_failed_fraction.*
    return (
        f"step {step} {items.stage}: {items.describe()}, over the tolerance of {tolerance:.0%} "
        f"(tolerance.max_failed_fraction.{setting}); first cause: {cause}. The stage was not stored as "
        f"done; its finished items and every call are kept. Fix the cause, then Retry the flow run (Prefect "
        f"UI) or rerun with --run-id {run_id}: only the failed items are redone."
    )
