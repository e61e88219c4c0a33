"""Stage: grade every rollout with the domain verifier, and the numeric group advantages the rewards give.

Verify writes two tables: ``rewards`` (one per rollout) and ``group_advantages``, its second output: for every
group, (r - mean) / std over its graded samples and whether the group carries a learning signal (selected), by
``compute_group_advantages``. Selection: with ground truth and G > 1 only groups with 0 < mean < 1 carry a
learning signal; without ground truth or with G = 1 every group with a usable rollout goes on. The later stages
learn from the selected groups only.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable

from clgrpo.process import progress
from clgrpo.storage.journal import StageItems, sample_key
from domains import Domain, VerifyResult, domain_for, get_domain
from schemas.config import RunConfig
from schemas.records import GroupAdvantage, Problem, Reward, Rollout
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.judge import Judge, make_judge
from tasks.outputs import Verified


def _selection(valid: list[float], usable: int, use_groundtruth: bool, group_size: int) -> tuple[bool, str]:
    """``valid``: the group's graded rewards; ``usable``: its rollouts that did not fail."""
    if not use_groundtruth:
        return (True, "no ground truth: every group is used") if usable else (False, "no usable rollout")
    if not valid:
        return False, "no graded rollout"
    mean = statistics.fmean(valid)
    if group_size == 1:
        return True, "G=1: every group is used"
    if len(valid) < 2:
        return False, "fewer than 2 graded rollouts"
    if mean <= 0.0:
        return False, "all wrong: no contrast"
    if mean >= 1.0:
        return False, "all correct: no contrast"
    return True, "mixed rewards"


def compute_group_advantages(
    problems: list[Problem], rollouts: list[Rollout], rewards: list[Reward], *, use_groundtruth: bool
) -> list[GroupAdvantage]:
    """Mean, std and advantages over a group's graded samples only: a failed or unverifiable sample is not a 0."""
    usable: defaultdict[str, int] = defaultdict(int)
    for r in rollouts:
        usable[r.problem_id] += r.error is None
    by_problem: dict[str, list[Reward]] = defaultdict(list)
    for reward in rewards:
        by_problem[reward.problem_id].append(reward)
    out = []
    for problem in problems:
        group = sorted(by_problem.get(problem.problem_id, []), key=lambda r: r.sample_idx)
        if not group:
            continue
        values = [r.reward for r in group]
        valid = [v for v in values if v is not None]
        mean = statistics.fmean(valid) if valid else 0.0
        std = statistics.pstdev(valid) if valid else 0.0
        advantages = [None if v is None else (v - mean) / std if std > 0 else 0.0 for v in values]
        labeled = problem.answer is not None or any(r.reward_source == "agreement" for r in group)
        selected, reason = _selection(valid, usable[problem.problem_id], use_groundtruth and labeled, len(group))
        out.append(
            GroupAdvantage(
                problem_id=problem.problem_id,
                rewards=values,
                mean_reward=mean,
                std_reward=std,
                advantages=advantages,
                selected=selected,
                reason=reason,
            )
        )
    return out


Grader = Callable[[list[tuple[Problem, str]]], list[VerifyResult]]  # (problem, output) pairs -> grades


# what graded a reward against the problem's answer, by where that answer came from (Problem.answer_source)
ANSWER_REWARD_SOURCE = {
    None: "ground_truth",
    "ground_truth": "ground_truth",
    "reference": "feedback:reference",
    "correction": "feedback:correction",
    "thumbs_up_reply": "feedback:thumbs_up",
}


def reward_source(problem: Problem, judged: bool) -> str:
    return "judge" if judged else ANSWER_REWARD_SOURCE.get(problem.answer_source, "ground_truth")


def verify(
    problems: list[Problem],
    rollouts: list[Rollout],
    domain: Domain,
    grader: Grader | None = None,
    unlabeled: str = "compare",
) -> list[Reward]:
    """One reward per rollout, in rollout order; the verifier itself never raises. Not graded (reward None,
    the reason in ``error``): failed rollouts, problems without ground truth, and samples the verifier could
    not grade even on a second try (``verified`` False: a failed item of this stage). A reply cut off at
    max_tokens is graded (the rollout keeps the mark) unless the domain says ``grade_truncated = False``.
    Verified rewards already in the work journal are reused. ``grader``: grades instead of the domain's
    ``verify_batch`` (the LLM judge). ``unlabeled="agreement"``: problems without ground truth are graded
    against their group's majority answer (``agreement_rewards``). Every reward names what graded it
    (``reward_source``)."""
    answers = {p.problem_id: p.answer for p in problems}
    by_id = {p.problem_id: p for p in problems}
    judged = grader is not None
    grader = grader or (lambda items: domain.verify_batch([(out, p.answer) for p, out in items]))  # type: ignore
    done = StageItems(Stage.VERIFY, Reward)
    graded: dict[tuple[str, int], Reward] = {}
    todo = []
    for r in rollouts:
        key = (r.problem_id, r.sample_idx)
        if r.error is None and answers.get(r.problem_id) is not None:
            reused = done.get(sample_key(*key))
            if reused is not None:
                graded[key] = reused
            elif r.truncated and not getattr(domain, "grade_truncated", True):
                graded[key] = Reward(
                    problem_id=r.problem_id,
                    sample_idx=r.sample_idx,
                    reward=0.0,
                    error="cut off at max_tokens (the domain does not grade truncated replies)",
                    reward_source=reward_source(by_id[r.problem_id], False),
                )
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
            reward = Reward(
                problem_id=r.problem_id,
                sample_idx=r.sample_idx,
                reward=g.reward if g.verified else None,
                extracted=g.extracted,
                error=g.error if g.verified else f"could not verify: {g.error}",
                verified=g.verified,
                judge_reason=g.reason,
                reward_source=reward_source(by_id[r.problem_id], judged) if g.verified else None,
            )
            graded[(r.problem_id, r.sample_idx)] = reward
            if g.verified:
                done.put(sample_key(r.problem_id, r.sample_idx), reward)
        todo = retry
    if unlabeled == "agreement":
        graded.update(agreement_rewards([p for p in problems if p.answer is None], rollouts, domain))
    rewards = []
    for r in rollouts:
        key = (r.problem_id, r.sample_idx)
        if key in graded:
            rewards.append(graded[key])
        else:
            reason = f"rollout failed: {r.error}" if r.error else "no ground truth"
            rewards.append(Reward(problem_id=r.problem_id, sample_idx=r.sample_idx, reward=None, error=reason))
    progress.advance(Stage.VERIFY, len(rollouts))
    return rewards


def _normalized(answer: str | None) -> str | None:
    return " ".join(answer.split()).rstrip(".").lower() or None if answer else None


def agreement_rewards(
    problems: list[Problem], rollouts: list[Rollout], domain: Domain
) -> dict[tuple[str, int], Reward]:
    """Rewards for problems without ground truth by agreement: the final answer (the domain's ``reply_answer``)
    that more than half of a group's usable rollouts give is taken as right; those rollouts get 1, the other
    usable ones 0. A group without such a majority (or of fewer than 2 usable rollouts) stays ungraded."""
    read = getattr(domain, "reply_answer", None)
    wanted = {p.problem_id for p in problems}
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        if r.problem_id in wanted and r.error is None:
            groups.setdefault(r.problem_id, []).append(r)
    out: dict[tuple[str, int], Reward] = {}
    for problem_id, group in groups.items():
        answers = [_normalized(read(r.final_text)) if read else None for r in group]
        counts = Counter(a for a in answers if a is not None)
        top, n = counts.most_common(1)[0] if counts else (None, 0)
        if len(group) < 2 or 2 * n <= len(group):
            continue
        for r, answer in zip(group, answers):
            agrees = answer == top
            out[(problem_id, r.sample_idx)] = Reward(
                problem_id=problem_id,
                sample_idx=r.sample_idx,
                reward=1.0 if agrees else 0.0,
                extracted=answer,
                error=None if agrees else f"disagrees with the group's majority answer ({n}/{len(group)})",
                reward_source="agreement",
            )
    return out


async def grade(
    problems: list[Problem],
    rollouts: list[Rollout],
    domain: Domain,
    judge: Judge | None = None,
    unlabeled: str = "compare",
) -> list[Reward]:
    """``verify`` in a worker thread; with a ``judge``, its calls run on this event loop (the one LLM client)."""
    if judge is None:
        return await asyncio.to_thread(verify, problems, rollouts, domain, None, unlabeled)
    loop = asyncio.get_running_loop()

    def judged(items: list[tuple[Problem, str]]) -> list[VerifyResult]:
        return asyncio.run_coroutine_threadsafe(judge.grade_all(items), loop).result()

    return await asyncio.to_thread(verify, problems, rollouts, domain, judged, unlabeled)


def warm_verifier(domain_name: str) -> None:
    """Start the domain's verifier (the math-verify process pool) now, in the background, so grading never
    waits for it on the critical path and its start-up never counts against a sample's time limit."""
    warm = getattr(get_domain(domain_name), "warm", None)
    if warm is not None:
        warm()


@stage_task(Stage.VERIFY, run_name="verify-step{step}-chunk{chunk}")
async def verify_task(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], rollouts: list[Rollout]
) -> Verified:
    domain = domain_for(config)
    rewards = await grade(
        problems, rollouts, domain, make_judge(config, domain, Stage.VERIFY), config.learning.unlabeled
    )
    advantages = compute_group_advantages(problems, rollouts, rewards, use_groundtruth=config.learning.use_groundtruth)
    return Verified(rewards, advantages)
