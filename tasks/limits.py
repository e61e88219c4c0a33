"""Enforced learning limits, independent of the backend (a JSON schema's ``maxItems`` is only a hint that some
endpoints honour): operations per group proposal, per consolidation plan, per step. What is over a limit is
never applied and never dropped silently: it comes back as a rejected operation with the limit in its reason
(stored in ``operations`` and counted). The library size limit is enforced by ``ExperienceLibrary.apply``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.config import LearningConfig
from schemas.records import Operation, OperationResult, OpStatus, Proposal


@dataclass
class Limited:
    operations: list[Operation]
    over: list[tuple[Operation, str]] = field(default_factory=list)  # (operation, why it is over a limit)


def limit_proposals(
    proposals: list[Proposal], cfg: LearningConfig
) -> tuple[list[Proposal], list[tuple[Operation, str]]]:
    """Each group proposal keeps the first ``max_ops_per_group`` of the learner's operations for consolidation,
    and its worked example: that comes from the group's rollouts (or the rationalize stage), not from the learner's
    reply the limit bounds, and a group offers at most one."""
    kept, over = [], []
    for proposal in proposals:
        proposed = sum(op.example is None for op in proposal.operations)
        reason = (
            f"over learning.max_ops_per_group={cfg.max_ops_per_group}: group {proposal.group_id} proposed "
            f"{proposed} operations"
        )
        within: list[Operation] = []
        learner = 0
        for op in proposal.operations:
            learner += op.example is None
            if op.example is None and learner > cfg.max_ops_per_group:
                over.append((op, reason))
            else:
                within.append(op)
        kept.append(
            proposal.model_copy(update={"operations": within}) if proposed > cfg.max_ops_per_group else proposal
        )
    return kept, over


def plan_bound(proposals: list[Proposal], library_size: int) -> int:
    """A final plan needs at most one operation per proposed one plus one per library entry."""
    return sum(len(p.operations) for p in proposals) + library_size


def limit_plan(operations: list[Operation], *, bound: int, cfg: LearningConfig) -> Limited:
    """The final plan within its bound and ``max_ops_per_step``, in plan order."""
    over = [
        (
            op,
            f"over the consolidation bound of {bound} operations (proposed operations + library size): "
            f"the plan had {len(operations)}",
        )
        for op in operations[bound:]
    ]
    operations = operations[:bound]
    over += [
        (op, f"over learning.max_ops_per_step={cfg.max_ops_per_step}: the plan had {len(operations)} operations")
        for op in operations[cfg.max_ops_per_step :]
    ]
    return Limited(operations[: cfg.max_ops_per_step], over)


def rejected_results(over: list[tuple[Operation, str]], first_seq: int) -> list[OperationResult]:
    return [
        OperationResult(seq=first_seq + i, operation=op, status=OpStatus.REJECTED, reason=reason)
        for i, (op, reason) in enumerate(over)
    ]
