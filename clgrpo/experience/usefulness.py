"""Usefulness and confidence of each experience, from the attempts that cited it.

The summarizer says which listed experiences an attempt used (by id). Per step, every id a summary cites (a
sentence that names it without saying it was ignored or not used) counts once for that attempt: in a correct
attempt (reward 1), a wrong one (reward 0; partial rewards count as their share of each), and whether the
group had reward variance (it went to the learner). Counts follow the id across versions (a modified lesson
keeps them; a merged or deleted id's counts end with it). Confidence is the posterior mean of a Beta(1, 1)
prior updated with the correct and wrong citations, with an equal-tailed credible interval.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from schemas.config import RunConfig
from schemas.records import ExperienceStat, GroupAdvantage, Reward, Summary

_SENTENCE_RE = re.compile(r"[^.;\n]+")
_NOT_USED_RE = re.compile(
    r"\b(ignor\w*|did not (use|apply|follow)|didn't (use|apply|follow)|not (used|applied|"
    r"followed)|unused|without)\b",
    re.IGNORECASE,
)
CI_LEVEL = 0.95
_DRAWS = 20_000


def cited_ids(summary: str, live_ids: Iterable[str]) -> set[str]:
    """The ids of ``live_ids`` a summary says the attempt used."""
    ids = set(live_ids)
    cited: set[str] = set()
    for sentence in _SENTENCE_RE.findall(summary):
        named = {token for token in re.findall(r"\b[A-Za-z_]*\d+\b", sentence) if token in ids}
        if named and not _NOT_USED_RE.search(sentence):
            cited |= named
    return cited


def confidence(correct: float, wrong: float, level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Posterior mean and credible interval of Beta(1 + correct, 1 + wrong) (seeded draws: reproducible)."""
    a, b = 1.0 + correct, 1.0 + wrong
    draws = np.random.default_rng(0).beta(a, b, _DRAWS)
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return a / (a + b), float(low), float(high)


def step_stats(
    previous: Sequence[ExperienceStat],
    live_ids: Sequence[str],
    cited_from: Sequence[str],
    summaries: Sequence[Summary],
    rewards: Sequence[Reward],
    advantages: Sequence[GroupAdvantage],
) -> list[ExperienceStat]:
    """The stats of the experiences live after a step: the previous counts of the ids still live plus the
    step's citations. ``cited_from``: the ids the step's rollouts were shown (the library before the step)."""
    reward = {(r.problem_id, r.sample_idx): r.reward for r in rewards}
    variance = {a.problem_id for a in advantages if a.selected}
    counts = {s.exp_id: [s.cited, s.cited_correct, s.cited_wrong, s.cited_in_variance] for s in previous}
    for summary in summaries:
        grade = reward.get((summary.problem_id, summary.sample_idx))
        if summary.error or grade is None:
            continue
        for exp_id in cited_ids(summary.text, cited_from):
            row = counts.setdefault(exp_id, [0, 0.0, 0.0, 0])
            row[0] += 1
            row[1] += grade
            row[2] += 1.0 - grade
            row[3] += summary.problem_id in variance
    out = []
    for exp_id in live_ids:
        cited, correct, wrong, in_variance = counts.get(exp_id, [0, 0.0, 0.0, 0])
        mean, low, high = confidence(correct, wrong)
        out.append(
            ExperienceStat(
                exp_id=exp_id,
                cited=int(cited),
                cited_correct=float(correct),
                cited_wrong=float(wrong),
                cited_in_variance=int(in_variance),
                confidence=mean,
                ci_low=low,
                ci_high=high,
            )
        )
    return out


NOT_MEASURED = (
    "usefulness not measured in this configuration (learning.summarize is off: a lesson's citations are read from "
    "the rollout summaries)"
)


def measured(config: RunConfig) -> bool:
    """Whether a run measures its lessons' usefulness: citations come from rollout summaries."""
    return config.learning.summarize


def describe_stat(stat: ExperienceStat) -> str:
    """One line for ``library show`` and the report."""
    if not stat.cited:
        return "never cited yet"
    return (
        f"cited {stat.cited}x ({stat.cited_correct:g} correct / {stat.cited_wrong:g} wrong, "
        f"{stat.cited_in_variance} in groups with variance), confidence {stat.confidence:.2f} "
        f"[{stat.ci_low:.2f}, {stat.ci_high:.2f}]"
    )
