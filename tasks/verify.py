"""Stage: grade every rollout with the domain verifier and compute the numeric group advantages."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from clgrpo import progress
from domains import Domain, get_domain
from schemas.config import RunConfig
from schemas.records import GroupAdvantage, Problem, Reward, Rollout
from tasks.common import stage_task
from tasks.group_advantage import compute_group_advantages

STAGE = "verify"


@dataclass
class VerifyBatch:
    rewards: list[Reward]
    advantages: list[GroupAdvantage]


def verify(problems: list[Problem], rollouts: list[Rollout], domain: Domain) -> list[Reward]:
    """One reward per rollout, in rollout order. Failed rollouts and problems without ground truth score 0
    with the reason in ``error``; the verifier itself never raises."""
    answers = {p.problem_id: p.answer for p in problems}
    gradable = [r for r in rollouts if r.error is None and answers.get(r.problem_id) is not None]
    graded = domain.verify_batch([(r.final_text, answers[r.problem_id]) for r in gradable])  # type: ignore[misc]
    by_key = {(r.problem_id, r.sample_idx): g for r, g in zip(gradable, graded)}
    rewards = []
    for r in rollouts:
        key = (r.problem_id, r.sample_idx)
        if key in by_key:
            g = by_key[key]
            rewards.append(Reward(problem_id=r.problem_id, sample_idx=r.sample_idx, reward=g.reward,
                                  extracted=g.extracted, error=g.error))
        else:
            reason = f"rollout failed: {r.error}" if r.error else "no ground truth"
            rewards.append(Reward(problem_id=r.problem_id, sample_idx=r.sample_idx, reward=0.0, error=reason))
    progress.advance(STAGE, len(rollouts))
    return rewards


@stage_task(STAGE, run_name="verify-step{step}-chunk{chunk}")
async def verify_task(config: RunConfig, step: int, chunk: int, problems: list[Problem],
                      rollouts: list[Rollout]) -> VerifyBatch:
    rewards = await asyncio.to_thread(verify, problems, rollouts, get_domain(config.domain))
    advantages = compute_group_advantages(problems, rollouts, rewards, use_groundtruth=config.learning.use_groundtruth)
    return VerifyBatch(rewards, advantages)
