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

from tasks.group_advantage import call_failed

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
    tolerance_setting: str  # its field under tolerance.max_failed_fraction

    @property
    def fraction(self) -> float:
        return self.failed / self.total if self.total else 0.0

    def describe(self) -> str:
        return f"{self.failed}/{self.total} {self.unit} failed ({self.fraction:.0%})"


@dataclass(frozen=True)
class FailureRule:
    """A stage's failure rule, declared with the stage: where its items are (``items`` of its typed output), what
    one is called, when it failed and why, and which tolerance (``tolerance.max_failed_fraction.<tolerance>``) it
    may leave; ``attempted``: which rows are items at all."""

    items: Callable[[Any], Sequence[Any]]
    unit: str
    is_failed: Callable[[Any], bool]
    cause: Callable[[Any], str | None]
    tolerance: str
    attempted: Callable[[Any], bool] = lambda _: True

    def count(self, stage: str, output: Any) -> FailedItems:
        items: Sequence[Any] = [x for x in self.items(output) if self.attempted(x)]
        failed = [x for x in items if self.is_failed(x)]
        cause = self.cause(failed[0]) if failed else None
        return FailedItems(stage, len(failed), len(items), self.unit, cause, self.tolerance)


def item_error(item: Any) -> str | None:
    return item.error


def ungraded(item: Any) -> bool:
    """A trial or gate sample the verifier could not grade."""
    return item.reward is None


# the failure rules of the stages with items that can fail this way (the step's own are declared with each
# stage in flows/step.py STEP; held-out validation's here)
ROLLOUT_FAILURES = FailureRule(lambda o: o.rollouts, "samples", lambda r: r.error is not None, item_error, "rollout")
# a reward never attempted (a failed rollout, no answer to grade against) is no verification
VERIFY_FAILURES = FailureRule(
    lambda o: o.rewards,
    "verifications",
    lambda r: not r.verified,
    item_error,
    "verify",
    attempted=lambda r: r.graded or not r.verified,
)
SUMMARY_FAILURES = FailureRule(
    lambda o: o.summaries, "summaries", lambda s: s.error is not None, item_error, "summarize"
)
PROPOSAL_FAILURES = FailureRule(
    lambda o: o.proposals, "group proposals", call_failed, lambda p: p.parse_error, "group_advantage"
)
RATIONALE_FAILURES = FailureRule(
    lambda o: o.proposals, "rationalizations", call_failed, lambda p: p.parse_error, "rationalize"
)
TRIAL_FAILURES = FailureRule(
    lambda o: o.trial_samples, "lesson validation attempts", ungraded, item_error, "validate_lessons"
)
GATE_FAILURES = FailureRule(lambda o: o.gate_samples, "library gate attempts", ungraded, item_error, "library_gate")
VALIDATION_FAILURES = FailureRule(
    lambda o: o.eval_results,
    "validation samples",
    lambda s: (s.error or "").startswith(UNGRADED_CAUSES),
    item_error,
    "validation",
)


def stage_failed_message(items: FailedItems, step: int, tolerance: float, run_id: str) -> str:
    cause = (items.first_cause or "").replace("\n", " ")
    cause = cause if len(cause) <= 300 else cause[:300] + "..."
    return (
        f"step {step} {items.stage}: {items.describe()}, over the tolerance of {tolerance:.0%} "
        f"(tolerance.max_failed_fraction.{items.tolerance_setting}); first cause: {cause}. The stage was "
        f"not stored as done; its finished items and every call are kept. Fix the cause, then Retry the flow run "
        f"(Prefect UI) or rerun with --run-id {run_id}: only the failed items are redone."
    )
