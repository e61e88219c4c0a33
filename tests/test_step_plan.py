"""The step's plan (``tasks.plan.step_plan``): the learning limits, the lesson trials' verdicts and the library
gate's decision, decided in one pure function from the step's outputs, each operation left out with its reason."""

from __future__ import annotations

from schemas.config import LearningConfig, LessonValidation
from schemas.records import GateDecision, LessonTrial, Operation, OpKind, Proposal
from tasks.outputs import FINAL, Gate, GroupProposals, Plans, Trials
from tasks.plan import step_plan


def add(text: str, group: str = "g1") -> Operation:
    return Operation(op=OpKind.ADD, text=text, source_groups=[group])


def final(*ops: Operation) -> Plans:
    return Plans(
        [Proposal(group_id="chunk-0", operations=[add("a chunk plan")]), Proposal(group_id=FINAL, operations=list(ops))]
    )


def trial(seq: int, op: Operation, verdict: str) -> LessonTrial:
    return LessonTrial(seq=seq, operation=op, verdict=verdict, reason=f"{verdict} by its trial")


def gate(verdict: str) -> Gate:
    return Gate(library_gates=[GateDecision(verdict=verdict, reason=f"library gate: {verdict}", rule="significant")])


VALIDATING = LearningConfig(lesson_validation=LessonValidation(enabled=True))


def test_nothing_yet_is_an_empty_plan():
    plan = step_plan(GroupProposals(), Plans(), Trials(), Gate(), 3, LearningConfig())
    assert (plan.proposals, plan.planned, plan.validated, plan.adopted, plan.rejected) == ([], [], [], [], [])


def test_limits_cut_the_group_proposals_and_the_plan_each_with_its_reason():
    cfg = LearningConfig(max_ops_per_group=2, max_ops_per_step=3)
    ops = [add(f"lesson {i}") for i in range(5)]
    proposals = GroupProposals([Proposal(group_id="g1", operations=ops), Proposal(group_id="g2", operations=ops[:1])])
    plan = step_plan(proposals, final(*ops), Trials(), Gate(), 0, cfg)
    assert [len(p.operations) for p in plan.proposals] == [2, 1]  # what consolidation sees
    assert plan.planned == ops[:3] and plan.validated == plan.adopted == ops[:3]  # validation off: the plan
    assert [op.text for op, _ in plan.over_limits] == ["lesson 2", "lesson 3", "lesson 4", "lesson 3", "lesson 4"]
    assert plan.over_limits[0][1].startswith("over learning.max_ops_per_group=2: group g1 proposed 5")
    # the consolidation bound (2 + 1 proposed operations kept, empty library) comes before max_ops_per_step
    assert plan.over_limits[3][1].startswith("over the consolidation bound of 3 operations")
    assert plan.not_adopted == [] and plan.rejected == plan.over_limits


def test_the_trials_verdicts_decide_what_goes_on_when_validation_is_on():
    ops = [add("kept"), add("rejected"), Operation(op=OpKind.DELETE, target_ids=["E0"])]
    proposals = GroupProposals([Proposal(group_id="g1", operations=ops)])
    trials = Trials([trial(0, ops[0], "kept"), trial(1, ops[1], "rejected"), trial(2, ops[2], "untested")])
    plan = step_plan(proposals, final(*ops), trials, Gate(), 1, VALIDATING)
    assert [op.text for op in plan.validated] == ["kept", None] and plan.adopted == plan.validated
    assert plan.validated[0].rationale.endswith("[kept by its trial]")  # a kept lesson carries its numbers
    assert plan.not_adopted == [(ops[1], "rejected by its trial")]
    off = step_plan(proposals, final(*ops), trials, Gate(), 1, LearningConfig())  # validation off: trials unread
    assert off.validated == ops and off.not_adopted == []


def test_a_gate_that_rejects_the_step_leaves_nothing_adopted_and_says_why_for_each():
    ops = [add("kept"), add("rejected")]
    proposals = GroupProposals([Proposal(group_id="g1", operations=ops)])
    trials = Trials([trial(0, ops[0], "kept"), trial(1, ops[1], "rejected")])
    rejected = step_plan(proposals, final(*ops), trials, gate("rejected"), 0, VALIDATING)
    assert rejected.adopted == [] and [op.text for op in rejected.validated] == ["kept"]
    assert [(op.text, why) for op, why in rejected.not_adopted] == [
        ("rejected", "rejected by its trial"),
        ("kept", "library gate: rejected"),
    ]
    adopted = step_plan(proposals, final(*ops), trials, gate("adopted"), 0, VALIDATING)
    assert adopted.adopted == adopted.validated and [op.text for op, _ in adopted.not_adopted] == ["rejected"]
