"""What a step learns, decided in one place: from the stage outputs the step has so far, which operations go on
at each point and which are left out, each with its reason.

The step's plan passes through three judges, in ``STEP``'s order: the learning limits (``tasks.limits``: each
group proposal within ``max_ops_per_group``, the consolidated plan within its bound and ``max_ops_per_step``), the
lesson trials' verdicts (``tasks.validate_lessons``, when ``lesson_validation`` is on), and the library gate's
decision on the whole step (``tasks.library_gate``). ``step_plan`` is a pure function of the stored outputs, so
a resumed step decides exactly as the step that stored them did; a stage that has not run yet (or does not run)
contributes an empty output and leaves the plan as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.config import LearningConfig
from schemas.records import LessonTrial, Operation, Proposal
from tasks.limits import limit_plan, limit_proposals, plan_bound
from tasks.outputs import Gate, GroupProposals, Plans, Trials

Rejection = tuple[Operation, str]  # an operation left out, and why


@dataclass(frozen=True)
class StepPlan:
    """The step's plan at each point: ``proposals`` (the group proposals within ``max_ops_per_group``) go to
    consolidation; ``planned`` (the final plan within its limits) to lesson validation; ``validated`` (what the
    trials kept or did not test; validation off: the plan) to the library gate; ``adopted`` to apply_operations.
    ``over_limits`` and ``not_adopted`` are stored by apply_operations as rejected operations, in that order."""

    proposals: list[Proposal]
    planned: list[Operation]
    validated: list[Operation]
    adopted: list[Operation]
    over_limits: list[Rejection]  # the group proposals' operations over their limit, then the plan's
    not_adopted: list[Rejection]  # rejected by a trial, then (when the gate rejected the step) every validated one

    @property
    def rejected(self) -> list[Rejection]:
        return self.over_limits + self.not_adopted


def step_plan(
    proposals: GroupProposals, plans: Plans, trials: Trials, gate: Gate, library_size: int, cfg: LearningConfig
) -> StepPlan:
    """The plan from the step's outputs so far: the group proposals, the consolidation's plans, the lesson
    trials and the library gate's decision; ``library_size``: the library before the step."""
    limited, over_proposals = limit_proposals(proposals.proposals, cfg)
    plan = limit_plan(plans.operations, bound=plan_bound(limited, library_size), cfg=cfg)
    validated, failed = plan_after(trials.lesson_trials) if cfg.lesson_validation.enabled else (plan.operations, [])
    adopted, not_adopted = validated, failed
    decision = gate.library_gates[0] if gate.library_gates else None
    if decision is not None and decision.verdict == "rejected":  # the step as a whole measured worse
        adopted, not_adopted = [], failed + [(op, decision.reason) for op in validated]
    return StepPlan(limited, plan.operations, validated, adopted, over_proposals + plan.over, not_adopted)


def plan_after(trials: Sequence[LessonTrial]) -> tuple[list[Operation], list[Rejection]]:
    """The plan that goes on (kept operations carry their numbers in their rationale; untested ones as they
    were) and the rejected operations with their reasons, from the stored trials (so a resumed step gets the
    same)."""
    plan, rejected = [], []
    for t in sorted(trials, key=lambda t: t.seq):
        if t.verdict == "rejected":
            rejected.append((t.operation, t.reason))
        elif t.verdict == "kept":
            plan.append(t.operation.model_copy(update={"rationale": f"{t.operation.rationale} [{t.reason}]".strip()}))
        else:
            plan.append(t.operation)
    return plan, rejected
