"""The layout every domain's rollout prompt shares (the solver's user message).

Everything problem-independent comes first: the system message (the domain's, with the answer format and
``DATA_NOTICE``), then the experience library at the start of the user message, so that every rollout of a step
shares one long identical prefix which servers can cache; only the problem text at the very end differs
(benchmarks/prefix.py measures the shared share: >= 90% of prompt tokens with a 30-experience library on AIME
problems). The problem is data, not instructions: it is quoted inside ``<problem>`` (the library inside
``<library>``) with ``quoting.quote``.

Worked examples (library items that are solved training problems) are shown one of two ways
(``library.examples_as``): ``turns``, each an earlier exchange of the conversation (the example's problem asked
as a problem is, its solution as the assistant's reply) before the real problem; or ``block``, inside the
``<library>`` block after the lessons, each as "Solved example: Problem ... Solution ...".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clgrpo.prompts import Message, quoting

LIBRARY_TEMPLATE = "Experiences learned from earlier attempts (read them and apply the ones that fit):\n{library}\n\n"

PROBLEM_TEMPLATE = "Problem:\n{problem}"  # last: the only problem-specific text (then its closing tag)


def rollout_user_text(problem_text: str, library_text: str) -> str:
    library = library_text.strip()
    prefix = LIBRARY_TEMPLATE.format(library=quoting.quote("library", library)) if library else ""
    return prefix + PROBLEM_TEMPLATE.format(problem=quoting.quote("problem", problem_text))


EXAMPLE_TEMPLATE = "Solved example {number}.\nProblem: {problem}\nSolution: {solution}"


@dataclass(frozen=True)
class ShownExample:
    """A worked example as a rollout prompt shows it: a solved problem."""

    problem: str
    solution: str


def rollout_conversation(
    system: str, problem_text: str, library_text: str, examples: Sequence[ShownExample] = (), form: str = "turns"
) -> list[Message]:
    """The solver's messages: the system message, the worked examples (as earlier ``turns``, or as a ``block``
    in the library), then the lessons and the problem."""
    if form == "block" and examples:
        solved = "\n\n".join(
            EXAMPLE_TEMPLATE.format(number=i + 1, problem=e.problem.strip(), solution=e.solution.strip())
            for i, e in enumerate(examples)
        )
        library_text = f"{library_text.strip()}\n\n{solved}" if library_text.strip() else solved
        examples = ()
    messages: list[Message] = [{"role": "system", "content": system}]
    for example in examples:
        messages.append(
            {"role": "user", "content": PROBLEM_TEMPLATE.format(problem=quoting.quote("problem", example.problem))}
        )
        messages.append({"role": "assistant", "content": example.solution})
    messages.append({"role": "user", "content": rollout_user_text(problem_text, library_text)})
    return messages
