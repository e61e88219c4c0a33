"""Stage: sample G rollouts per problem from the frozen policy, with the library in the prompt."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from clgrpo.process import progress
from clgrpo.prompts import Message
from clgrpo.prompts.rollout import ShownExample
from clgrpo.storage.journal import StageItems, sample_key
from domains import Domain, domain_for
from schemas.config import AgentConfig, RunConfig
from schemas.records import LibraryVersion, LLMCall, Problem, Rollout, Turn, text_hash
from schemas.stages import Stage
from tasks.agent import AgentOutcome, agent_rollout
from tasks.common import stage_task
from tasks.outputs import Rollouts


async def rollout_problem(
    problem: Problem,
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    group_size: int,
    temperature: float,
    seed: int | None = None,
    agent: AgentConfig | None = None,
    only: Sequence[int] | None = None,
) -> Rollouts:
    """G rollouts of one problem (agent rollouts when ``agent`` is set). Samples already in the work journal (an
    earlier attempt of this step) are reused; only the missing ones are sampled. A failed call fails only its
    own samples. ``only``: the sample indices wanted (the others exist elsewhere, e.g. an evaluation's stored
    samples): the batch holds those alone."""
    messages = policy_messages(problem, library, domain)
    prompt_hash = _prompt_hash(messages, domain, agent)
    base = dict(problem_id=problem.problem_id, prompt_hash=prompt_hash, library_version=library.version)
    wanted = list(range(group_size)) if only is None else sorted(set(only))
    done = StageItems(Stage.ROLLOUT, Rollout)
    rollouts = {
        i: r
        for i in wanted
        if (r := done.get(sample_key(problem.problem_id, i))) is not None and r.prompt_hash == prompt_hash
    }
    missing = [i for i in wanted if i not in rollouts]
    progress.advance(Stage.ROLLOUT, len(wanted) - len(missing))
    if not missing:
        return Rollouts([rollouts[i] for i in wanted])
    if agent is None:
        fresh, calls = await _direct_samples(messages, llm, base, missing, group_size, temperature, seed)
    else:
        fresh, calls = await _agent_samples(messages, domain, llm, agent, base, missing, temperature, seed)
    for rollout in fresh:
        if rollout.error is None:
            done.put(sample_key(problem.problem_id, rollout.sample_idx), rollout)
        rollouts[rollout.sample_idx] = rollout
    return Rollouts([rollouts[i] for i in wanted], calls)


def prompt_fingerprint(
    problem: Problem, library: ExperienceLibrary, domain: Domain, agent: AgentConfig | None = None
) -> str:
    """What the policy is shown for ``problem`` with ``library``: the rendered messages and the agent's tools."""
    return _prompt_hash(policy_messages(problem, library, domain), domain, agent)


def policy_messages(problem: Problem, library: ExperienceLibrary, domain: Domain) -> list[Message]:
    """What the policy is asked for ``problem`` with ``library``: the lessons shown to it and, when the library
    has worked examples, the few chosen for it (``ExperienceLibrary.examples_for``), as the library's view says.
    Without examples the domain is called as before examples existed (the same prompt, byte for byte)."""
    lessons = library.prompt_text_for(problem.problem_id)
    chosen = library.examples_for(problem)
    if not chosen:
        return domain.rollout_messages(problem, lessons)
    shown = [ShownExample(e.example.problem, e.text) for e in chosen if e.example is not None]
    return domain.rollout_messages(problem, lessons, shown, library.view.form)


def _prompt_hash(messages: list[dict], domain: Domain, agent: AgentConfig | None) -> str:
    return text_hash(json.dumps([messages, agent_signature(domain, agent)], sort_keys=True))


def agent_signature(domain: Domain, agent: AgentConfig | None) -> dict | None:
    """What besides the messages shapes an agent rollout (a journaled rollout is reused only if it matches)."""
    if agent is None:
        return None
    signature = {
        "tools": [t.spec() for t in domain.tools()],
        "agent": agent.model_dump(mode="json", exclude={"sandbox"}),
        "sandbox": agent.sandbox.model_dump(mode="json", exclude={"pool_size", "spares"}),
    }
    if (settings := getattr(domain, "settings", None)) is not None:  # the domain's tools' settings shape what
        signature[domain.name] = settings.model_dump(mode="json")  # its agent sees (web: as before, "web")
    return signature


async def _direct_samples(
    messages: list[dict],
    llm: LLMClient,
    base: dict,
    missing: list[int],
    group_size: int,
    temperature: float,
    seed: int | None,
) -> tuple[list[Rollout], list[LLMCall]]:
    try:
        sampled = await llm.sample(
            messages, group_size, stage=Stage.ROLLOUT, temperature=temperature, seed=seed, indices=missing
        )
    finally:
        progress.advance(Stage.ROLLOUT, len(missing))
    ok = [c for c in sampled.calls if c.ok]
    tokens_in = sum(c.tokens_in for c in ok) // max(1, len(ok))
    tokens_out = sum(c.tokens_out for c in ok) // max(1, len(missing) - len(sampled.failed))
    latency = max((c.latency_s for c in ok), default=0.0)
    fresh = []
    for sample in sampled.samples:
        if sample.error is not None:
            fresh.append(Rollout(**base, sample_idx=sample.index, error=sample.error))
        else:
            fresh.append(
                Rollout(
                    **base,
                    sample_idx=sample.index,
                    turns=[Turn(kind="assistant", content=sample.text)],
                    tokens_in=tokens_in,
                    tokens_out=tokens_out,
                    latency_s=latency,
                    finish_reason=sample.finish_reason,
                )
            )
    return fresh, sampled.calls


async def _agent_samples(
    messages: list[dict],
    domain: Domain,
    llm: LLMClient,
    agent: AgentConfig,
    base: dict,
    missing: list[int],
    temperature: float,
    seed: int | None,
) -> tuple[list[Rollout], list[LLMCall]]:
    """One agent loop per missing sample, concurrently. Sample i uses seed + i (the problem's seed, else the
    policy's), as a separate direct call does: the G samples of a seeded endpoint must differ."""
    tools = domain.tools()
    first = seed if seed is not None else llm.configs["policy"].seed

    async def one(index: int) -> AgentOutcome:
        try:
            return await agent_rollout(
                messages,
                tools,
                llm,
                agent,
                base={**base, "sample_idx": index},
                temperature=temperature,
                seed=None if first is None else first + index,
            )
        finally:
            progress.advance(Stage.ROLLOUT)

    outcomes = await asyncio.gather(*[one(i) for i in missing])
    return [o.rollout for o in outcomes], [c for o in outcomes for c in o.calls]


async def rollout(
    problems: list[Problem],
    library: ExperienceLibrary,
    domain: Domain,
    llm: LLMClient,
    *,
    group_size: int,
    temperature: float,
    seeds: Mapping[str, int] | None = None,
    agent: AgentConfig | None = None,
) -> Rollouts:
    """G samples for each problem; a sample whose policy call failed after retries is a rollout with ``error``
    set (stored and counted). Raises if every call failed: the endpoint is unusable.
    ``seeds``: a sampling seed per problem id (sample i of a problem sent separately gets seed + i).
    ``agent``: make agent rollouts with the domain's tools (``tasks.agent``); None: direct answers."""
    seeds = seeds or {}
    parts = await asyncio.gather(
        *[
            rollout_problem(p, library, domain, llm, group_size, temperature, seeds.get(p.problem_id), agent)
            for p in problems
        ]
    )
    batch = Rollouts.joined(parts)
    raise_if_all_failed(problems, batch.rollouts)
    return batch


def raise_if_all_failed(problems: list[Problem], rollouts: list[Rollout]) -> None:
    """Every policy call failed after its retries: the endpoint is unusable, fail the stage."""
    if problems and all(r.error is not None for r in rollouts):
        raise RuntimeError(f"rollout: all {len(problems)} policy calls failed; first error: {rollouts[0].error}")


@stage_task(Stage.ROLLOUT, run_name="rollout-step{step}-chunk{chunk}")
async def rollout_task(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], library: LibraryVersion
) -> Rollouts:
    return await rollout(
        problems,
        ExperienceLibrary.from_version(library),
        domain_for(config),
        shared_client(config),
        group_size=config.grpo.group_size,
        temperature=config.grpo.rollout_temperature,
        agent=config.rollout.agent_settings(),
    )
