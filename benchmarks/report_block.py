"""Writing a benchmark's figures into benchmarks/REPORT.md or a companion file beside its results: the block
between its two markers is replaced, or added at the end under its heading the first time (the file too, if it
does not exist yet). Nothing else of the file is touched. Prose lines of a block are hard-wrapped at ``WIDTH``
characters (benchmarks/REPORT.md keeps every line within it; tests/test_report.py); tables, pictures, headings
and code are written as they come, so a writer keeps its tables narrow or writes them into a companion file."""

from __future__ import annotations

import re
from pathlib import Path

REPORT = Path(__file__).resolve().parent / "REPORT.md"
WIDTH = 120

# a word that would turn a wrapped line into something else in markdown if it started the line
_LEADING = re.compile(r"^(?:[-+*>|#=]+|\d+[.)])$")
_AS_IS = ("|", "![", "<!--", "#", "    ", "```")


def wrap_line(line: str, width: int = WIDTH) -> list[str]:
    """One prose line (a list item keeps its hanging indent) as lines of at most ``width`` characters, broken
    between words only (a longer word stays whole); no line starts with a word markdown would read as a list,
    a quote, a heading or a table row."""
    if len(line) <= width or line.startswith(_AS_IS):
        return [line]
    start = re.match(r"\s*(?:[-*+]|\d+[.)])\s+", line) or re.match(r"\s*", line)
    assert start is not None  # \s* matches anything
    first = start.group(0)
    indent = " " * len(first)
    lines: list[list[str]] = [[]]
    for word in line[len(first) :].split():
        current = lines[-1]
        if current and len(indent) + len(" ".join([*current, word])) > width:
            carried = [word]
            while _LEADING.match(carried[0]) and len(current) > 1:
                carried.insert(0, current.pop())  # break a word earlier: the risky word does not lead
            lines.append(carried)
        else:
            current.append(word)
    return [(first if i == 0 else indent) + " ".join(words) for i, words in enumerate(lines)]


def wrap(text: str, width: int = WIDTH) -> str:
    """Every prose line of ``text`` wrapped at ``width``; fenced code is left as it is."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
        else:
            out += [line] if fenced else wrap_line(line, width)
    return "\n".join(out)


def write_block(block: str, begin: str, end: str, heading: str, report: Path = REPORT) -> None:
    """``block`` with its markers (``begin`` ... ``end``), its prose wrapped, in place of the file's, or
    appended (a new file starts with ``heading`` as its title)."""
    block = wrap(block)
    if not report.exists():
        report.write_text(f"# {heading}\n\n{block}\n")
        return
    text = report.read_text()
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n{block}\n"
    report.write_text(text)
