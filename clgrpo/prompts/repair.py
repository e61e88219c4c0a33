"""The repair re-ask: after a learner reply that could not be used (no JSON, an invalid operation, cut off), the
same conversation, the bad reply, and a request to answer again (with the example reply when the first ask had
one)."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.lessons import example_block

REPAIR = """Your previous reply could not be used:
{error}
Reply again with JSON only, shorter if it ran out of room.{example_block}"""


def repair_messages(
    messages: list[Message],
    bad_reply: str,
    error: str,
    examples: tuple[str, str],
    *,
    show_example: bool = True,
    sources: bool = False,
) -> list[Message]:
    block = example_block(examples, show_example, sources=sources)
    return [
        *messages,
        {"role": "assistant", "content": bad_reply},
        {"role": "user", "content": REPAIR.format(error=quoting.quote("error", error), example_block=block)},
    ]
