"""The rollout prompt. All wording lives in the module-level templates below.

The experience library comes first in the user message so that every rollout of a step shares one long
identical prefix (system message + library), which servers can cache; only the problem text differs.
"""

from __future__ import annotations

from domains.base import Message
from schemas.records import Problem

ROLLOUT_SYSTEM = (
    "You are a careful competition mathematician. Work out each problem step by step, "
    "check intermediate results before relying on them, and give exactly one final answer."
)

LIBRARY_TEMPLATE = (
    "Experiences learned from earlier attempts (read them and apply the ones that fit):\n"
    "{library}\n\n"
)

PROBLEM_TEMPLATE = (
    "Problem:\n"
    "{problem}\n\n"
    "Reason through the problem step by step. When you are done, write the final answer on its own "
    "at the end, inside \\boxed{{}} (for example \\boxed{{42}})."
)


def rollout_user_text(problem_text: str, library_text: str) -> str:
    library = library_text.strip()
    prefix = LIBRARY_TEMPLATE.format(library=library) if library else ""
    return prefix + PROBLEM_TEMPLATE.format(problem=problem_text)


def rollout_messages(problem: Problem, library_text: str) -> list[Message]:
    return [
        {"role": "system", "content": ROLLOUT_SYSTEM},
        {"role": "user", "content": rollout_user_text(problem.problem, library_text)},
    ]
