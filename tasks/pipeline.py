"""Pipelined rollout -> verify -> summarize -> group advantage, one group at a time.

A group's summaries and semantic advantage start as soon as its own G rollouts are verified, instead of after
the whole batch: with long-tailed LLM latencies the slowest rollouts no longer hold every learner call back.
Each of those stages has a per-group form here (``rollout_group``, ``verify_group``, ``summarize_group``,
``propose_group``), named by its ``STEP`` entry in ``flows/step.py`` (``group=``): the pipeline chains the forms
``STEP`` names, in its order, for every problem. They do exactly the stage functions' work (same prompts, same
records); the LLM client's semaphore is the only concurrency limit. The result carries each stage's typed
output, so the flow still writes the stages one by one, each atomically, as the stage-by-stage path does
(consolidation waits for all groups there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from clgrpo.process import progress
from domains import Domain, domain_for
from schemas.config import AgentConfig, LearningConfig, RunConfig
from schemas.records import LibraryVersion, Problem
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.group_advantage import Group, build_groups, extract_group_advantage
from tasks.judge import Judge, make_judge
from tasks.outputs import GroupProposals, Out, Rollouts, StageOutput, Summaries, Verified
from tasks.rollout import raise_if_all_failed, rollout_problem
from tasks.summarize import summarize
from tasks.verify import compute_group_advantages, grade


@dataclass
class GroupContext:
    """What every group of a chunk shares."""

    library: ExperienceLibrary
    domain: Domain
    llm: LLMClient
    group_size: int
    temperature: float
    cfg: LearningConfig
    agent: AgentConfig | None = None
    judge: Judge | None = None
    policy_model: str = ""  # the author of a worked example taken from a rollout


@dataclass
class GroupWork:
    """One problem's group on its way through the pipelined stages: each stage's typed output for this group (its
    rows of the stage's tables), and the group itself once it is selected for learning."""

    problem: Problem
    context: GroupContext
    outputs: dict[type[StageOutput], StageOutput] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)  # the problem's group when selected for learning

    def get(self, kind: type[Out]) -> Out:
        found = self.outputs.get(kind)
        return found if isinstance(found, kind) else kind()


# a stage's per-group form: adds its work to the group's; False when the later stages have nothing to do for it
GroupStage = Callable[[GroupWork], Awaitable[bool]]
# a pipelined stage: its per-group form and the output type it adds to each group's work
PerGroup = tuple[GroupStage, type[StageOutput]]


async def rollout_group(w: GroupWork) -> bool:
    c = w.context
    w.outputs[Rollouts] = await rollout_problem(
        w.problem, c.library, c.domain, c.llm, c.group_size, c.temperature, agent=c.agent
    )
    return True


async def verify_group(w: GroupWork) -> bool:
    c = w.context
    rollouts = w.get(Rollouts).rollouts
    rewards = await grade([w.problem], rollouts, c.domain, c.judge, c.cfg.unlabeled)
    advantages = compute_group_advantages([w.problem], rollouts, rewards, use_groundtruth=c.cfg.use_groundtruth)
    w.outputs[Verified] = Verified(rewards, advantages[:1])
    w.groups = build_groups([w.problem], rollouts, rewards, advantages)
    if w.groups:  # the learner stages' progress bars grow as groups are selected
        progress.expect(Stage.SUMMARIZE, sum(len(g.rollouts) for g in w.groups) if c.cfg.summarize else 0)
        progress.expect(Stage.GROUP_ADVANTAGE, len(w.groups))
    return bool(w.groups)


async def summarize_group(w: GroupWork) -> bool:
    c = w.context
    if c.cfg.summarize:
        w.outputs[Summaries] = await summarize(w.groups, c.library, c.domain.learner_prompts.ask(c.cfg), c.llm)
    return True


async def propose_group(w: GroupWork) -> bool:
    c = w.context
    prompts = c.domain.learner_prompts
    summaries = w.get(Summaries).summaries
    w.outputs[GroupProposals] = await extract_group_advantage(
        w.groups, summaries, c.library, prompts, c.llm, c.cfg, c.policy_model
    )
    return True


@dataclass
class PipelineBatch:
    """The typed outputs of the pipelined stages for a set of problems, in the order the stage-by-stage path
    produces them (verify's LLM-judge calls come from the work journal, as there)."""

    outputs: dict[type[StageOutput], StageOutput]

    @classmethod
    def of(cls, works: Sequence[GroupWork], kinds: Sequence[type[StageOutput]]) -> PipelineBatch:
        """Each stage's output over the groups, in group order (a group that stopped early adds nothing)."""
        return cls({kind: kind.joined([w.get(kind) for w in works]) for kind in kinds})

    @classmethod
    def merge(cls, parts: Sequence[PipelineBatch]) -> PipelineBatch:
        kinds = parts[0].outputs if parts else {}
        return cls({kind: kind.joined([part.outputs[kind] for part in parts]) for kind in kinds})

    def output(self, kind: type[StageOutput]) -> StageOutput | None:
        """The output of type ``kind`` of one of the pipelined stages; None for the other stages' types."""
        return self.outputs.get(kind)


async def _through(work: GroupWork, chain: Sequence[PerGroup]) -> GroupWork:
    for stage, _ in chain:
        if not await stage(work):
            break
    return work


async def pipeline(problems: list[Problem], context: GroupContext, chain: Sequence[PerGroup]) -> PipelineBatch:
    """Every group runs its own chain of per-group stages; raises, like ``rollout``, if every policy call
    failed."""
    works = await asyncio.gather(*[_through(GroupWork(p, context), chain) for p in problems])
    batch = PipelineBatch.of(works, [kind for _, kind in chain])
    raise_if_all_failed(problems, [r for w in works for r in w.get(Rollouts).rollouts])
    return batch


@stage_task(Stage.PIPELINE, run_name="pipeline-step{step}-chunk{chunk}")
async def pipeline_task(
    config: RunConfig,
    step: int,
    chunk: int,
    problems: list[Problem],
    library: LibraryVersion,
    chain: Sequence[PerGroup],
) -> PipelineBatch:
    """``chain``: the per-group forms of the stages ``STEP`` pipelines, in its order, with their outputs."""
    domain = domain_for(config)
    context = GroupContext(
        ExperienceLibrary.from_version(library),
        domain,
        shared_client(config),
        group_size=config.grpo.group_size,
        temperature=config.grpo.rollout_temperature,
        cfg=config.learning,
        agent=config.rollout.agent_settings(),
        judge=make_judge(config, domain, Stage.VERIFY),
        policy_model=config.policy.model,
    )
    return await pipeline(problems, context, chain)
