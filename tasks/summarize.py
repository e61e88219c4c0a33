"""Stage: the learner summarizes each rollout of the selected groups (``learning.summarize: false``: none; the
stage still runs and is stored, empty, and the extractor reads the attempts themselves)."""

from __future__ import annotations

import asyncio

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMCallError, LLMClient, shared_client
from clgrpo.process import progress
from clgrpo.prompts.attempts import Attempt, tool_trace, trajectory_text
from clgrpo.prompts.lessons import LessonAsk
from clgrpo.prompts.summarize import summarize_messages
from clgrpo.storage.journal import StageItems, sample_key
from domains import domain_for
from schemas.config import RunConfig
from schemas.records import GroupAdvantage, LibraryVersion, Problem, Reward, Rollout, Summary
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.group_advantage import Group, build_groups
from tasks.outputs import Summaries


async def _summarize_one(
    problem: Problem,
    rollout: Rollout,
    reward: Reward,
    library_text: str,
    ask: LessonAsk,
    llm: LLMClient,
) -> Summaries:
    base = dict(problem_id=rollout.problem_id, sample_idx=rollout.sample_idx)
    done = StageItems(Stage.SUMMARIZE, Summary)
    reused = done.get(sample_key(rollout.problem_id, rollout.sample_idx))
    if reused is not None:
        progress.advance(Stage.SUMMARIZE)
        return Summaries([reused])
    attempt = Attempt(
        rollout.sample_idx,
        trajectory_text(rollout.turns),
        reward.reward if ask.use_groundtruth else None,
        truncated=rollout.truncated,
        tools=tool_trace(rollout.turns),
    )
    messages = summarize_messages(ask, problem, attempt, library_text)
    try:
        reply = await llm.complete(messages, stage=Stage.SUMMARIZE)
    except LLMCallError as exc:
        return Summaries([Summary(**base, text="", error=str(exc))], exc.calls)
    finally:
        progress.advance(Stage.SUMMARIZE)
    text = reply.text.strip()
    summary = Summary(**base, text=text, error=None if text else "empty summary")
    if text:
        done.put(sample_key(rollout.problem_id, rollout.sample_idx), summary)
    return Summaries([summary], reply.calls)


async def summarize(groups: list[Group], library: ExperienceLibrary, ask: LessonAsk, llm: LLMClient) -> Summaries:
    """One summary per rollout; a failed call leaves a summary with ``error`` (the extractor then reads the
    trajectory itself). ``ask``: the learner prompts' settings (``LearnerPrompts.ask``)."""
    parts = await asyncio.gather(
        *[
            _summarize_one(g.problem, r, w, library.prompt_text_for(g.problem.problem_id), ask, llm)
            for g in groups
            for r, w in zip(g.rollouts, g.rewards)
        ]
    )
    return Summaries.joined(parts)


@stage_task(Stage.SUMMARIZE, run_name="summarize-step{step}-chunk{chunk}")
async def summarize_task(
    config: RunConfig,
    step: int,
    chunk: int,
    problems: list[Problem],
    rollouts: list[Rollout],
    rewards: list[Reward],
    advantages: list[GroupAdvantage],
    library: LibraryVersion,
) -> Summaries:
    if not config.learning.summarize:
        return Summaries([])
    groups = build_groups(problems, rollouts, rewards, advantages)
    return await summarize(
        groups,
        ExperienceLibrary.from_version(library),
        domain_for(config).learner_prompts.ask(config.learning),
        shared_client(config),
    )
