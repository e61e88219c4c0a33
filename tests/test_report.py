"""benchmarks/REPORT.md stays a report a user reads: at most 500 lines of at most 120 characters, and every
relative link in it and in its companion files (beside the results, DETAILS.md) resolves, anchors included. The
scripts that write into it keep to those limits: prose is wrapped as it is written, tables are narrow, and the
long tables go into the companion files."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
REPORT = BENCH / "REPORT.md"
PAGES = [REPORT, BENCH / "DETAILS.md", *sorted(BENCH.glob("*_runs/REPORT.md"))]
MAX_LINES, WIDTH = 500, 120


def load(name: str):
    """A benchmark script as a module (they import their siblings from benchmarks/)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_report_is_at_most_500_lines_of_at_most_120_characters():
    lines = REPORT.read_text().splitlines()
    assert len(lines) <= MAX_LINES
    assert [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > WIDTH] == []


# --- links -----------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"\]\(([^)\s]+)\)")  # links and pictures
_REFERENCE = re.compile(r"^\[[^\]]+\]:\s*(\S+)", re.M)  # [name]: target


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text()), re.M):
        s = slug(heading)
        found.add(s if not seen[s] else f"{s}-{seen[s]}")  # a repeated heading gets -1, -2, ...
        seen[s] += 1
    return found


def links(text: str) -> list[str]:
    prose = _CODE.sub("", _FENCE.sub("", text))
    return _INLINE.findall(prose) + _REFERENCE.findall(prose)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_every_relative_link_resolves_to_a_file_and_its_heading(page):
    broken = []
    for target in links(page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: broken links"


def test_the_report_links_every_companion_file():
    targets = {t.partition("#")[0] for t in links(REPORT.read_text())}
    assert {p.relative_to(BENCH).as_posix() for p in PAGES[1:]} <= targets


def test_the_link_finder_sees_links_and_anchors_but_not_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A title: the `x` of it's 1,000\n\nsee [b](b.md#part) and ![p](p.png) but not `[c](c.md)`\n\n"
        "```bash\n[d](d.md)\n```\n\n[ref]: #a-title-the-x-of-its-1000\n"
    )
    assert links(page.read_text()) == ["b.md#part", "p.png", "#a-title-the-x-of-its-1000"]
    assert anchors(page) == {"a-title-the-x-of-its-1000"}


# --- the writers -----------------------------------------------------------------------------------------------
def test_a_block_is_written_with_its_prose_wrapped_and_a_new_file_is_started(tmp_path):
    report_block = load("report_block")
    prose = "learned - none and learned - placebo " * 8 + "- item"
    table = "| " + " | ".join(["a column"] * 20) + " |"
    block = f"<!-- x:begin -->\n{prose}\n\n- {prose}\n\n{table}\n<!-- x:end -->"
    companion = tmp_path / "runs" / "REPORT.md"
    companion.parent.mkdir()
    report_block.write_block(block, "<!-- x:begin -->", "<!-- x:end -->", "X: every run", companion)
    text = companion.read_text()
    assert text.startswith("# X: every run\n\n<!-- x:begin -->")
    lines = text.splitlines()
    assert table in lines  # a table is written as it comes
    prose_lines = [line for line in lines if line and line[0] not in "|<#"]
    assert all(len(line) <= WIDTH for line in prose_lines) and len(prose_lines) > 3
    assert len([line for line in prose_lines if line.startswith("- ")]) == 1  # the list item; no other line
    assert not any(re.match(r"\s+[-|] ", line) for line in prose_lines)  # nor a continuation of it
    assert " ".join(" ".join(lines).split()).count(prose.strip()) == 2  # the words, in order, none lost
    report_block.write_block(block.replace("a column", "b"), "<!-- x:begin -->", "<!-- x:end -->", "X", companion)
    assert companion.read_text().count("x:begin") == 1 and "| b |" in companion.read_text()


def test_a_wrapped_line_never_starts_with_what_markdown_reads_as_a_list_or_a_table():
    report_block = load("report_block")
    for width in range(30, 60):
        line = "- a list item: x - y | z + 1. w > v # u " * 6
        for wrapped in report_block.wrap_line(line, width)[1:]:
            assert wrapped.startswith("  ") and not re.match(r"\s*([-+*>|#]|\d+[.)])\s", wrapped), (width, wrapped)


def interval(value: float) -> dict:
    return {"value": value, "low": value - 0.456, "high": value + 0.789}


def test_the_learning_summary_fits_the_report_with_thirteen_families_and_the_widest_cells():
    bench = load("learning")
    families = ["ranges", "percent", "units", "shares", "durations", "boxes", "handshakes", "average", "arithmetic"]
    families += ["workers", "speeds", *bench.HELD_BACK]
    results: list[dict] = []
    for family, learner in [(f, "qwen2.5-coder-1.5b") for f in families] + [(f, "same") for f in families[:3]]:
        seeds: list[dict] = [{"lessons": ["Add one."], "learned_minus_none": interval(v)} for v in (0.0, 0.0, -0.1)]
        pooled = {k: interval(-0.123) for k in ("learned_minus_none", "learned_minus_placebo", "learned_minus_kshot")}
        results.append({"family": family, "learner": learner, "pooled": pooled, "seeds": seeds})
    results[0]["pooled"]["learned_minus_none"] = interval(0.5)  # a gain carried by one seed: the longest verdict
    results[0]["pooled"]["learned_minus_placebo"] = interval(0.5)
    results[0]["seeds"][2]["learned_minus_none"] = interval(0.9)
    for x in results[1]["seeds"]:
        x["lessons"] = []
    assert [bench.verdict(r) for r in results[:3]] == ["gain carried by one seed", "no lesson kept (no harm)", "HARM"]
    text = report_block_wrap(bench.summary(results))
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(results) and len(lines) <= len(results) + 12  # a table and a few lines
    assert any(row.startswith(f"| {bench.HELD_BACK[0]}* | 1.5B |") for row in rows)
    assert "[learning_runs/REPORT.md](learning_runs/REPORT.md)" in text and "(plots/learning-glance.png)" in text
    assert bench.DETAILS == BENCH / "learning_runs" / "REPORT.md"  # every figure goes beside the kept results


def report_block_wrap(text: str) -> str:
    return load("report_block").wrap(text)


def test_the_saturation_and_shared_prompts_blocks_fit_the_report_from_their_stored_runs():
    saturation = load("saturation")
    figures = json.loads((BENCH / "saturation_runs" / "after-learner-4-slots.json").read_text())
    shared = load("shared_prompts")
    names = sorted(p.name for p in (BENCH / "shared_prompts_runs").glob("*.json"))
    stored = [json.loads((BENCH / "shared_prompts_runs" / name).read_text()) for name in names]
    runs = [r for s in stored for r in s["runs"]]
    for block in (saturation.report_text(figures), shared.report_block(runs, stored[0]["cpu"], names)):
        wide = [line for line in report_block_wrap(block).splitlines() if len(line) > WIDTH]
        assert wide == []
    every_run = shared.runs_block(runs, stored[0]["cpu"], names)  # the long table: beside the runs, not in REPORT.md
    assert every_run.count("\n| ") == 2 * len(runs) + 1 and shared.RUNS_REPORT.parent == shared.RUNS
    assert shared.report_block(runs, stored[0]["cpu"], names).count("\n| ") < 12
