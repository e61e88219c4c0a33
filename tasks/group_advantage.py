"""Stage: numeric group advantages (all groups) and the semantic group advantage (selected groups).

Numeric: (r - mean) / std per group, recorded for every group. Selection: with ground truth and G > 1 only
groups with 0 < mean < 1 carry a learning signal; without ground truth or with G = 1 every group with a
usable rollout goes on. Semantic: the learner compares the attempts (their summaries) and proposes
operations on the library, returned as a ``Proposal`` per group (parse failures kept with the raw text).
"""

from __future__ import annotations

import asyncio
from functools import partial
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from clgrpo import progress
from clgrpo.journal import StageItems
from clgrpo.library import ExperienceLibrary
from clgrpo.llm import LLMCallError, LLMClient, shared_client
from domains import get_domain
from domains.learner import GROUP_KINDS, Attempt, LearnerPrompts, operations_schema, tool_trace, trajectory_text
from schemas.config import LearningConfig, RunConfig
from schemas.records import GroupAdvantage, LibraryVersion, LLMCall, Problem, Proposal, Reward, Rollout, Summary
from tasks.common import stage_task

STAGE = "group_advantage"
CALL_FAILED = "learner call failed: "
_MAX_ATTEMPT_CHARS = 4000  # a failed summary falls back to the trajectory, cut to this length


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


def compute_group_advantages(problems: list[Problem], rollouts: list[Rollout], rewards: list[Reward], *,
                             use_groundtruth: bool) -> list[GroupAdvantage]:
    """Mean, std and advantages over a group's graded samples only: a failed or unverifiable sample is not a 0."""
    usable = defaultdict(int)
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
        selected, reason = _selection(valid, usable[problem.problem_id], use_groundtruth and problem.answer is not None,
                                      len(group))
        out.append(GroupAdvantage(problem_id=problem.problem_id, rewards=values, mean_reward=mean, std_reward=std,
                                  advantages=advantages, selected=selected, reason=reason))
    return out


@dataclass
class Group:
    """A selected group as the learner stages see it."""

    problem: Problem
    rollouts: list[Rollout]
    rewards: list[Reward]


def build_groups(problems: list[Problem], rollouts: list[Rollout], rewards: list[Reward],
                 advantages: list[GroupAdvantage]) -> list[Group]:
    selected = {a.problem_id for a in advantages if a.selected}
    reward_of = {(r.problem_id, r.sample_idx): r for r in rewards}
    # a sample the learner may see: not failed, and graded unless the group has no ground truth
    usable = [r for r in rollouts if r.error is None and r.problem_id in selected
              and (reward_of[(r.problem_id, r.sample_idx)].graded or reward_of[(r.problem_id, r.sample_idx)].verified)]
    return [
        Group(p, [r for r in usable if r.problem_id == p.problem_id],
              [reward_of[(r.problem_id, r.sample_idx)] for r in usable if r.problem_id == p.problem_id])
        for p in problems if p.problem_id in selected
    ]


@dataclass
class ProposalBatch:
    proposals: list[Proposal]
    calls: list[LLMCall] = field(default_factory=list)


def _attempts(group: Group, summaries: dict[tuple[str, int], Summary], use_groundtruth: bool) -> list[Attempt]:
    attempts = []
    for rollout, reward in zip(group.rollouts, group.rewards):
        summary = summaries.get((rollout.problem_id, rollout.sample_idx))
        text = summary.text if summary and not summary.error else trajectory_text(rollout.turns)[-_MAX_ATTEMPT_CHARS:]
        attempts.append(Attempt(rollout.sample_idx, text, reward.reward if use_groundtruth else None,
                                truncated=rollout.truncated, tools=tool_trace(rollout.turns)))
    return attempts


async def _extract_one(group: Group, summaries: dict[tuple[str, int], Summary], library: ExperienceLibrary,
                       prompts: LearnerPrompts, llm: LLMClient, cfg: LearningConfig) -> ProposalBatch:
    group_id = group.problem.problem_id
    done = StageItems(STAGE, Proposal)
    reused = done.get(group_id)
    if reused is not None:
        progress.advance(STAGE)
        return ProposalBatch([reused])
    use_gt = cfg.use_groundtruth
    show_example = not llm.constrains_json("learner")
    messages = prompts.extract(group.problem, _attempts(group, summaries, use_gt), library.render_for_prompt(),
                               use_groundtruth=use_gt, max_ops=cfg.max_ops_per_group, min_words=cfg.min_words,
                               max_words=cfg.max_words, show_example=show_example)
    schema = operations_schema(cfg.max_ops_per_group, kinds=GROUP_KINDS, live_ids=[e.id for e in library],
                               min_words=cfg.min_words, max_words=cfg.max_words, pattern=cfg.lesson_pattern)
    try:
        reply = await llm.complete_operations(messages, stage=STAGE, json_schema=schema,
                                              repair=partial(prompts.repair, show_example=show_example))
    except LLMCallError as exc:
        return ProposalBatch([Proposal(group_id=group_id, parse_error=f"{CALL_FAILED}{exc}")], exc.calls)
    finally:
        progress.advance(STAGE)
    operations = [op.model_copy(update={"source_groups": [group_id]}) for op in reply.operations]
    proposal = Proposal(group_id=group_id, operations=operations, raw_text=reply.raw_text,
                        parse_error=reply.parse_error)
    if all(_has_summary(r, summaries) for r in group.rollouts):  # else redo it once the summaries are redone
        done.put(group_id, proposal)
    return ProposalBatch([proposal], reply.calls)


def _has_summary(rollout: Rollout, summaries: dict[tuple[str, int], Summary]) -> bool:
    summary = summaries.get((rollout.problem_id, rollout.sample_idx))
    return summary is not None and summary.error is None


def call_failed(proposal: Proposal) -> bool:
    """The learner call itself failed (after retries): a failed item, unlike a reply that could not be parsed
    (the model's answer, stored and counted)."""
    return (proposal.parse_error or "").startswith(CALL_FAILED)


async def extract_group_advantage(groups: list[Group], summaries: list[Summary], library: ExperienceLibrary,
                                  prompts: LearnerPrompts, llm: LLMClient, cfg: LearningConfig) -> ProposalBatch:
    """One proposal per selected group (possibly with no operations, or with a parse error)."""
    by_key = {(s.problem_id, s.sample_idx): s for s in summaries}
    parts = await asyncio.gather(*[_extract_one(g, by_key, library, prompts, llm, cfg) for g in groups])
    return ProposalBatch([p for part in parts for p in part.proposals], [c for part in parts for c in part.calls])


@stage_task(STAGE, run_name="group-advantage-step{step}-chunk{chunk}")
async def group_advantage_task(config: RunConfig, step: int, chunk: int, problems: list[Problem],
                               rollouts: list[Rollout], rewards: list[Reward], advantages: list[GroupAdvantage],
                               summaries: list[Summary], library: LibraryVersion) -> ProposalBatch:
    groups = build_groups(problems, rollouts, rewards, advantages)
    return await extract_group_advantage(groups, summaries, ExperienceLibrary.from_version(library),
                                         get_domain(config.domain).learner_prompts, shared_client(config),
                                         config.learning)
