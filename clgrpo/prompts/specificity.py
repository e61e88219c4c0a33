"""The lesson rater (``ROLE: lesson rater``): would a careful student act differently after reading a lesson?
``specific`` lessons name a formula, a condition or a step of their kind of problem; ``generic`` ones would fit
any problem (be careful, check the work, use the right method). Used to prefer the specific one of candidates
that measured the same, and to count the generic lessons a run keeps (``tasks/specificity.py``)."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.quoting import DATA_NOTICE

SPECIFIC_EXAMPLES = (
    "To count the whole numbers from a to b with both ends included, compute b - a + 1.",
    "When a price falls, divide the decrease by the original price, not by the new one.",
    "When converting square units, multiply by the square of the length factor, not the factor itself.",
)
GENERIC_EXAMPLES = (
    "Always ensure you use the correct mathematical formula or method for solving a problem.",
    "If unsure, refer to reliable sources or ask for assistance.",
    "Break the problem into smaller parts and check each step carefully before answering.",
)

RATER_SYSTEM = (
    """ROLE: lesson rater
You judge one lesson meant for a {domain} solver: would a careful student, about to solve a problem of the kind
the lesson names, do anything differently after reading it? A lesson is "specific" when it names a formula, a
condition, a quantity or a step that belongs to its kind of problem. It is "generic" when it would fit any problem
at all: advice to be careful, to check, to use the correct method or formula without saying which, to think step
by step, to look things up.
"""
    + DATA_NOTICE
    + """
Specific lessons, for example:
{specific}
Generic lessons, for example:
{generic}
Reply with one JSON object and nothing else: {{"verdict": "specific" or "generic", "reason": "one short sentence"}}."""
)

RATER_USER = """Lesson:
{lesson}"""


def rater_messages(domain: str, lesson: str) -> list[Message]:
    system = RATER_SYSTEM.format(
        domain=domain,
        specific="\n".join(f"- {x}" for x in SPECIFIC_EXAMPLES),
        generic="\n".join(f"- {x}" for x in GENERIC_EXAMPLES),
    )
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": RATER_USER.format(lesson=quoting.quote("proposals", lesson))},
    ]
