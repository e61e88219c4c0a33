"""Words for what the terminal and the logs say: a count with its noun in the right number."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 lesson``, ``2 lessons``, ``0 lessons``, ``38,778 tokens``; ``plural`` where adding an s is wrong
    (``1 process``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
