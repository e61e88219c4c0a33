"""The worked-example writer (``ROLE: worked-example writer``): STaR's rationalization (arXiv 2203.14465). For a
problem no attempt of its group solved, the learner is shown the solver's own prompt and the reference answer and
writes the solution a careful solver would write; it is kept as a worked example only if the verifier accepts its
final answer (``tasks.rationalize``)."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting

RATIONALIZE_ROLE = "ROLE: worked-example writer\n"

RATIONALIZE_NOTE = """

Besides the problem you are shown its correct final answer, for you only. Write the
short solution a careful solver would write for someone learning to solve problems of this kind: the few steps that
lead to that answer, in order, in plain sentences (no headings, no lists), then the final answer in the form asked
above. Derive the answer; do not mention that it was given to you and do not start from it. At most {max_words}
words."""

RATIONALIZE_ANSWER = """

The correct final answer (for you only: derive it, never cite it):
{answer}"""


def rationalize_messages(solver: list[Message], answer: str, max_words: int) -> list[Message]:
    """The solver's messages (the domain's rollout prompt without a library) with the writer's role around the
    system message and the reference answer after the problem."""
    system, *rest = solver
    *before, last = rest
    reference = RATIONALIZE_ANSWER.format(answer=quoting.quote("answer", answer))
    return [
        {
            "role": "system",
            "content": RATIONALIZE_ROLE + system["content"] + RATIONALIZE_NOTE.format(max_words=max_words),
        },
        *before,
        {"role": "user", "content": last["content"] + reference},
    ]
