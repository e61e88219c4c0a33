"""The consolidator (``ROLE: library consolidator``): every group's proposals turned into one final, consistent
list of edits of the library (stage consolidate), each naming the groups it came from."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.attempts import library_block
from clgrpo.prompts.lessons import LESSON_RULE, LessonAsk, example_block
from clgrpo.prompts.quoting import DATA_NOTICE

CONSOLIDATE_SYSTEM = (
    """ROLE: library consolidator
You maintain a library of short, general lessons for solving {domain} problems. Groups of attempts proposed
edits of the library. Turn all proposals into one final, consistent list of edits:
- {{"op": "add", "text": a new lesson, "sources": [the ids of the groups that proposed it]}};
- {{"op": "modify", "ids": [one library id], "text": the improved lesson, "sources": [group ids]}};
- {{"op": "merge", "ids": [two or more library ids], "text": one lesson replacing them, "sources": [group ids]}};
- {{"op": "delete", "ids": [one library id]}} removes a wrong or useless lesson;
- {{"op": "keep", "ids": [one library id]}} leaves it as it is.
Combine proposals that say the same thing into one edit. Use only ids that exist in the current library, and
at most one edit per id.
"""
    + DATA_NOTICE
    + "\n"
    + LESSON_RULE
    + """
Reply with JSON only: {{"operations": [your edits]}}.{example_block}"""
)

CONSOLIDATE_USER = """Current library:
{library}

Proposals:
{proposals}

Task: turn these proposals into the final list of edits (JSON only)."""


def consolidate_messages(
    ask: LessonAsk, proposals_text: str, library_text: str, *, show_example: bool = True
) -> list[Message]:
    system = CONSOLIDATE_SYSTEM.format(
        domain=ask.domain,
        min_words=ask.min_words,
        max_words=ask.max_words,
        example_block=example_block(ask.examples, show_example, sources=True),
    )
    user = CONSOLIDATE_USER.format(
        library=library_block(library_text), proposals=quoting.quote("proposals", proposals_text)
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
