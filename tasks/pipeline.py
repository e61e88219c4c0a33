"""Pipelined rollout -> verify -> summarize -> group advantage, one group at a time.

A group's summaries and semantic advantage start as soon as its own G rollouts are verified, instead of after
the whole batch: with long-tailed LLM latencies the slowest rollouts no longer hold every learner call back.
The work per group is exactly the stage functions' (same prompts, same records); the LLM client's semaphore
is the only concurrency limit. The result carries each stage's outputs, so the flow still writes the four
stages one by one, each atomically, as the barrier path does (consolidation waits for all groups there).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from clgrpo import progress
from clgrpo.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from domains import Domain, domain_for
from schemas.config import AgentConfig, LearningConfig, RunConfig
from schemas.records import GroupAdvantage, LibraryVersion, LLMCall, Problem, Proposal, Reward, Rollout, Summary
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.group_advantage import build_groups, extract_group_advantage
from tasks.judge import Judge, make_judge
from tasks.outputs import GroupProposals, Rollouts, StageOutput, Summaries, Verified
from tasks.rollout import RolloutBatch, raise_if_all_failed, rollout_problem
from tasks.summarize import SummaryBatch, summarize
from tasks.verify import compute_group_advantages, grade


@dataclass
class GroupOutcome:
    rollouts: RolloutBatch
    rewards: list[Reward]
    advantage: GroupAdvantage | None
    summaries: list[Summary] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)
    summary_calls: list[LLMCall] = field(default_factory=list)
    proposal_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class PipelineBatch:
    """The outputs of the rollout, verify, summarize and group-advantage stages for a set of problems,
    in the order the stage-by-stage path produces them."""

    rollouts: list[Rollout]
    rollout_calls: list[LLMCall]
    rewards: list[Reward]
    advantages: list[GroupAdvantage]
    summaries: list[Summary]
    summary_calls: list[LLMCall]
    proposals: list[Proposal]
    proposal_calls: list[LLMCall]

    @classmethod
    def of(cls, outcomes: list[GroupOutcome]) -> "PipelineBatch":
        return cls(
            rollouts=[r for o in outcomes for r in o.rollouts.rollouts],
            rollout_calls=[c for o in outcomes for c in o.rollouts.calls],
            rewards=[r for o in outcomes for r in o.rewards],
            advantages=[o.advantage for o in outcomes if o.advantage is not None],
            summaries=[s for o in outcomes for s in o.summaries],
            summary_calls=[c for o in outcomes for c in o.summary_calls],
            proposals=[p for o in outcomes for p in o.proposals],
            proposal_calls=[c for o in outcomes for c in o.proposal_calls],
        )

    @classmethod
    def merge(cls, parts: list["PipelineBatch"]) -> "PipelineBatch":
        return cls(**{name: [x for part in parts for x in getattr(part, name)] for name in cls.__dataclass_fields__})

    def output(self, kind: type[StageOutput]) -> StageOutput | None:
        """The output of type ``kind`` of one of the four stages, as the flow writes it (verify's calls, an LLM
        judge's, come from the work journal); None for the other stages' types."""
        outputs: dict[type[StageOutput], StageOutput] = {
            Rollouts: Rollouts(self.rollouts, self.rollout_calls),
            Verified: Verified(self.rewards, self.advantages),
            Summaries: Summaries(self.summaries, self.summary_calls),
            GroupProposals: GroupProposals(self.proposals, self.proposal_calls),
        }
        return outputs.get(kind)


async def _one_group(
    problem: Problem,
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    *,
    group_size: int,
    temperature: float,
    cfg: LearningConfig,
    agent: AgentConfig | None = None,
    judge: Judge | None = None,
) -> GroupOutcome:
    batch = await rollout_problem(problem, library, domain, llm, group_size, temperature, agent=agent)
    rewards = await grade([problem], batch.rollouts, domain, judge, cfg.unlabeled)
    advantages = compute_group_advantages([problem], batch.rollouts, rewards, use_groundtruth=cfg.use_groundtruth)
    outcome = GroupOutcome(batch, rewards, advantages[0] if advantages else None)
    groups = build_groups([problem], batch.rollouts, rewards, advantages)
    if not groups:
        return outcome
    progress.expect(Stage.SUMMARIZE, sum(len(g.rollouts) for g in groups) if cfg.summarize else 0)
    progress.expect(Stage.GROUP_ADVANTAGE, len(groups))
    prompts = domain.learner_prompts
    summaries = await summarize(groups, library, prompts.ask(cfg), llm) if cfg.summarize else SummaryBatch([])
    proposals = await extract_group_advantage(groups, summaries.summaries, library, prompts, llm, cfg)
    outcome.summaries, outcome.summary_calls = summaries.summaries, summaries.calls
    outcome.proposals, outcome.proposal_calls = proposals.proposals, proposals.calls
    return outcome


async def pipeline(
    problems: list[Problem],
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    *,
    group_size: int,
    temperature: float,
    cfg: LearningConfig,
    agent: AgentConfig | None = None,
    judge: Judge | None = None,
) -> PipelineBatch:
    """Every group runs its own chain; raises, like ``rollout``, if every policy call failed."""
    outcomes = await asyncio.gather(
        *[
            _one_group(
                p,
                library,
                domain,
                llm,
                group_size=group_size,
                temperature=temperature,
                cfg=cfg,
                agent=agent,
                judge=judge,
            )
            for p in problems
        ]
    )
    batch = PipelineBatch.of(outcomes)
    raise_if_all_failed(problems, batch.rollouts)
    return batch


@stage_task(Stage.PIPELINE, run_name="pipeline-step{step}-chunk{chunk}")
async def pipeline_task(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], library: LibraryVersion
) -> PipelineBatch:
    domain = domain_for(config)
    return await pipeline(
        problems,
        ExperienceLibrary.from_version(library),
        domain,
        shared_client(config),
        group_size=config.grpo.group_size,
        temperature=config.grpo.rollout_temperature,
        cfg=config.learning,
        agent=config.rollout.agent_settings(),
        judge=make_judge(config, domain, Stage.VERIFY),
    )
