"""The promotion gate of a nightly refresh: the overall gain, and no regression on any task tag.

The evaluation compares baseline and candidate over all held-out problems and over each task tag's problems
(``Problem.tag``; ``tasks.evaluate.compare_by_tag``). The gate turns the comparisons of the refresh's metric
into one row per tag plus the overall row, each with a verdict:

- overall: ``pass`` when the lower bound of the gain's CI is above ``margin``, else ``fail``;
- a tag with at least ``min_tag_problems`` held-out problems: ``fail`` when the upper bound of its gain's CI is
  below ``-tag_margin`` (by default: the whole CI below 0, a regression the data shows), else ``pass``;
- a tag with fewer problems: ``not_gated``, reported only (too few problems for its CI to be trusted).

A candidate is promoted only when every row passes or is not gated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from schemas.records import EvalComparison, RefreshGateRow
from schemas.refresh_config import RefreshConfig

Verdict = Literal["pass", "fail", "not_gated"]
Table = tuple[list[str], list[list[str]]]


# --- the rules (pure) ----------------------------------------------------------------------------------------
def overall_passes(comparison: EvalComparison, margin: float) -> bool:
    return comparison.ci_low > margin


def tag_verdict(comparison: EvalComparison, tag_margin: float, min_tag_problems: int) -> Verdict:
    if comparison.n_problems < min_tag_problems:
        return "not_gated"
    return "fail" if comparison.ci_high < -tag_margin else "pass"


def _bound(value: float) -> str:
    return "0" if value == 0 else f"{value:+.3f}"


def describe_row(row: RefreshGateRow) -> str:
    """``0.620 -> 0.410, diff -0.210 [-0.330, -0.090] on 12 problems``."""
    return (
        f"{row.baseline_value:.3f} -> {row.candidate_value:.3f}, diff {row.diff:+.3f} "
        f"[{row.ci_low:+.3f}, {row.ci_high:+.3f}] on {row.n_problems} problems"
    )


def _tag_reason(verdict: Verdict, threshold: float, min_tag_problems: int) -> str:
    if verdict == "not_gated":
        return f"not gated: fewer than {min_tag_problems} held-out problems (min_tag_problems)"
    if verdict == "fail":
        return f"wholly below {_bound(threshold)}"
    return f"upper bound not below {_bound(threshold)}"


# --- the gate ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Promotion:
    """A refresh's promotion gate: its rows (the overall row first, then one per tag), each with its verdict."""

    rows: list[RefreshGateRow]  # the overall row first, then one per tag by name
    min_tag_problems: int

    @property
    def tags(self) -> list[RefreshGateRow]:
        return [r for r in self.rows if r.tag is not None]

    @property
    def failing_tags(self) -> list[RefreshGateRow]:
        return [r for r in self.tags if r.verdict == "fail"]

    @property
    def tags_pass(self) -> bool:
        return not self.failing_tags

    def reasons(self) -> list[str]:
        """What the tag rows add to a decision's reasons (nothing without tags): every failing tag with its
        numbers, the gated tags that held, the tags left out."""
        gated = [r for r in self.tags if r.verdict != "not_gated"]
        skipped = [r for r in self.tags if r.verdict == "not_gated"]
        out = []
        if self.failing_tags:
            names = ", ".join(r.tag or "" for r in self.failing_tags)
            out.append(
                f"per-tag gate: {len(self.failing_tags)} of {len(gated)} gated tag(s) regressed ({names}): not promoted"
            )
            out += [f"tag {r.tag}: {describe_row(r)}: {r.reason}" for r in self.failing_tags]
        elif gated:
            out.append(
                f"per-tag gate: none of {len(gated)} gated tag(s) regressed ({', '.join(r.tag or '' for r in gated)})"
            )
        if skipped:
            counts = ", ".join(f"{r.tag} ({r.n_problems})" for r in skipped)
            out.append(
                f"tags not gated, fewer than {self.min_tag_problems} held-out problems each (min_tag_problems): "
                f"{counts}"
            )
        return out


@dataclass(frozen=True)
class Assessment:
    """A library against the baseline on the held-out set (the candidate, or the library a review leaves when it
    is not the candidate as proposed): whether it passes the overall rule and the per-tag gate, the reasons in
    words, and the decision's numbers."""

    passed: bool
    reasons: list[str]  # the library's numbers and the gate's verdict, in words
    fields: dict[str, Any]  # the decision's numbers for the library (eval_id, values, diff, CI)


def gate_row(
    refresh_id: str, comparison: EvalComparison, threshold: float, verdict: Verdict, reason: str
) -> RefreshGateRow:
    c = comparison
    return RefreshGateRow(
        refresh_id=refresh_id,
        tag=c.tag,
        metric=c.metric,
        n_problems=c.n_problems,
        baseline_value=c.baseline_value,
        candidate_value=c.candidate_value,
        diff=c.diff,
        ci_low=c.ci_low,
        ci_high=c.ci_high,
        ci_level=c.ci_level,
        threshold=threshold,
        verdict=verdict,
        reason=reason,
    )


def promotion_gate(refresh_id: str, comparisons: Sequence[EvalComparison], config: RefreshConfig) -> Promotion:
    """The gate over the comparisons (baseline -> candidate) of the refresh's metric: overall and per tag."""
    chosen = [c for c in comparisons if c.metric == config.metric]
    overall = next(c for c in chosen if c.tag is None)
    passed = overall_passes(overall, config.margin)
    rows = [
        gate_row(
            refresh_id,
            overall,
            config.margin,
            "pass" if passed else "fail",
            f"lower bound {'above' if passed else 'not above'} the margin {config.margin:+.3f}",
        )
    ]
    for c in sorted((c for c in chosen if c.tag is not None), key=lambda c: c.tag or ""):
        verdict = tag_verdict(c, config.tag_margin, config.min_tag_problems)
        threshold = -config.tag_margin + 0.0  # never -0.0
        rows.append(
            gate_row(refresh_id, c, threshold, verdict, _tag_reason(verdict, threshold, config.min_tag_problems))
        )
    return Promotion(rows, config.min_tag_problems)


# --- reporting -------------------------------------------------------------------------------------------------
def gate_table(rows: Sequence[RefreshGateRow]) -> Table:
    """The gate as a table (the overall row is tag ``all``)."""
    headers = ["tag", "problems", "before", "after", "diff [CI]", "verdict", "why"]
    body = [
        [
            r.tag or "all",
            str(r.n_problems),
            f"{r.baseline_value:.3f}",
            f"{r.candidate_value:.3f}",
            f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]",
            r.verdict,
            r.reason,
        ]
        for r in rows
    ]
    return headers, body


def failing_summary(rows: Sequence[RefreshGateRow]) -> str:
    """``geometry -0.210 [-0.330, -0.090], ...``: the failing tags in one line ("" when none)."""
    return ", ".join(
        f"{r.tag} {r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
        for r in rows
        if r.tag is not None and r.verdict == "fail"
    )
