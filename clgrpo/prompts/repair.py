"""The repair re-ask: after a learner reply that could not be used (no JSON, an invalid operation, cut off), the
same conversation, the bad reply, and a request to answer again (with the example reply when the first ask had
one)."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.lessons import LessonAsk, example_block

REPAIR = """Your previous reply could not be used:
{error}
Reply again with JSON only, shorter if it ran out of room.{example_block}"""


def repair_messages(
    ask: LessonAsk,
    messages: list[Message],
    bad_reply: str,
    error: str,
    *,
    show_example: bool = True,
    sources: bool = False,
) -> list[Message]:
    """The re-ask after an unusable reply (``show_example``: as the first ask had it; ``sources``: the example
    reply of the consolidator, whose edits name their groups)."""
    block = example_block(ask.examples, show_example, sources=sources)
    return [
        *messages,
        {"role": "assistant", "content": bad_reply},
        {"role": "user", "content": REPAIR.format(error=quoting.quote("error", error), example_block=block)},
    ]
