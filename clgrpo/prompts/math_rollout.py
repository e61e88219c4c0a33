"""The math domain's wording: the solver's system message (answer in ``\\boxed{}``), the Python tool's
description, and the domain's description and example lessons for the learner prompts."""

from __future__ import annotations

from collections.abc import Sequence

from clgrpo.prompts import Message
from clgrpo.prompts.quoting import DATA_NOTICE
from clgrpo.prompts.rollout import ShownExample, rollout_conversation
from schemas.records import Problem

ROLLOUT_SYSTEM = (
    "You are a careful competition mathematician. Work out each problem step by step, "
    "check intermediate results before relying on them, and give exactly one final answer. "
    "When you are done, write the final answer on its own at the end, inside \\boxed{} (for example \\boxed{42}).\n"
    + DATA_NOTICE
)

DOMAIN = "mathematics"  # how the learner prompts name the domain (not "competition": word problems too)

# shown to the learner as its example reply: concrete lessons of this domain (never placeholders to copy)
EXAMPLE_LESSONS = (
    "When counting arrangements with a restriction, count all arrangements first and subtract the ones that "
    "break the restriction.",
    "When a problem asks for a remainder, reduce every intermediate result modulo the divisor before going on.",
)

PYTHON_DESCRIPTION = (
    "Run Python 3 code in a fresh interpreter that keeps its variables between your calls in this attempt. "
    "Print what you want to see (the value of a last bare expression is shown too). The standard library, "
    "sympy and numpy are available; there is no network and no access to files outside the working directory."
)


def rollout_messages(
    problem: Problem, library_text: str, examples: Sequence[ShownExample] = (), form: str = "turns"
) -> list[Message]:
    return rollout_conversation(ROLLOUT_SYSTEM, problem.problem, library_text, examples, form)
