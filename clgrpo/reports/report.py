"""Learning reports of a training run: per-step numbers with their confidence intervals, plots, the final
library and what changed since the first version.

``collect_run`` reads everything from the store (read-only is enough), ``run_plots`` renders the PNGs,
``render_html`` (self-contained: images embedded as base64) and ``render_markdown`` (images as files next to
it) turn them into a document; ``write_report`` does all of it for ``clgrpo report RUN_ID``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from clgrpo.experience import usefulness
from clgrpo.experience.library import ExperienceLibrary, diff, item_text
from clgrpo.experience.usefulness import describe_stat
from clgrpo.process.words import counted
from clgrpo.reports import plots
from clgrpo.reports.metrics import Estimate, bootstrap_ci, paired_difference
from clgrpo.storage.store import Store
from schemas.config import RunConfig
from schemas.records import (
    EvalComparison,
    EvalSample,
    EvalSummary,
    ExperienceStat,
    LibraryHead,
    LibraryQuality,
    LLMCall,
    OperationResult,
    Reward,
    Rollout,
)
from schemas.stages import Stage

Gain = tuple[int, int, Estimate]  # first validated step, last validated step, paired Mean@k difference
PLOT_FILES = {"accuracy": "accuracy.png", "library_size": "library_size.png", "cost": "tokens_cost.png"}


@dataclass(frozen=True)
class StepRow:
    step: int
    train_accuracy: Estimate | None  # mean reward of the step's training rollouts (None at step 0)
    heldout_mean: Estimate | None  # held-out Mean@k when the step was validated
    heldout_pass: Estimate | None
    library_size: int
    operations_applied: int
    operations_rejected: int
    tokens_in: int  # training calls of the step
    tokens_out: int
    cost_usd: float
    validation_tokens: int  # held-out validation calls of the step (in + out)
    validation_cost_usd: float
    tool_use: str = ""  # agent runs: turns and tool calls per rollout, share of tool calls that failed


@dataclass
class Evaluation:
    eval_id: str
    summaries: list[EvalSummary]
    comparisons: list[EvalComparison] = field(default_factory=list)


@dataclass
class RunData:
    run_id: str
    config: RunConfig
    steps: list[StepRow]
    validation: list[EvalSummary]
    first: ExperienceLibrary
    last: ExperienceLibrary
    evaluations: list[Evaluation] = field(default_factory=list)  # standalone evaluations of this run's libraries
    stats: dict[str, ExperienceStat] = field(default_factory=dict)  # usefulness of the last version's lessons
    quality: list[LibraryQuality] = field(default_factory=list)  # per step: the library version as a whole


# --- collecting ---------------------------------------------------------------------------------------
def _training_accuracy(rewards: pd.DataFrame, ci_seed: int) -> dict[int, Estimate]:
    """Per step: mean reward with a bootstrap CI over the step's problems."""
    out = {}
    for step, group in rewards.groupby("step"):
        per_problem = group.groupby("problem_id")["reward"].mean().to_numpy()
        out[int(step)] = bootstrap_ci(per_problem[:, None], n_boot=1000, seed=ci_seed)
    return out


def _library_sizes(store: Store, run_id: str) -> dict[int, int]:
    """Library size at the end of each step (the last version saved at that step)."""
    versions = store.frame(LibraryHead, run_id).sort_values("version")
    return {int(r.step): int(r.n_experiences) for r in versions.itertuples()}


def _sum_by_step(frame: pd.DataFrame, column: str) -> dict[int, float]:
    return {int(k): float(v) for k, v in frame.groupby("step")[column].sum().items()} if len(frame) else {}


def _tool_use(rollouts: pd.DataFrame) -> dict[int, str]:
    """Per step of an agent run: mean turns and tool calls per rollout, and the tool calls' error share."""
    if not len(rollouts) or "tool_calls" not in rollouts or not rollouts["tool_calls"].fillna(0).any():
        return {}
    out = {}
    for step, group in rollouts.groupby("step"):
        calls, errors = int(group["tool_calls"].fillna(0).sum()), int(group["tool_errors"].fillna(0).sum())
        out[int(step)] = (
            f"{group['n_turns'].fillna(1).mean():.1f} turns, {calls / len(group):.1f} tool calls "
            f"({errors / max(1, calls):.0%} errors)"
        )
    return out


def collect_run(store: Store, run_id: str) -> RunData:
    config = store.run_config(run_id)
    accuracy = _training_accuracy(store.frame(Reward, run_id), config.seed)
    # a run's own evaluations are its validations (standalone evaluations are keyed by their own id);
    # records and frame come from the same ordered query, so the frame gives each record's step
    validation = store.records(EvalSummary, run_id)
    heldout = {int(step): v for step, v in zip(store.frame(EvalSummary, run_id)["step"], validation)}
    sizes = _library_sizes(store, run_id)
    ops = store.frame(OperationResult, run_id)
    calls = store.frame(LLMCall, run_id)
    is_validation = calls["stage"] == Stage.VALIDATE
    train_calls = calls[~is_validation]
    val_calls = calls.assign(tokens=calls["tokens_in"] + calls["tokens_out"])[is_validation]
    steps = sorted(set(accuracy) | set(heldout) | set(sizes))
    tokens_in, tokens_out = _sum_by_step(train_calls, "tokens_in"), _sum_by_step(train_calls, "tokens_out")
    cost, val_cost = _sum_by_step(train_calls, "cost_usd"), _sum_by_step(val_calls, "cost_usd")
    val_tokens = _sum_by_step(val_calls, "tokens")
    applied = _sum_by_step(ops.assign(n=ops["status"] == "applied"), "n") if len(ops) else {}
    rejected = _sum_by_step(ops.assign(n=ops["status"] == "rejected"), "n") if len(ops) else {}
    tool_use = _tool_use(store.frame(Rollout, run_id))
    rows, size = [], 0
    for step in steps:
        size = sizes.get(step, size)
        v = heldout.get(step)
        rows.append(
            StepRow(
                step=step,
                train_accuracy=accuracy.get(step),
                heldout_mean=Estimate(v.mean_at_k, v.mean_ci_low, v.mean_ci_high, v.ci_level) if v else None,
                heldout_pass=Estimate(v.pass_at_k, v.pass_ci_low, v.pass_ci_high, v.ci_level) if v else None,
                library_size=size,
                operations_applied=int(applied.get(step, 0)),
                operations_rejected=int(rejected.get(step, 0)),
                tokens_in=int(tokens_in.get(step, 0)),
                tokens_out=int(tokens_out.get(step, 0)),
                cost_usd=cost.get(step, 0.0),
                validation_tokens=int(val_tokens.get(step, 0)),
                validation_cost_usd=val_cost.get(step, 0.0),
                tool_use=tool_use.get(step, ""),
            )
        )
    versions = store.library_versions(run_id)
    first = store.load_library(run_id, versions[0]) if versions else ExperienceLibrary()
    last = store.load_library(run_id, versions[-1]) if versions else ExperienceLibrary()
    evaluations = [
        Evaluation(eid, store.records(EvalSummary, eid), store.records(EvalComparison, eid))
        for eid in store.evaluations_of(run_id)
    ]
    stats = (
        {s.exp_id: s for s in store.records(ExperienceStat, run_id, last.step)}
        if versions and usefulness.measured(config)
        else {}  # without summaries nothing is cited: no usefulness column rather than "never cited" everywhere
    )
    return RunData(
        run_id, config, rows, validation, first, last, evaluations, stats, store.records(LibraryQuality, run_id)
    )


def heldout_gain(store: Store, run_id: str, data: RunData) -> Gain | None:
    """Paired held-out Mean@k difference between the first and the last validated step (same problems and
    sample seeds), or None with fewer than two validations."""
    validated = [r.step for r in data.steps if r.heldout_mean is not None]
    if len(validated) < 2:
        return None
    results = store.frame(EvalSample, run_id, stage=Stage.VALIDATE)
    first, last = validated[0], validated[-1]
    matrices = [
        results[results["step"] == s].pivot(index="problem_id", columns="sample_idx", values="reward")
        for s in (first, last)
    ]
    shared = matrices[0].index.intersection(matrices[1].index)
    a, b = (m.loc[shared].to_numpy() for m in matrices)
    if len(shared) == 0 or a.shape != b.shape or np.isnan(a).any() or np.isnan(b).any():
        return None
    cfg = data.config.validation
    if cfg is None:
        return first, last, paired_difference(a, b)
    return first, last, paired_difference(a, b, n_boot=cfg.bootstrap_samples, seed=cfg.seed, level=cfg.ci_level)


# --- tables (shared by the HTML and markdown renderers) ----------------------------------------------------
Table = tuple[list[str], list[list[str]]]


def _fmt(e: Estimate | None, signed: bool = False) -> str:
    return e.format(3, signed) if e is not None else ""


def step_table(data: RunData) -> Table:
    v = data.config.validation
    mean_k, pass_k = (v.k, v.pass_at) if v else ("k", "k")
    headers = [
        "step",
        "train accuracy [95% CI]",
        f"held-out Mean@{mean_k} [CI]",
        f"held-out Pass@{pass_k} [CI]",
        "library",
        "ops +/-",
        "train tokens in/out",
        "validation tokens",
        "cost $ train/validation",
    ]
    rows = [
        [
            str(r.step),
            _fmt(r.train_accuracy),
            _fmt(r.heldout_mean),
            _fmt(r.heldout_pass),
            str(r.library_size),
            f"{r.operations_applied}/{r.operations_rejected}",
            f"{r.tokens_in}/{r.tokens_out}",
            str(r.validation_tokens),
            f"{r.cost_usd:.4f}/{r.validation_cost_usd:.4f}",
        ]
        for r in data.steps
    ]
    if any(r.tool_use for r in data.steps):  # agent runs: how the rollouts used their tools
        headers.append("per rollout (agent)")
        for row, r in zip(rows, data.steps):
            row.append(r.tool_use or "-")
    return headers, rows


def quality_table(data: RunData) -> Table:
    """Per step (version N is the library after step N): what ``clgrpo.experience.quality`` measures."""

    def share(value: float | None) -> str:
        return "" if value is None else f"{value:.0%}"

    headers = [
        "version",
        "lessons",
        "tokens",
        "near-duplicates (ratio)",
        "mean confidence",
        "never cited",
        "coverage (of summarized problems)",
        "churn +added ~modified -deleted",
        "evicted",
    ]
    rows = [
        [
            str(q.version),
            str(q.size),
            str(q.tokens),
            f"{q.near_duplicates} ({q.duplicate_ratio:.0%})",
            "" if q.mean_confidence is None else f"{q.mean_confidence:.2f}",
            share(q.never_cited_share),
            f"{share(q.coverage)} of {q.coverage_problems}" if q.coverage is not None else "no summaries",
            f"+{q.added} ~{q.modified} -{q.deleted}",
            str(q.evicted),
        ]
        for q in data.quality
    ]
    return headers, rows


def library_rows(library: ExperienceLibrary, stats: dict[str, ExperienceStat] | None = None) -> Table:
    """The library as a table; with ``stats``, each lesson's usefulness and confidence."""
    stats = stats or {}
    rows = [
        [e.id, item_text(e), str(e.created_step), str(e.updated_step), ", ".join(e.parent_ids)]
        + ([describe_stat(stats[e.id]) if e.id in stats else ""] if stats else [])
        for e in library
    ]
    return ["id", "text", "created", "updated", "from"] + (["usefulness"] if stats else []), rows


def evaluation_table(summaries: list[EvalSummary]) -> Table:
    """One row per condition (all conditions of an evaluation share k and Pass@k's k)."""
    first = summaries[0]
    headers = [
        "condition",
        "library",
        "experiences",
        "problems",
        f"Mean@{first.k} [{first.ci_level:.0%} CI]",
        f"Pass@{first.pass_k} [{first.ci_level:.0%} CI]",
        "temperature",
        "failed samples",
        "leaked problems",
    ]
    rows = [
        [
            s.condition,
            s.library_ref,
            str(s.library_size),
            str(s.n_problems),
            _fmt(Estimate(s.mean_at_k, s.mean_ci_low, s.mean_ci_high)),
            _fmt(Estimate(s.pass_at_k, s.pass_ci_low, s.pass_ci_high)),
            f"{s.temperature:g}",
            str(s.n_failed),
            ", ".join(s.leaked_ids) or "0",
        ]
        for s in summaries
    ]
    return headers, rows


def metric_name(metric: str, k: int) -> str:
    return f"{'Mean' if metric == 'mean_at_k' else 'Pass'}@{k}"


def comparison_table(comparisons: list[EvalComparison], summaries: list[EvalSummary]) -> Table:
    """The paired differences; with task tags, a tag column (``all``: over every problem) and problem counts."""
    k = {"mean_at_k": summaries[0].k, "pass_at_k": summaries[0].pass_k}
    headers = ["candidate - baseline", "metric", "baseline", "candidate", "difference [CI]", "significant"]
    rows = [
        [
            f"{c.candidate} - {c.baseline}",
            metric_name(c.metric, k[c.metric]),
            f"{c.baseline_value:.3f}",
            f"{c.candidate_value:.3f}",
            _fmt(Estimate(c.diff, c.ci_low, c.ci_high, c.ci_level), signed=True),
            "yes" if c.significant else "no",
        ]
        for c in comparisons
    ]
    if any(c.tag is not None for c in comparisons):
        headers[1:1] = ["tag", "problems"]
        for row, c in zip(rows, comparisons):
            row[1:1] = [c.tag or "all", str(c.n_problems)]
    return headers, rows


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table) -> str:
    headers, rows = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def html_table(table: Table) -> str:
    headers, rows = table
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def evaluation_markdown(
    summaries: list[EvalSummary], comparisons: list[EvalComparison], notes: Sequence[str] = ()
) -> str:
    """An evaluation as markdown: conditions with CIs, paired differences, notes (e.g. leakage)."""
    if not summaries:
        return "(no evaluation)"
    s = summaries[0]
    lines = [
        f"## Evaluation {s.eval_id}",
        "",
        f"{counted(s.n_problems, 'problem')} from `{s.dataset}`, {counted(s.k, 'sample')} each at temperature "
        f"{s.temperature:g} "
        f"(seed {s.seed}); {s.ci_level:.0%} bootstrap confidence intervals over problems.",
        "",
        markdown_table(evaluation_table(summaries)),
    ]
    if comparisons:
        lines += [
            "",
            "### Paired differences (same problems and sample seeds)",
            "",
            markdown_table(comparison_table(comparisons, summaries)),
        ]
    lines += [f"\n> {n}" for n in notes]
    return "\n".join(lines)


# --- plots and documents -----------------------------------------------------------------------------------
def run_plots(data: RunData) -> dict[str, bytes]:
    trained = [(r.step, r.train_accuracy) for r in data.steps if r.train_accuracy is not None]
    validated = [(r.step, r.heldout_mean) for r in data.steps if r.heldout_mean is not None]
    series = [
        plots.Series(
            "training rollouts (mean reward)",
            [step for step, _ in trained],
            [e.value for _, e in trained],
            [e.low for _, e in trained],
            [e.high for _, e in trained],
        )
    ]
    if validated:
        v = data.config.validation
        label = f"held-out Mean@{v.k} (T={v.temperature:g})" if v else "held-out Mean@k"
        series.append(
            plots.Series(
                label,
                [step for step, _ in validated],
                [e.value for _, e in validated],
                [e.low for _, e in validated],
                [e.high for _, e in validated],
            )
        )
    steps = [r.step for r in data.steps]
    return {
        "accuracy": plots.accuracy_plot(series, title=f"{data.run_id}: accuracy per step (95% CI)"),
        "library_size": plots.library_size_plot(steps, [r.library_size for r in data.steps]),
        "cost": plots.cost_plot(
            steps,
            [r.tokens_in for r in data.steps],
            [r.tokens_out for r in data.steps],
            [r.cost_usd + r.validation_cost_usd for r in data.steps],
            [r.validation_tokens for r in data.steps],
        ),
    }


def write_plots(images: dict[str, bytes], directory: Path) -> dict[str, Path]:
    return {name: plots.write_png(data, directory / PLOT_FILES[name]) for name, data in images.items()}


def _headline(data: RunData, gain: Gain | None) -> list[str]:
    cfg = data.config
    lines = [
        f"policy `{cfg.policy.model}`, dataset `{cfg.dataset.path or cfg.dataset.hf_name}`, "
        f"group size {cfg.grpo.group_size}, {cfg.grpo.epochs} epoch(s), rollout temperature "
        f"{cfg.grpo.rollout_temperature:g}; {len([r for r in data.steps if r.step > 0])} steps, final library "
        f"version {data.last.version} with {len(data.last)} experiences."
    ]
    if gain is not None:
        first, last, estimate = gain
        lines.append(
            f"Held-out Mean@{cfg.validation.k if cfg.validation else 'k'} from step {first} to step {last}: "
            f"{estimate.format(3, signed=True)} "
            f"(paired, {estimate.level:.0%} CI; "
            f"{'significant' if estimate.excludes_zero else 'not significant'})."
        )
    elif cfg.validation is None:
        lines.append("No held-out validation was configured for this run (set `validation:` in the config).")
    return lines


def _diff_lines(data: RunData) -> list[str]:
    return diff(data.first, data.last).to_markdown().splitlines()


def render_markdown(data: RunData, files: dict[str, Path], out_dir: Path, gain: Gain | None = None) -> str:
    lines = [f"# clgrpo run `{data.run_id}`", "", *_headline(data, gain), ""]
    lines += [f"![{name}]({p.relative_to(out_dir).as_posix()})" for name, p in files.items()]
    lines += ["", "## Steps", "", markdown_table(step_table(data))]
    if data.quality:
        lines += ["", "## Library quality per step", "", markdown_table(quality_table(data))]
    lines += [
        "",
        f"## Final library (version {data.last.version})",
        "",
        markdown_table(library_rows(data.last, data.stats)),
        "",
        f"## Changes from version {data.first.version} to version {data.last.version}",
        "",
        "```",
        *_diff_lines(data),
        "```",
    ]
    for ev in data.evaluations:
        lines += ["", evaluation_markdown(ev.summaries, ev.comparisons)]
    lines += ["", "## Config", "", "```json", json.dumps(data.config.model_dump(mode="json"), indent=2), "```", ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%;display:block;margin:1em 0}
pre{background:#f6f6f6;padding:1em;overflow-x:auto}.add{color:#176f2c}.del{color:#a31515}.mod{color:#8a5a00}"""


def render_html(data: RunData, images: dict[str, bytes], gain: Gain | None = None) -> str:
    classes = {"+": "add", "-": "del", "~": "mod"}
    diff_html = "\n".join(
        f'<span class="{classes.get(line[:1], "")}">{html.escape(line)}</span>' for line in _diff_lines(data)
    )
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>clgrpo run {html.escape(data.run_id)}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>clgrpo run <code>{html.escape(data.run_id)}</code></h1>",
        *(f"<p>{html.escape(line).replace('`', '')}</p>" for line in _headline(data, gain)),
        *(f'<img alt="{name}" src="{plots.data_uri(png)}">' for name, png in images.items()),
        "<h2>Steps</h2>",
        html_table(step_table(data)),
        *(["<h2>Library quality per step</h2>", html_table(quality_table(data))] if data.quality else []),
        f"<h2>Final library (version {data.last.version})</h2>",
        html_table(library_rows(data.last, data.stats)),
        f"<h2>Changes from version {data.first.version} to version {data.last.version}</h2>",
        f"<pre>{diff_html}</pre>",
    ]
    for ev in data.evaluations:
        parts += [f"<h2>Evaluation {html.escape(ev.eval_id)}</h2>", html_table(evaluation_table(ev.summaries))]
        if ev.comparisons:
            parts.append(html_table(comparison_table(ev.comparisons, ev.summaries)))
    parts += [
        "<h2>Config</h2>",
        f"<pre>{html.escape(json.dumps(data.config.model_dump(mode='json'), indent=2))}</pre>",
        f"<p><small>generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC</small></p></body></html>",
    ]
    return "\n".join(parts)


def write_report(store: Store, run_id: str, out_dir: str | Path, fmt: str = "html") -> Path:
    """``report.html`` (self-contained) or ``report.md`` in ``out_dir``; the PNGs go to ``out_dir/plots``."""
    if fmt not in ("html", "md"):
        raise ValueError(f"unknown report format {fmt!r}; use html or md")
    out = Path(out_dir)
    data = collect_run(store, run_id)
    gain = heldout_gain(store, run_id, data)
    images = run_plots(data)
    files = write_plots(images, out / "plots")
    path = out / f"report.{fmt}"
    text = render_html(data, images, gain) if fmt == "html" else render_markdown(data, files, out, gain)
    path.write_text(text, encoding="utf-8")
    return path
