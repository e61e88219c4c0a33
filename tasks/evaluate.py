"""Stage: evaluate a library on held-out problems, and turn graded samples into metrics with CIs.

``evaluate_library`` samples k rollouts per problem with the library in the prompt exactly as in training
(``tasks.rollout.rollout``), at the evaluation temperature, with a seed per (problem, sample) that depends only
on the evaluation seed and the problem id, so every condition sees the same seeds; then grades them with
``tasks.verify.verify``. ``summarize_condition`` and ``compare_conditions`` compute Mean@k / Pass@k with
bootstrap confidence intervals (``clgrpo.metrics``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clgrpo import metrics, progress
from clgrpo.journal import StageItems, sample_key
from clgrpo.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from domains import Domain, domain_for
from schemas.config import AgentConfig, EvalConfig, RunConfig
from schemas.records import (
    EvalComparison,
    EvalSample,
    EvalSummary,
    LibraryVersion,
    LLMCall,
    Problem,
    Reward,
    Rollout,
    text_hash,
)
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.judge import Judge, make_judge
from tasks.rollout import raise_if_all_failed, rollout_problem
from tasks.verify import grade

_SEED_SPACE = 2**31 - 2**16  # room for seed + sample index in a signed 32-bit seed


@dataclass
class EvalBatch:
    samples: list[EvalSample]
    calls: list[LLMCall] = field(default_factory=list)


def sample_seeds(problems: Sequence[Problem], seed: int) -> dict[str, int]:
    """The base sampling seed of each problem (sample i uses base + i): a function of the evaluation seed
    and the problem id only, never of the condition or the problem's position."""
    return {p.problem_id: int(text_hash(f"{seed}:{p.problem_id}"), 16) % _SEED_SPACE for p in problems}


async def evaluate_library(
    problems: list[Problem],
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    *,
    condition: str,
    k: int,
    temperature: float,
    seed: int,
    agent: AgentConfig | None = None,
    judge: Judge | None = None,
    resume_key: str = "",
) -> EvalBatch:
    """k graded samples per problem for one condition (library); agent rollouts when ``agent`` is set. With a
    ``resume_key`` (the evaluation's fingerprint) each graded sample goes to the work journal as it is made and
    a sample already there is read back, not requested again (a stopped evaluation resumes where it was)."""
    seeds = sample_seeds(problems, seed)
    stored = StageItems(Stage.EVALUATE, EvalSample, always=bool(resume_key))

    def key(problem_id: str, index: int) -> str:
        return f"{resume_key}|{condition}|{sample_key(problem_id, index)}"

    have = {
        (p.problem_id, i): sample
        for p in problems
        for i in range(k)
        if resume_key and (sample := stored.get(key(p.problem_id, i))) is not None
    }
    todo = {p.problem_id: [i for i in range(k) if (p.problem_id, i) not in have] for p in problems}
    progress.advance(Stage.EVALUATE, len(have))
    wanted = [p for p in problems if todo[p.problem_id]]

    async def one(problem: Problem, indices: list[int]) -> tuple[list[Rollout], list[LLMCall]]:
        """Missing samples of a problem, graded and kept the moment they are (a stop loses only the replies in
        flight)."""
        batch = await rollout_problem(
            problem, library, domain, llm, k, temperature, seeds[problem.problem_id], agent, indices
        )
        graded = await grade([problem], batch.rollouts, domain, judge)
        for r, g in zip(batch.rollouts, graded):
            sample = _eval_sample(condition, r, g, seeds)
            have[(r.problem_id, r.sample_idx)] = sample
            if resume_key and sample.error is None:
                stored.put(key(r.problem_id, r.sample_idx), sample)
        progress.advance(Stage.EVALUATE, len(batch.rollouts))
        return batch.rollouts, batch.calls

    # one request per problem where the endpoint returns n samples at once (the prompt is paid once); else one
    # per sample, each kept as it comes
    together = llm.configs["policy"].supports_n and agent is None
    work = (
        [(p, todo[p.problem_id]) for p in wanted]
        if together
        else [(p, [i]) for p in wanted for i in todo[p.problem_id]]
    )
    parts = await asyncio.gather(*[one(p, indices) for p, indices in work])
    raise_if_all_failed(wanted, [r for rollouts, _ in parts for r in rollouts])
    ordered = [have[(p.problem_id, i)] for p in problems for i in range(k)]
    return EvalBatch(ordered, [c for _, calls in parts for c in calls])


def _eval_sample(condition: str, r: Rollout, g: Reward, seeds: dict[str, int]) -> EvalSample:
    return EvalSample(
        condition=condition,
        problem_id=r.problem_id,
        sample_idx=r.sample_idx,
        seed=seeds[r.problem_id] + r.sample_idx,
        reward=g.reward or 0.0,
        extracted=g.extracted,
        error=g.error,
        judge_reason=g.judge_reason,
        final_text=r.final_text,
        tokens_in=r.tokens_in,
        tokens_out=r.tokens_out,
        latency_s=r.latency_s,
        n_turns=r.n_turns,
        tool_calls=r.tool_calls,
        tool_errors=r.tool_errors,
    )


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
) -> EvalBatch:
    """``key`` (the evaluation id, or run/step of a validation) only keys the cache; ``resume_key``: see
    ``evaluate_library``."""
    domain = domain_for(config)
    return await evaluate_library(
        problems,
        ExperienceLibrary.from_version(library),
        domain,
        shared_client(config),
        condition=condition,
        k=evaluation.k,
        temperature=evaluation.temperature,
        seed=evaluation.seed,
        agent=config.rollout.agent_settings(),
        judge=make_judge(config, domain, Stage.EVALUATE),
        resume_key=resume_key,
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
