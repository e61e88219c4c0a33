"""PNG plots of a run and of an evaluation, rendered with matplotlib's Agg canvas.

No pyplot: each plot is a standalone ``Figure`` (no global backend or figure state, safe in worker threads).
Every function returns the PNG bytes; ``write_png`` puts them in a file.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn (a third of a second a run need not wait for)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SIZE = (7.0, 3.6)
_DPI = 110


@dataclass(frozen=True)
class Series:
    """y per step, with an optional confidence band."""

    label: str
    steps: Sequence[int]
    values: Sequence[float]
    low: Sequence[float] | None = None
    high: Sequence[float] | None = None


@dataclass(frozen=True)
class ConditionPoint:
    label: str
    value: float
    low: float
    high: float


def _figure() -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=_SIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _empty_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def accuracy_plot(series: Sequence[Series], *, title: str = "Accuracy per step") -> bytes:
    """Lines with error bars (the confidence intervals) per step, e.g. training accuracy and held-out Mean@k."""
    fig = _figure()
    ax = fig.add_subplot()
    for s in series:
        if not s.steps:
            continue
        if s.low is not None and s.high is not None:
            below = [max(0.0, v - lo) for v, lo in zip(s.values, s.low)]
            above = [max(0.0, hi - v) for v, hi in zip(s.values, s.high)]
            ax.errorbar(s.steps, s.values, yerr=[below, above], marker="o", capsize=4, label=s.label)
        else:
            ax.plot(s.steps, s.values, marker="o", label=s.label)
    if not any(s.steps for s in series):
        _empty_note(ax, "no steps yet")
    ax.set(xlabel="step", ylabel="accuracy", title=title, ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    if any(s.steps for s in series):
        ax.legend(loc="best", fontsize="small")
    _integer_steps(ax)
    return _png(fig)


def library_size_plot(steps: Sequence[int], sizes: Sequence[int]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    if steps:
        ax.step(steps, sizes, where="post", marker="o")
    else:
        _empty_note(ax, "no library versions")
    ax.set(xlabel="step", ylabel="experiences", title="Library size per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _integer_steps(ax, y=True)
    return _png(fig)


def cost_plot(
    steps: Sequence[int],
    tokens_in: Sequence[int],
    tokens_out: Sequence[int],
    cost_usd: Sequence[float],
    validation_tokens: Sequence[int] | None = None,
) -> bytes:
    """Stacked tokens per step (training in, training out, held-out validation) as bars, cost (USD) of all
    calls on a second axis."""
    fig = _figure()
    ax = fig.add_subplot()
    if steps:
        ax.bar(steps, tokens_in, label="training tokens in", color="#4c72b0")
        ax.bar(steps, tokens_out, bottom=tokens_in, label="training tokens out", color="#dd8452")
        if validation_tokens is not None and any(validation_tokens):
            bottom = [i + o for i, o in zip(tokens_in, tokens_out)]
            ax.bar(steps, validation_tokens, bottom=bottom, label="validation tokens", color="#8c8c8c", hatch="//")
        cost_ax = ax.twinx()
        cost_ax.plot(steps, cost_usd, color="black", marker="o", label="cost (USD)")
        cost_ax.set_ylabel("cost (USD)")
        cost_ax.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()[0] + cost_ax.get_legend_handles_labels()[0]
        ax.legend(
            handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize="small", frameon=False
        )
    else:
        _empty_note(ax, "no LLM calls")
    ax.set(xlabel="step", ylabel="tokens", title="Tokens and cost per step")
    _integer_steps(ax)
    return _png(fig)


def conditions_plot(metric_label: str, points: Sequence[ConditionPoint], *, title: str | None = None) -> bytes:
    """One point with its confidence interval per condition (library)."""
    fig = _figure()
    ax = fig.add_subplot()
    xs = list(range(len(points)))
    below = [max(0.0, p.value - p.low) for p in points]
    above = [max(0.0, p.high - p.value) for p in points]
    ax.errorbar(xs, [p.value for p in points], yerr=[below, above], fmt="o", capsize=6, markersize=7)
    for x, p in zip(xs, points):
        ax.annotate(f"{p.value:.3f}", (x, p.value), textcoords="offset points", xytext=(10, 0), va="center")
    ax.set_xticks(xs, [p.label for p in points])
    ax.set(ylabel=metric_label, title=title or f"{metric_label} by condition", ylim=(-0.02, 1.02))
    ax.set_xlim(-0.6, len(points) - 0.4)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def _integer_steps(ax: Axes, *, y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def write_png(data: bytes, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def data_uri(data: bytes) -> str:
    """A PNG as a ``data:`` URI: embeds the image in HTML and in Prefect image artifacts."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")
