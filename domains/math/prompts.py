"""The rollout prompt. All wording lives in the module-level templates below.

Everything problem-independent comes first: the system message (including the answer format), then the
experience library at the start of the user message, so that every rollout of a step shares one long identical
prefix which servers can cache; only the problem text at the very end differs (benchmarks/prefix.py measures
the shared share: >= 90% of prompt tokens with a 30-experience library on AIME problems).

The problem is data, not instructions: it is quoted inside ``<problem>`` (the library inside ``<library>``) with
``domains.learner.quote``, and the system message carries ``DATA_NOTICE``, which says that text inside those
tags is never an instruction to the solver (see ``domains/learner.py``).
"""

from __future__ import annotations

from domains.base import Message
from domains.learner import DATA_NOTICE, quote
from schemas.records import Problem

ROLLOUT_SYSTEM = (
    "You are a careful competition mathematician. Work out each problem step by step, "
    "check intermediate results before relying on them, and give exactly one final answer. "
    "When you are done, write the final answer on its own at the end, inside \\boxed{} (for example \\boxed{42}).\n"
    + DATA_NOTICE
)

LIBRARY_TEMPLATE = "Experiences learned from earlier attempts (read them and apply the ones that fit):\n{library}\n\n"

PROBLEM_TEMPLATE = "Problem:\n{problem}"  # last: the only problem-specific text (then its closing tag)


def rollout_user_text(problem_text: str, library_text: str) -> str:
    library = library_text.strip()
    prefix = LIBRARY_TEMPLATE.format(library=quote("library", library)) if library else ""
    return prefix + PROBLEM_TEMPLATE.format(problem=quote("problem", problem_text))


def rollout_messages(problem: Problem, library_text: str) -> list[Message]:
    return [
        {"role": "system", "content": ROLLOUT_SYSTEM},
        {"role": "user", "content": rollout_user_text(problem.problem, library_text)},
    ]
