"""What a lesson is, and the complete example replies the learner prompts show (extract, consolidate, repair).

A small model copies whatever it is shown, so an example reply is concrete (a domain's two example lessons, see
``math_rollout.EXAMPLE_LESSONS``), never placeholders to copy; a lesson copied from an example is rejected at
apply time (``domains.learner.LearnerPrompts.copied_from_prompt``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

LESSON_RULE = """A lesson is one general sentence of {min_words} to {max_words} words, in the form "When" + the kind of
problem or situation + what to do. It must help on other problems too: it never contains a problem's names,
numbers or answer, and it does not repeat a lesson the library already has."""

EXAMPLE_BLOCK = """
An example of a reply (about other attempts; write your own lessons):
{example}"""

DEFAULT_EXAMPLES = (
    "When a problem states several conditions, list each one and check the final answer against all of them.",
    "When a calculation has many steps, write each intermediate result down before using it in the next step.",
)


@dataclass(frozen=True)
class LessonAsk:
    """What every learner prompt of a run says the same way, built once per stage from the learning config and
    the domain (``domains.learner.LearnerPrompts.ask``) and passed whole: the domain's name and two example
    lessons, whether grades (ground truth) are shown, a lesson's length in words and how many edits one group
    may propose."""

    domain: str = "general"
    examples: tuple[str, str] = DEFAULT_EXAMPLES
    use_groundtruth: bool = True
    min_words: int = 5
    max_words: int = 32
    max_ops: int = 3


def example_reply(examples: tuple[str, str], *, sources: bool) -> str:
    """A complete, concrete operations reply, with the domain's example lessons."""
    first, second = examples
    if sources:
        ops = [
            {"op": "add", "text": first, "sources": ["p7", "p12"]},
            {"op": "modify", "ids": ["E2"], "text": second, "sources": ["p3"]},
        ]
    else:
        ops = [{"op": "add", "text": first}]
    return json.dumps({"operations": ops})


def example_block(examples: tuple[str, str], show: bool, *, sources: bool) -> str:
    """The example reply as a prompt block, or nothing (``show`` False: replies are constrained to the schema)."""
    return EXAMPLE_BLOCK.format(example=example_reply(examples, sources=sources)) if show else ""
