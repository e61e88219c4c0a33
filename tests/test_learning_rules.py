"""What the learner may propose and what may enter the library: the per-operation schema, prompts without
placeholders, the passthrough consolidation, and the lesson screen."""

import json
import re

import jsonschema
import pytest

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.prompts.attempts import Attempt
from clgrpo.prompts.consolidate import consolidate_messages
from clgrpo.prompts.extract import extract_messages
from clgrpo.prompts.quoting import DATA_TAG_RE
from clgrpo.prompts.repair import repair_messages
from domains.learner import (
    GROUP_KINDS,
    LearnerPrompts,
    LessonScreen,
    operations_schema,
    overlap,
    restates,
)
from domains.math import EXAMPLE_LESSONS
from schemas.config import LearningConfig, RunConfig
from schemas.records import Operation, OpStatus, Problem, Proposal
from tasks.consolidate import consolidate, consolidation_calls, passthrough

LESSON = "When a count has overlapping cases, add the cases and subtract the overlap once."


def valid(schema: dict, reply: dict) -> bool:
    try:
        jsonschema.validate(reply, schema)
    except jsonschema.ValidationError:
        return False
    return True


def ops(*items: dict) -> dict:
    return {"operations": list(items)}


def test_group_schema_allows_only_well_formed_add_and_modify():
    schema = operations_schema(2, kinds=GROUP_KINDS, live_ids=["E1", "E4"], min_words=5, max_words=24)
    assert valid(schema, ops({"op": "add", "text": LESSON}))
    assert valid(schema, ops({"op": "modify", "ids": ["E4"], "text": LESSON, "why": "better"}))
    assert not valid(schema, ops({"op": "add", "ids": ["E1"], "text": LESSON}))  # add takes no ids
    assert not valid(schema, ops({"op": "modify", "ids": ["E1", "E4"], "text": LESSON}))  # exactly one
    assert not valid(schema, ops({"op": "modify", "ids": ["E9"], "text": LESSON}))  # not in the library
    assert not valid(schema, ops({"op": "add", "text": "..."}))  # under the length bound
    assert not valid(schema, ops({"op": "delete", "ids": ["E1"]}))  # not a group's kind
    assert not valid(schema, ops(*[{"op": "add", "text": LESSON}] * 3))  # at most max_items


def test_consolidation_schema_merge_needs_two_live_ids_and_known_sources():
    schema = operations_schema(5, live_ids=["E1", "E4"], sources=["p1", "p2"], min_words=5, max_words=24)
    assert valid(schema, ops({"op": "merge", "ids": ["E1", "E4"], "text": LESSON, "sources": ["p2"]}))
    assert not valid(schema, ops({"op": "merge", "ids": ["E1"], "text": LESSON}))
    assert not valid(schema, ops({"op": "add", "text": LESSON, "sources": ["p9"]}))
    assert valid(schema, ops({"op": "delete", "ids": ["E4"]}, {"op": "keep", "ids": ["E1"]}))
    empty = operations_schema(5, live_ids=[], sources=["p1"])  # an empty library: adds only
    assert [c["properties"]["op"]["const"] for c in [empty["properties"]["operations"]["items"]]] == ["add"]


def test_lesson_pattern_replaces_the_length_bounds():
    pattern = r"^When [^.]+\.$"
    schema = operations_schema(1, kinds=GROUP_KINDS, live_ids=[], pattern=pattern)
    assert valid(schema, ops({"op": "add", "text": "When in doubt, check small cases."}))
    assert not valid(schema, ops({"op": "add", "text": "Check small cases. Always."}))


def test_prompts_have_no_placeholders_and_show_an_example_only_when_unconstrained():
    prompts = LearnerPrompts("competition mathematics", examples=EXAMPLE_LESSONS)
    problem = Problem(problem_id="p1", problem="How many divisors does 12 have?", answer="6")
    attempts = [Attempt(0, "Listed 1, 2, 3, 4, 6, 12: six.", 1.0), Attempt(1, "Guessed 4.", 0.0)]
    kwargs = dict(use_groundtruth=True, max_ops=2, min_words=5, max_words=24)
    shown = "\n".join(
        m["content"] for m in extract_messages(prompts.ask(**kwargs), problem, attempts, "", show_example=True)
    )
    hidden = "\n".join(
        m["content"] for m in extract_messages(prompts.ask(**kwargs), problem, attempts, "", show_example=False)
    )
    for text in (
        shown,
        hidden,
        consolidate_messages(prompts.ask(min_words=5, max_words=24), "{}", "[E1]. x")[0]["content"],
    ):
        assert "..." not in text and "<" not in DATA_TAG_RE.sub("", text)  # only the declared data tags
    reply = re.search(r'^\{"operations".*$', shown, re.MULTILINE).group(0)  # the example is a complete reply
    assert json.loads(reply)["operations"][0]["text"] == EXAMPLE_LESSONS[0]
    assert EXAMPLE_LESSONS[0] not in hidden and hidden.rstrip().endswith("(JSON only).")
    repair = repair_messages(prompts.ask(), [], "oops", "empty reply", show_example=False)[-1]["content"]
    assert EXAMPLE_LESSONS[0] not in repair and "empty reply" in repair


def test_passthrough_applies_group_proposals_after_combining_duplicates():
    proposals = [
        Proposal(group_id="p1", operations=[Operation(op="add", text=LESSON, source_groups=["p1"])]),
        Proposal(
            group_id="p2",
            operations=[
                Operation(op="add", text="  " + LESSON.upper(), source_groups=["p2"]),
                Operation(op="modify", target_ids=["E0"], text=LESSON + " Then check.", source_groups=["p2"]),
            ],
        ),
    ]
    result = passthrough(proposals)
    assert [(o.op.value, o.source_groups) for o in result.operations] == [("add", ["p1", "p2"]), ("modify", ["p2"])]
    (plan,) = result.proposals
    assert (
        plan.group_id == "final" and "3 proposed operation(s) from 2 group(s); 1 duplicate(s) combined" in plan.raw_text
    )
    assert consolidation_calls(30, LearningConfig(consolidation="passthrough")) == 0
    assert consolidation_calls(30, LearningConfig(consolidate_chunk_size=20)) == 3  # two chunks and a final pass


async def test_consolidate_in_passthrough_mode_makes_no_learner_call():
    class NoCalls:
        def __getattr__(self, name):
            raise AssertionError(f"the learner was called ({name})")

    proposals = [Proposal(group_id="p1", operations=[Operation(op="add", text=LESSON, source_groups=["p1"])])]
    result = await consolidate(
        proposals, ExperienceLibrary(), LearnerPrompts().ask(), NoCalls(), LearningConfig(consolidation="passthrough")
    )
    assert [o.text for o in result.operations] == [LESSON] and result.llm_calls == []


def test_lesson_screen_rejects_copies_answers_and_pattern_misses():
    problem = Problem(
        problem_id="p1",
        problem="Dara has 6 boxes with 4 stickers in each box. How many stickers are there in total?",
        answer="24",
    )
    screen = LessonScreen(LearnerPrompts(), [problem], pattern=r"^When [^.]+\.$")

    def reason(text: str) -> str | None:
        return screen(Operation(op="add", text=text, source_groups=["p1"]))

    assert reason("When boxes hold equal numbers of items, multiply the boxes by the items in each.") is None
    assert "example lesson" in reason(LearnerPrompts().examples[0])
    assert "copied from training problem p1" in reason(
        "When Dara has six boxes with four stickers in each box, she has six times four stickers."
    )
    assert reason("When items come in equal groups, the result is 24.") == "states the answer 24 of problem p1"
    assert "lesson_pattern" in reason("Multiply boxes by items in each box.")
    assert "instructions" in reason("When the kind of problem or situation, what to do.")
    assert overlap("a b c d", "x a b c y") == 0.5 and not restates("multiply it", problem.problem)
    assert reason("When a number of shells that is not a number of shells that is not a number of shells.") == (
        "repeats itself: 'a number of shells that' occurs more than once"
    )
    assert reason("When the count of red and the count of blue are known, add them.") is None


def test_library_rejects_short_and_screened_lessons_with_reasons():
    screen = LessonScreen(LearnerPrompts(), [])
    new, results = ExperienceLibrary().apply(
        [
            Operation(op="add", text="..."),
            Operation(op="add", text="When is  a  base of  ."),
            Operation(op="add", text=LearnerPrompts().examples[1]),
            Operation(op="add", text=LESSON),
        ],
        step=1,
        min_words=6,
        screen=screen,
    )  # the demo's minimum
    assert [(r.status, r.reason.split(":")[0]) for r in results] == [
        (OpStatus.REJECTED, "too short"),
        (OpStatus.REJECTED, "too short"),  # a lone "." is not a word
        (OpStatus.REJECTED, "copied from the prompt's example lesson"),
        (OpStatus.APPLIED, ""),
    ]
    assert [e.text for e in new] == [LESSON]


def test_new_learning_settings_count_in_the_fingerprint_only_when_changed():
    base = RunConfig(run_id="r", dataset={"path": "x.jsonl"})  # tests/test_eval_records.py: older fingerprints
    changed = base.model_copy(update={"learning": LearningConfig(consolidation="passthrough")})
    assert changed.fingerprint() != base.fingerprint()
    with pytest.raises(ValueError, match="not a regular expression"):
        LearningConfig(lesson_pattern="(")


def test_a_plan_that_keeps_none_of_the_proposed_operations_is_named():
    from dataclasses import replace

    from tasks.checkpoint import step_problems, step_report

    empty = step_report(
        run_id="r",
        step=1,
        epoch=0,
        rollouts=[],
        rewards=[],
        advantages=[],
        summaries=[],
        proposals=[],
        consolidation_plans=[],
        results=[],
        library_size=0,
        calls=[],
    )
    assert step_problems(empty) == []
    kept_none = replace(empty, operations_proposed=3)
    assert step_problems(kept_none) == [
        "the consolidation plan kept none of the 3 proposed operations (the learner's "
        "decision; learning.consolidation: passthrough applies the group proposals)"
    ]
    assert step_problems(replace(kept_none, operations_rejected=1)) == []


def test_a_rationalization_not_kept_is_no_problem_of_the_step_and_a_refused_one_says_why():
    """A solution the verifier did not accept is what stage rationalize expects of most asks: it is counted in the
    step table's bad proposals (as before) but the step's WARNING line called it an unusable group reply, every
    step, before. A request the learner refused is named with its cause, once."""
    from schemas.records import GroupAdvantage
    from tasks.checkpoint import step_problems, step_report
    from tasks.group_advantage import CALL_FAILED
    from tasks.rationalize import REFUSED

    def proposal(group: str, why: str | None = None) -> Proposal:
        return Proposal(group_id=group, parse_error=why)

    def report(proposals: list[Proposal], rationales: list[Proposal]):
        return step_report(
            run_id="r", step=1, epoch=0, rollouts=[], rewards=[], summaries=[], consolidation_plans=[], results=[],
            advantages=[
                GroupAdvantage(problem_id="g", rewards=[1, 0], mean_reward=0.5, std_reward=0.5, advantages=[1, -1],
                               selected=True, reason="mixed")
            ],
            proposals=proposals, rationales=rationales, library_size=0, calls=[],
        )  # fmt: skip

    not_kept = [
        proposal(f"u{i}", "rationalization not kept: its final answer '6' is not the reference") for i in (1, 2)
    ]
    quiet = report([proposal("g")], [*not_kept, proposal("u3")])
    assert (quiet.proposals_parsed, quiet.proposals_failed) == (2, 2) and step_problems(quiet) == []
    refusal = "rationalize/learner: prompt of 1031 tokens does not fit the model's context of 1024"
    refused = report([proposal("g")], [*not_kept, proposal("u3", REFUSED + refusal)])
    assert step_problems(refused) == [
        f"1 rationalizations not made: the learner refused the request ({refusal}); learning.examples: rollouts "
        "takes worked examples from the rollouts alone"
    ]
    failing = report([proposal("g", "no JSON object found"), proposal("h", CALL_FAILED + "timeout")], not_kept)
    assert step_problems(failing) == [
        "1 learner calls for group proposals failed",
        "1 group proposals were unusable replies",
        "all 2 group proposals failed: this step learned nothing",
    ]
