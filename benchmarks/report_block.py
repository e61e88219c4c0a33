"""Writing a benchmark's figures into benchmarks/REPORT.md: the block between its two markers is replaced, or
added at the end under its heading the first time. Nothing else of the report is touched."""

from __future__ import annotations

from pathlib import Path

REPORT = Path(__file__).resolve().parent / "REPORT.md"


def write_block(block: str, begin: str, end: str, heading: str, report: Path = REPORT) -> None:
    """``block`` with its markers (``begin`` ... ``end``) in place of the report's, or appended."""
    text = report.read_text()
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n{block}\n"
    report.write_text(text)
