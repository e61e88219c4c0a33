"""The contrast extractor (``ROLE: experience extractor (contrast)``): one correct and one wrong attempt side by
side, the step where they part, and one lesson (``domains.learner.contrast_schema``); and the follow-up that asks
for a lesson which is not general (too long, or about its own problem) to be rewritten."""

from __future__ import annotations

import json
from collections.abc import Sequence

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.attempts import Attempt, answer_block, library_block
from clgrpo.prompts.lessons import EXAMPLE_BLOCK, LessonAsk
from clgrpo.prompts.quoting import DATA_NOTICE
from schemas.records import Problem

CONTRAST_SYSTEM = (
    """ROLE: experience extractor (contrast)
You improve a library of short, general lessons for solving {domain} problems. You are shown the current
library, one problem{answer_note}, and two attempts at it side by side: one graded correct, one graded wrong.
"""
    + DATA_NOTICE
    + """
Find the first step where the wrong attempt did something different from the correct one, and write one lesson
that would have kept it from going wrong: a general rule for every problem of this kind, one sentence of
{min_words} to {max_words} words, without this problem's numbers, names or answer. If the rule holds only for
some problems of this kind (for example only when an amount falls, not when it rises), begin with that
condition ("When ..."), so that it is never applied where it is wrong.{revise_note}
Reply with JSON only: {{"difference": what the correct attempt did at that step and the wrong one did not,
"lesson": the lesson{revise_field}}}.{example_block}"""
)

CONTRAST_REVISE_NOTE = """
If a library lesson already covers this step but did not prevent the mistake, improve that lesson instead and
give its id in "revises"."""

CONTRAST_USER = """Current library:
{library}

Problem:
{problem}
{answer_block}
Attempt graded correct:
{right}

Attempt graded wrong:
{wrong}

Task: what did the correct attempt do at the step where the wrong one went wrong? Write it as a general lesson
for this kind of problem (JSON only)."""

GENERALIZE = """A lesson drafted from the problem above cannot be kept as it is: {reason}.
Rewrite it as one general sentence of {min_words} to {max_words} words that holds for every problem of this kind:
name the kind of problem and what to do, with no number, name or answer of this problem.
The draft:
{lesson}
Reply with JSON only: {{"lesson": the rewritten lesson}}."""


def contrast_example(examples: tuple[str, str], revise: bool) -> str:
    """A complete contrast reply with the domain's first example lesson."""
    reply: dict = {
        "difference": "The correct attempt listed every condition and checked its answer against "
        "each one; the wrong attempt checked only the first condition.",
        "lesson": examples[0],
    }
    if revise:
        reply["revises"] = None
    return json.dumps(reply)


def contrast_messages(
    ask: LessonAsk,
    problem: Problem,
    right: Attempt,
    wrong: Attempt,
    library_text: str,
    *,
    live_ids: Sequence[str],
    show_example: bool = True,
) -> list[Message]:
    """One correct and one wrong attempt side by side (their trajectories, tool calls included), the step
    where they part, and one lesson (``domains.learner.contrast_schema``). ``live_ids``: the lessons the reply
    may revise (none: it can only add)."""
    revise = bool(live_ids)
    system = CONTRAST_SYSTEM.format(
        domain=ask.domain,
        min_words=ask.min_words,
        max_words=ask.max_words,
        answer_note=" with its reference answer" if ask.use_groundtruth else "",
        revise_note=CONTRAST_REVISE_NOTE if revise else "",
        revise_field=', "revises": the id of the lesson it improves, or null' if revise else "",
        example_block=EXAMPLE_BLOCK.format(example=contrast_example(ask.examples, revise)) if show_example else "",
    )
    user = CONTRAST_USER.format(
        library=library_block(library_text),
        problem=quoting.quote("problem", problem.problem, id=problem.problem_id),
        answer_block=answer_block(problem, ask.use_groundtruth),
        right=quoting.quote("attempt", right.with_tools, id=right.sample_idx) + right.mark,
        wrong=quoting.quote("attempt", wrong.with_tools, id=wrong.sample_idx) + wrong.mark,
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def generalize_messages(ask: LessonAsk, asked: list[Message], draft: str, reason: str) -> list[Message]:
    """The follow-up to a contrast reply whose lesson is not general (too long, or about its own problem): the
    same conversation, its reply, then the request to rewrite the lesson."""
    rewrite = GENERALIZE.format(
        reason=reason, min_words=ask.min_words, max_words=ask.max_words, lesson=quoting.quote("proposals", draft)
    )
    return [
        *asked,
        {"role": "assistant", "content": json.dumps({"lesson": draft})},
        {"role": "user", "content": rewrite},
    ]
