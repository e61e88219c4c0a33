"""The extractor (``ROLE: experience extractor``): a group's attempts compared, and the group advantage written
as operations on the library (stage extract_group_advantage). With ground truth the attempts carry their grades
(correct vs wrong); without, the learner judges better vs worse itself. The reply is JSON
(``domains.learner.operations_schema``)."""

from __future__ import annotations

from collections.abc import Sequence

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.attempts import Attempt, answer_block, grade_label, library_block
from clgrpo.prompts.lessons import LESSON_RULE, LessonAsk, example_block
from clgrpo.prompts.quoting import DATA_NOTICE
from schemas.records import Problem

EXTRACT_SYSTEM = (
    """ROLE: experience extractor
You improve a library of short, general lessons for solving {domain} problems. You are shown the current
library, one problem{answer_note} and several {graded}attempts at it.
"""
    + DATA_NOTICE
    + "\n"
    + LESSON_RULE
    + """
{edit_kinds}
Reply with JSON only: {{"operations": [your edits]}}, at most {max_ops} edit(s), or {{"operations": []}} when the
attempts teach nothing new.{example_block}"""
)

EXTRACT_KINDS_ADD = """An edit is {"op": "add", "text": the lesson}."""

EXTRACT_KINDS_MODIFY = """An edit is {"op": "add", "text": a new lesson}, or {"op": "modify", "ids": [the id of one library
lesson, such as "E3"], "text": the improved lesson}."""  # noqa: E501 (prompt text: its lines are the prompt's)

EXTRACT_USER = """Current library:
{library}

Problem:
{problem}
{answer_block}
{attempts}

Task: compare the attempts. What did the {better} attempts do that the {worse} ones did not? Write that as a
general lesson of at most {max_words} words (JSON only)."""


def extract_messages(
    ask: LessonAsk, problem: Problem, attempts: Sequence[Attempt], library_text: str, *, show_example: bool = True
) -> list[Message]:
    """``show_example``: include a complete example reply. Leave it out when the reply is constrained to
    the schema (the grammar shows the shape; a small model copies an example's lesson word for word)."""
    use_groundtruth = ask.use_groundtruth
    system = EXTRACT_SYSTEM.format(
        domain=ask.domain,
        max_ops=ask.max_ops,
        min_words=ask.min_words,
        max_words=ask.max_words,
        edit_kinds=EXTRACT_KINDS_MODIFY if library_text else EXTRACT_KINDS_ADD,
        answer_note=" with its reference answer," if use_groundtruth else "",
        graded="graded " if use_groundtruth else "",
        example_block=example_block(ask.examples, show_example, sources=False),
    )
    blocks = [
        f"Attempt {a.sample_idx}{grade_label(a.reward) if use_groundtruth and a.reward is not None else ''}{a.mark}:"
        f"\n{quoting.quote('attempt', a.with_tools, id=a.sample_idx)}"
        for a in attempts
    ]
    user = EXTRACT_USER.format(
        library=library_block(library_text),
        problem=quoting.quote("problem", problem.problem, id=problem.problem_id),
        answer_block=answer_block(problem, use_groundtruth),
        attempts="\n\n".join(blocks),
        better="correct" if use_groundtruth else "better",
        worse="wrong" if use_groundtruth else "worse",
        max_words=ask.max_words,
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
