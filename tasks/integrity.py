"""The stage integrity rule: a stage whose failed items exceed its tolerance is not stored as done.

A failed item is work the stage could not do: a policy sample or learner call that failed after its
retries, or a sample the verifier could not grade. (A learner reply that could not be parsed is the model's
answer, not a failure of the stage: it is stored and counted, not retried.) Beyond
``tolerance.max_failed_fraction.<stage>`` the run stops with one line naming the stage, the step, the count, the
first cause and what to do; a retry or rerun redoes only the failed items (the work journal keeps the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.stages import Stage
from tasks.group_advantage import call_failed

UNGRADED_CAUSES = ("rollout failed", "could not verify")


class StageFailedError(RuntimeError):
    """A stage left more failed items than its tolerance; nothing of it was marked done."""


class BudgetExhaustedError(RuntimeError):
    """The run's recorded calls reached its budget: it stops before the next stage."""


@dataclass(frozen=True)
class FailedItems:
    stage: Stage
    failed: int
    total: int
    unit: str
    first_cause: str | None

    @property
    def fraction(self) -> float:
        return self.failed / self.total if self.total else 0.0

    def describe(self) -> str:
        return f"{self.failed}/{self.total} {self.unit} failed ({self.fraction:.0%})"


@dataclass(frozen=True)
class FailureRule:
    """Where a stage's items are (``table`` of its outputs), what one is called, when it failed and why;
    ``attempted``: which rows are items at all."""

    table: str
    unit: str
    is_failed: Callable[[Any], bool]
    cause: Callable[[Any], str | None]
    attempted: Callable[[Any], bool] = lambda _: True

    def count(self, stage: Stage, outputs: dict[str, list[Any]]) -> FailedItems:
        items: Sequence[Any] = [x for x in outputs[self.table] if self.attempted(x)]
        failed = [x for x in items if self.is_failed(x)]
        return FailedItems(stage, len(failed), len(items), self.unit, self.cause(failed[0]) if failed else None)


def _error(item: Any) -> str | None:
    return item.error


# the stages with items that can fail this way; the others have none
FAILURE_RULES: dict[Stage, FailureRule] = {
    Stage.ROLLOUT: FailureRule("rollouts", "samples", lambda r: r.error is not None, _error),
    # a reward never attempted (a failed rollout, no answer to grade against) is no verification
    Stage.VERIFY: FailureRule(
        "rewards", "verifications", lambda r: not r.verified, _error, attempted=lambda r: r.graded or not r.verified
    ),
    Stage.SUMMARIZE: FailureRule("summaries", "summaries", lambda s: s.error is not None, _error),
    Stage.GROUP_ADVANTAGE: FailureRule("proposals", "group proposals", call_failed, lambda p: p.parse_error),
    Stage.VALIDATE_LESSONS: FailureRule(
        "trial_samples", "lesson validation attempts", lambda s: s.reward is None, _error
    ),
    Stage.LIBRARY_GATE: FailureRule("gate_samples", "library gate attempts", lambda s: s.reward is None, _error),
    Stage.VALIDATE: FailureRule(
        "eval_results", "validation samples", lambda s: (s.error or "").startswith(UNGRADED_CAUSES), _error
    ),
}


def failed_items(stage: Stage, outputs: dict[str, list[Any]]) -> FailedItems | None:
    """What failed in a stage's outputs; None for stages without items that can fail this way."""
    rule = FAILURE_RULES.get(stage)
    return rule.count(Stage(stage), outputs) if rule else None


def stage_failed_message(items: FailedItems, step: int, tolerance: float, run_id: str) -> str:
    cause = (items.first_cause or "").replace("\n", " ")
    cause = cause if len(cause) <= 300 else cause[:300] + "..."
    return (
        f"step {step} {items.stage}: {items.describe()}, over the tolerance of {tolerance:.0%} "
        f"(tolerance.max_failed_fraction.{items.stage.tolerance_setting}); first cause: {cause}. The stage was "
        f"not stored as done; its finished items and every call are kept. Fix the cause, then Retry the flow run "
        f"(Prefect UI) or rerun with --run-id {run_id}: only the failed items are redone."
    )
