"""Stage: evaluate a library on held-out problems, and turn graded samples into metrics with CIs.

``evaluate_library`` measures k graded samples per problem with the library in the prompt exactly as in training
(``tasks.measure``: samples already drawn with the same key are read, not drawn again), at the evaluation
temperature, with a seed per (problem, sample) that depends only on the evaluation seed and the problem id, so
every condition sees the same seeds. ``summarize_condition`` and ``compare_conditions`` compute Mean@k / Pass@k with
bootstrap confidence intervals (``clgrpo.reports.metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from clgrpo.reports import metrics
from clgrpo.storage.journal import StageItems
from domains import Domain, domain_for
from schemas.config import EvalConfig, RunConfig
from schemas.records import (
    EvalComparison,
    EvalSample,
    EvalSummary,
    LibraryVersion,
    Problem,
    Sample,
)
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.judge import Judge, make_judge
from tasks.measure import Sampling, measure, sample_seeds
from tasks.outputs import Evaluated


async def evaluate_library(
    problems: list[Problem],
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    *,
    condition: str,
    k: int,
    sampling: Sampling,
    seed: int,
    judge: Judge | None = None,
    resume_key: str = "",
    known: Mapping[str, Sample] | None = None,
    count_read: bool = True,
) -> Evaluated:
    """k graded samples per problem for one condition (library), through ``tasks.measure``: a sample whose draw
    key is in ``known`` (stored by an earlier evaluation, trial or gate) is read, not drawn. With a
    ``resume_key`` (the evaluation's fingerprint) each graded sample goes to the work journal as it is made and
    one already there is read back, not requested again (a stopped evaluation resumes where it was).
    ``count_read`` False: the samples read are not counted on the progress bar (the evaluation counted them
    before it began)."""
    journal = StageItems(Stage.EVALUATE, Sample, always=bool(resume_key))
    stored = known or {}

    def lookup(key: str) -> Sample | None:
        return stored.get(key) or (journal.get(f"{resume_key}|{key}") if resume_key else None)

    def keep(sample: Sample) -> None:
        if resume_key and sample.error is None:
            journal.put(f"{resume_key}|{sample.draw_key}", sample)

    measured = await measure(
        problems,
        library,
        k,
        sample_seeds(problems, seed),
        sampling,
        domain,
        llm,
        stage=Stage.EVALUATE,
        known=lookup,
        judge=judge,
        keep=keep,
        count_read=count_read,
    )
    return Evaluated(eval_results=[eval_sample(condition, s) for s in measured.samples], llm_calls=measured.calls)


def eval_sample(condition: str, sample: Sample) -> EvalSample:
    """A measured sample as a condition's evaluation row (a failed or ungradable sample counts as reward 0)."""
    return EvalSample(**{**sample.model_dump(), "reward": sample.reward or 0.0, "condition": condition})


@stage_task(Stage.EVALUATE, run_name="evaluate-{condition}-chunk{chunk}")
async def evaluate_task(
    config: RunConfig,
    evaluation: EvalConfig,
    key: str,
    condition: str,
    chunk: int,
    problems: list[Problem],
    library: LibraryVersion,
    resume_key: str = "",
    known: dict[str, Sample] | None = None,
    count_read: bool = True,
) -> Evaluated:
    """``key`` (the evaluation id, or run/step of a validation) only keys the cache; ``resume_key``, ``known`` and
    ``count_read``: see ``evaluate_library``."""
    domain = domain_for(config)
    return await evaluate_library(
        problems,
        ExperienceLibrary.from_version(library),
        domain,
        shared_client(config),
        condition=condition,
        k=evaluation.k,
        sampling=Sampling.of(config, evaluation.temperature),
        seed=evaluation.seed,
        judge=make_judge(config, domain, Stage.EVALUATE),
        resume_key=resume_key,
        known=known,
        count_read=count_read,
    )


# --- metrics over graded samples -------------------------------------------------------------------------
def reward_matrix(samples: Sequence[EvalSample], problem_ids: Sequence[str], k: int) -> np.ndarray:
    """Rewards as ``(problems, k)`` in the given problem order and sample index order."""
    index = {pid: i for i, pid in enumerate(problem_ids)}
    matrix = np.full((len(problem_ids), k), np.nan)
    for s in samples:
        if s.problem_id in index and s.sample_idx < k:
            matrix[index[s.problem_id], s.sample_idx] = s.reward
    missing = np.argwhere(np.isnan(matrix))
    if len(missing):
        shown = ", ".join(f"{problem_ids[i]}#{j}" for i, j in missing[:10])
        condition = samples[0].condition if samples else "?"
        raise ValueError(f"condition {condition!r}: {len(missing)} of {matrix.size} samples missing ({shown})")
    return matrix


def _bootstrap_options(cfg: EvalConfig) -> dict:
    return dict(n_boot=cfg.bootstrap_samples, seed=cfg.seed, level=cfg.ci_level, resample_samples=cfg.resample_samples)


def summarize_condition(
    samples: Sequence[EvalSample],
    problem_ids: Sequence[str],
    cfg: EvalConfig,
    *,
    eval_id: str,
    condition: str,
    library_ref: str,
    library: ExperienceLibrary,
    dataset: str,
    fingerprint: str,
    leaked_ids: Sequence[str] = (),
) -> EvalSummary:
    rewards = reward_matrix(samples, problem_ids, cfg.k)
    mean = metrics.bootstrap_ci(rewards, "mean_at_k", **_bootstrap_options(cfg))
    passed = metrics.bootstrap_ci(rewards, "pass_at_k", k=cfg.pass_at, **_bootstrap_options(cfg))
    return EvalSummary(
        eval_id=eval_id,
        condition=condition,
        library_ref=library_ref,
        library_hash=library.content_hash(),
        library_size=len(library),
        dataset=dataset,
        fingerprint=fingerprint,
        n_problems=len(problem_ids),
        k=cfg.k,
        pass_k=cfg.pass_at,
        temperature=cfg.temperature,
        seed=cfg.seed,
        ci_level=cfg.ci_level,
        mean_at_k=mean.value,
        mean_ci_low=mean.low,
        mean_ci_high=mean.high,
        pass_at_k=passed.value,
        pass_ci_low=passed.low,
        pass_ci_high=passed.high,
        n_failed=sum((s.error or "").startswith(("rollout failed", "could not verify")) for s in samples),
        leaked_ids=sorted(set(leaked_ids) & set(problem_ids)),
    )


def compare_conditions(
    baseline: tuple[str, Sequence[EvalSample]],
    candidate: tuple[str, Sequence[EvalSample]],
    problem_ids: Sequence[str],
    cfg: EvalConfig,
    *,
    eval_id: str,
    tag: str | None = None,
) -> list[EvalComparison]:
    """candidate - baseline for Mean@k and Pass@k, paired on the same problems and sample seeds; ``tag`` names
    the task tag when ``problem_ids`` are that tag's problems."""
    a = reward_matrix(baseline[1], problem_ids, cfg.k)
    b = reward_matrix(candidate[1], problem_ids, cfg.k)
    specs: tuple[tuple[metrics.Metric, int | None], ...] = (("mean_at_k", None), ("pass_at_k", cfg.pass_at))
    out = []
    for metric, k in specs:
        diff = metrics.paired_difference(a, b, metric, k=k, **_bootstrap_options(cfg))
        out.append(
            EvalComparison(
                eval_id=eval_id,
                baseline=baseline[0],
                candidate=candidate[0],
                metric=metric,
                baseline_value=metrics.metric_value(a, metric, k),
                candidate_value=metrics.metric_value(b, metric, k),
                diff=diff.value,
                ci_low=diff.low,
                ci_high=diff.high,
                ci_level=cfg.ci_level,
                n_problems=len(problem_ids),
                tag=tag,
            )
        )
    return out


def tag_groups(problems: Sequence[Problem]) -> dict[str, list[str]]:
    """The problem ids of each task tag present, tags sorted (untagged problems count only overall)."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        if p.tag is not None:
            groups.setdefault(p.tag, []).append(p.problem_id)
    return dict(sorted(groups.items()))


def compare_by_tag(
    baseline: tuple[str, Sequence[EvalSample]],
    candidate: tuple[str, Sequence[EvalSample]],
    problems: Sequence[Problem],
    cfg: EvalConfig,
    *,
    eval_id: str,
) -> list[EvalComparison]:
    """``compare_conditions`` over all problems (tag None), then over each task tag's problems."""
    out = compare_conditions(baseline, candidate, [p.problem_id for p in problems], cfg, eval_id=eval_id)
    for tag, problem_ids in tag_groups(problems).items():
        out += compare_conditions(baseline, candidate, problem_ids, cfg, eval_id=eval_id, tag=tag)
    return out
