"""The summarizer (``ROLE: trajectory summarizer``): one attempt described for a colleague who compares the
attempts of a group (stage summarize). Graded attempts are told where they went wrong; without ground truth the
summary names the doubtful and the solid steps; agent attempts also get their tool use reviewed."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.attempts import Attempt, answer_block, grade_label
from clgrpo.prompts.lessons import LessonAsk
from clgrpo.prompts.quoting import DATA_NOTICE
from schemas.records import Problem

SUMMARIZE_SYSTEM = (
    """ROLE: trajectory summarizer
You review one attempt at a {domain} problem and describe it for a colleague who will compare several
attempts at the same problem.
"""
    + DATA_NOTICE
    + """
Write plain text, at most 150 words:
1. The approach, step by step, in a few short lines.
2. Which listed experiences (by id) the attempt used or ignored, if any were given.
3. {grading_instruction}{tool_instruction}"""
)

SUMMARIZE_TOOLS = """
4. Its tool use (calls and results are shown): which calls helped, which failed or were missing, and why."""

SUMMARIZE_GRADED = (
    """Where the attempt went wrong or took a detour, and why; or, if it is correct, what made it work."""
)

SUMMARIZE_UNGRADED = """Steps that look doubtful or unverified, and steps that look solid (no grade is available)."""

SUMMARIZE_USER = """{library_block}Problem:
{problem}
{answer_block}
Attempt{grade_block}:
{attempt}"""


def summarize_messages(ask: LessonAsk, problem: Problem, attempt: Attempt, library_text: str) -> list[Message]:
    use_groundtruth = ask.use_groundtruth
    reward = attempt.reward if use_groundtruth else None  # the grade is shown only with ground truth
    system = SUMMARIZE_SYSTEM.format(
        domain=ask.domain,
        grading_instruction=SUMMARIZE_GRADED if reward is not None else SUMMARIZE_UNGRADED,
        tool_instruction=SUMMARIZE_TOOLS if attempt.tools else "",
    )
    user = SUMMARIZE_USER.format(
        library_block=f"Experiences given to the solver:\n{quoting.quote('library', library_text)}\n\n"
        if library_text.strip()
        else "",
        problem=quoting.quote("problem", problem.problem, id=problem.problem_id),
        answer_block=answer_block(problem, use_groundtruth),
        grade_block=(grade_label(reward) if reward is not None else "") + attempt.mark,
        attempt=quoting.quote("attempt", attempt.text, id=attempt.sample_idx),
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
