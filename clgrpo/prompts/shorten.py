"""The lesson shortener (``ROLE: lesson shortener``): a candidate lesson over the word limit, rewritten once in
fewer words with its meaning kept, instead of being dropped for its length (``tasks/shorten.py``)."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.quoting import DATA_NOTICE

SHORTEN_SYSTEM = (
    """ROLE: lesson shortener
You shorten lessons written for a {domain} solver. Keep what the lesson says: the kind of problem it is for, the
condition and what to do. Drop repetitions, examples, filler and anything the lesson says twice. Never add advice
of your own.
"""
    + DATA_NOTICE
    + """
Reply with one JSON object and nothing else: {{"lesson": "the shortened lesson"}}."""
)

SHORTEN_USER = """This lesson has {words} words. Rewrite it in {min_words} to {max_words} words.
{lesson}"""


def shorten_messages(domain: str, lesson: str, words: int, min_words: int, max_words: int) -> list[Message]:
    system = SHORTEN_SYSTEM.format(domain=domain)
    user = SHORTEN_USER.format(
        words=words, min_words=min_words, max_words=max_words, lesson=quoting.quote("proposals", lesson)
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
