"""Stage: grade every rollout with the domain verifier and compute the numeric group advantages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from clgrpo import progress
from clgrpo.journal import StageItems, sample_key
from domains import Domain, VerifyResult, get_domain
from schemas.config import RunConfig
from schemas.records import GroupAdvantage, Problem, Reward, Rollout
from tasks.common import stage_task
from tasks.group_advantage import compute_group_advantages
from tasks.judge import Judge, make_judge

STAGE = "verify"


@dataclass
class VerifyBatch:
    rewards: list[Reward]
    advantages: list[GroupAdvantage]


Grader = Callable[[list[tuple[Problem, str]]], list[VerifyResult]]  # (problem, output) pairs -> grades


def verify(problems: list[Problem], rollouts: list[Rollout], domain: Domain, grader: Grader | None = None
           ) -> list[Reward]:
    """One reward per rollout, in rollout order; the verifier itself never raises. Not graded (reward None,
    the reason in ``error``): failed rollouts, problems without ground truth, and samples the verifier could
    not grade even on a second try (``verified`` False: a failed item of this stage). A reply cut off at
    max_tokens is graded (the rollout keeps the mark) unless the domain says ``grade_truncated = False``.
    Verified rewards already in the work journal are reused. ``grader``: grades instead of the domain's
    ``verify_batch`` (the LLM judge)."""
    answers = {p.problem_id: p.answer for p in problems}
    by_id = {p.problem_id: p for p in problems}
    grader = grader or (lambda items: domain.verify_batch([(out, p.answer) for p, out in items]))  # type: ignore
    done = StageItems(STAGE, Reward)
    graded: dict[tuple[str, int], Reward] = {}
    todo = []
    for r in rollouts:
        key = (r.problem_id, r.sample_idx)
        if r.error is None and answers.get(r.problem_id) is not None:
            reused = done.get(sample_key(*key))
            if reused is not None:
                graded[key] = reused
            elif r.truncated and not getattr(domain, "grade_truncated", True):
                graded[key] = Reward(problem_id=r.problem_id, sample_idx=r.sample_idx, reward=0.0,
                                     error="cut off at max_tokens (the domain does not grade truncated replies)")
            else:
                todo.append(r)
    for attempt in range(2):  # a sample the verifier could not grade gets a second try
        if not todo:
            break
        results = grader([(by_id[r.problem_id], r.final_text) for r in todo])
        retry = []
        for r, g in zip(todo, results):
            if not g.verified and attempt == 0:
                retry.append(r)
                continue
            reward = Reward(problem_id=r.problem_id, sample_idx=r.sample_idx,
                            reward=g.reward if g.verified else None, extracted=g.extracted,
                            error=g.error if g.verified else f"could not verify: {g.error}", verified=g.verified,
                            judge_reason=g.reason)
            graded[(r.problem_id, r.sample_idx)] = reward
            if g.verified:
                done.put(sample_key(r.problem_id, r.sample_idx), reward)
        todo = retry
    rewards = []
    for r in rollouts:
        key = (r.problem_id, r.sample_idx)
        if key in graded:
            rewards.append(graded[key])
        else:
            reason = f"rollout failed: {r.error}" if r.error else "no ground truth"
            rewards.append(Reward(problem_id=r.problem_id, sample_idx=r.sample_idx, reward=None, error=reason))
    progress.advance(STAGE, len(rollouts))
    return rewards


async def grade(problems: list[Problem], rollouts: list[Rollout], domain: Domain, judge: Judge | None = None
                ) -> list[Reward]:
    """``verify`` in a worker thread; with a ``judge``, its calls run on this event loop (the one LLM client)."""
    if judge is None:
        return await asyncio.to_thread(verify, problems, rollouts, domain)
    loop = asyncio.get_running_loop()

    def judged(items: list[tuple[Problem, str]]) -> list[VerifyResult]:
        return asyncio.run_coroutine_threadsafe(judge.grade_all(items), loop).result()

    return await asyncio.to_thread(verify, problems, rollouts, domain, judged)


def warm_verifier(domain_name: str) -> None:
    """Start the domain's verifier (the math-verify process pool) now, in the background, so grading never
    waits for it on the critical path and its start-up never counts against a sample's time limit."""
    warm = getattr(get_domain(domain_name), "warm", None)
    if warm is not None:
        warm()


@stage_task(STAGE, run_name="verify-step{step}-chunk{chunk}")
async def verify_task(config: RunConfig, step: int, chunk: int, problems: list[Problem],
                      rollouts: list[Rollout]) -> VerifyBatch:
    domain = get_domain(config.domain)
    rewards = await grade(problems, rollouts, domain, make_judge(config, domain, STAGE))
    advantages = compute_group_advantages(problems, rollouts, rewards, use_groundtruth=config.learning.use_groundtruth)
    return VerifyBatch(rewards, advantages)
