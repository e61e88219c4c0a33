"""One measurement: a library answers problems k times at given seeds, graded.

Evaluation, lesson trials and the library gate all measure through ``measure``, with one seed scheme
(``sample_seeds``: sample i of a problem uses its base seed + i) and one sample record
(``schemas.records.Sample``). A sample is keyed by what determines it (``draw_key``): the policy model (its
identity: what its endpoint stated of the weights at the preflight, and ``revision``) and its sampling settings,
the rendered prompt (the library as shown, the problem, the template, the agent's tools), the reference it is
graded against, and the seed. A sample whose key is already stored is read, not drawn again; only the missing ones
are drawn. Changing anything in the key (the prompt template, the model or the weights behind its name, the
temperature) draws anew. A model known by its name only (an endpoint that states nothing of it, and no revision)
keys as samples did before identities existed, so those are read there; wherever an identity is known they are
not (their key has none) and are drawn again.

llama-server's batched slots are not bit-reproducible: a stored sample is one valid draw for its key, not a
claim that its seed reproduces the text. Comparisons pair two arms by problem and sample index.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient
from clgrpo.process import progress
from domains import Domain, domain_settings
from schemas.config import IDENTITY_FIELDS, AgentConfig, ModelConfig, RunConfig
from schemas.config_migrations import not_fingerprinted
from schemas.records import LLMCall, Problem, Reward, Rollout, Sample, text_hash, utcnow
from schemas.stages import Stage
from tasks.checks_budget import Allowance, tokens
from tasks.judge import Judge
from tasks.rollout import policy_messages, prompt_fingerprint, raise_if_all_failed, rollout_problem
from tasks.verify import grade

_SEED_SPACE = 2**31 - 2**16  # room for seed + sample index in a signed 32-bit seed

# how the policy is reached, not what it answers (its fields marked ``NotFingerprinted``): a server restarted on
# another port, a longer timeout, another key, or samples asked together (n) instead of one by one still draw the
# same samples; the temperature is the call's own
_NOT_DRAWN_BY = not_fingerprinted(ModelConfig, kept_by_runs=True) | {"supports_n", "json_schema", "temperature"}


def model_payload(cfg: ModelConfig, exclude: set[str] | None) -> dict[str, Any]:
    """A model's settings as keys and fingerprints hash them, without ``exclude`` and without its identity (which
    enters as ``identity_of``, only where something is known beyond the name: older keys stay as they were)."""
    return cfg.model_dump(mode="json", exclude=(exclude or set()) | IDENTITY_FIELDS)


def identity_of(cfg: ModelConfig) -> str | None:
    """The model's identity key (``ModelIdentity.key``): None where only its name is known."""
    return cfg.identity().key


Known = Callable[[str], Sample | None]  # a stored sample by its draw key, None if there is none


def sample_seeds(problems: Sequence[Problem], seed: int) -> dict[str, int]:
    """The base sampling seed of each problem (sample i uses base + i): a function of the seed and the problem
    id only, never of the library, the step, the stage or the problem's position."""
    return {p.problem_id: int(text_hash(f"{seed}:{p.problem_id}"), 16) % _SEED_SPACE for p in problems}


@dataclass(frozen=True)
class Sampling:
    """What besides the prompt and the seed determines a draw: ``identity`` hashes the policy (without how it
    is reached; with the model's identity where one is known), the temperature, the domain and what grades (the
    judge's model when one grades). ``model``: the policy's identity in one line, stored with each sample drawn
    (None: not asked at a preflight)."""

    identity: str
    temperature: float
    agent: AgentConfig | None = None
    model: str | None = None

    @classmethod
    def of(cls, config: RunConfig, temperature: float) -> Sampling:
        agent = config.rollout.agent_settings()
        settings = domain_settings(config) if config.domain_settings else None  # as read by the domain's model
        payload: dict[str, Any] = {
            "policy": model_payload(config.policy, _NOT_DRAWN_BY),
            "temperature": temperature,
            "domain": config.domain,
            "domain_settings": settings.model_dump(mode="json") if settings is not None else {},
        }
        if (policy := identity_of(config.policy)) is not None:
            payload["identity"] = policy
        if config.judge is not None:
            learner = config.learner or config.policy
            payload["judge"] = [config.judge.model_dump(mode="json"), model_payload(learner, _NOT_DRAWN_BY)]
            if (grader := identity_of(learner)) is not None:
                payload["judge"].append(grader)
        identity = config.policy.identity()
        label = identity.label if identity.checked else None
        return cls(text_hash(json.dumps(payload, sort_keys=True)), temperature, agent, label)


def sampling_at(config: RunConfig, temperature: float | None) -> Sampling:
    """A check's sampling: its own temperature, or the rollouts' when it sets none."""
    return Sampling.of(config, temperature if temperature is not None else config.grpo.rollout_temperature)


def draw_key(sampling: Sampling, prompt_hash: str, problem: Problem, seed: int) -> str:
    return text_hash(json.dumps([sampling.identity, prompt_hash, problem.answer, seed]))


def draw_keys(
    problems: Sequence[Problem],
    library: ExperienceLibrary,
    k: int,
    seeds: Mapping[str, int],
    sampling: Sampling,
    domain: Domain,
) -> dict[tuple[str, int], str]:
    """The draw key of each (problem, sample index)."""
    keys = {}
    for p in problems:
        prompt_hash = prompt_fingerprint(p, library, domain, sampling.agent)
        for i in range(k):
            keys[(p.problem_id, i)] = draw_key(sampling, prompt_hash, p, seeds[p.problem_id] + i)
    return keys


def to_draw(
    problems: Sequence[Problem],
    library: ExperienceLibrary,
    k: int,
    seeds: Mapping[str, int],
    sampling: Sampling,
    domain: Domain,
    known: Mapping[str, Sample],
) -> int:
    """How many of the k samples of ``problems`` with ``library`` a measurement would draw (not ``known``)."""
    keys = draw_keys(problems, library, k, seeds, sampling, domain)
    return sum(1 for key in keys.values() if key not in known or not known[key].reusable)


def reusable(samples: Sequence[Sample]) -> dict[str, Sample]:
    """The samples a later measurement may read, by draw key (the first of each key)."""
    out: dict[str, Sample] = {}
    for s in samples:
        if s.reusable and s.draw_key not in out:
            out[s.draw_key] = s  # type: ignore[index]  # reusable: keyed
    return out


def nothing_known(_key: str) -> Sample | None:
    return None


@dataclass
class Measured:
    samples: list[Sample]  # every (problem, sample index) measured, in problem order then index order
    calls: list[LLMCall] = field(default_factory=list)
    undrawn: int = 0  # samples not drawn because the allowance stopped the measurement (then missing above)


# the most tokens a chat template adds to a prompt beside its messages' bytes (a default system prompt, BOS) and
# per message (role markers, special tokens); a tokenizer's token is at least a byte of text
TEMPLATE_TOKENS = 64
MESSAGE_TOKENS = 16


def prompt_bound(messages: Sequence[Mapping[str, Any]]) -> int:
    """The most prompt tokens ``messages`` can be: a token per byte of their JSON, and the template's."""
    return TEMPLATE_TOKENS + sum(MESSAGE_TOKENS + len(json.dumps(m, ensure_ascii=False).encode()) for m in messages)


def worst_cost(problem: Problem, library: ExperienceLibrary, domain: Domain, max_tokens: int) -> tuple[int, int]:
    """The most tokens a direct request for samples of ``problem`` can cost, as (what the request costs once, what
    each sample adds): its prompt (``prompt_bound``) and ``max_tokens`` per reply."""
    return prompt_bound(policy_messages(problem, library, domain)), max_tokens


def as_sample(sample: Sample) -> Sample:
    """The measurement fields of a role record (an evaluation, trial or gate sample)."""
    return Sample(**{name: getattr(sample, name) for name in Sample.model_fields})


async def measure(
    problems: Sequence[Problem],
    library: ExperienceLibrary,
    k: int,
    seeds: Mapping[str, int],
    sampling: Sampling,
    domain: Domain,
    llm: LLMClient,
    *,
    stage: Stage,
    known: Known = nothing_known,
    judge: Judge | None = None,
    keep: Callable[[Sample], None] | None = None,
    count_read: bool = True,
    allowance: Allowance | None = None,
) -> Measured:
    """k graded samples of every problem with ``library`` in the prompt: those ``known`` by their draw key are
    read (``drawn`` False), the rest drawn, graded and handed to ``keep`` as each problem's come back (so a
    stopped measurement loses only the replies in flight). Progress counts on ``stage`` (the samples read too,
    unless ``count_read`` is False: the caller counted them); the calls are labelled with it. Raises if every call
    failed (the endpoint is unusable). With an ``allowance`` (a check's share of the checks budget; direct rollouts
    only) a request is sent only if the most it can cost (``worst_cost``) fits what is left of it; the first that
    does not asks for the samples that fit, if any, and no later one is sent: the samples not drawn are missing
    from the result (``undrawn``) and counted on the progress all the same."""
    keys = draw_keys(problems, library, k, seeds, sampling, domain)
    have: dict[tuple[str, int], Sample] = {}
    for (pid, i), key in keys.items():
        if (stored := known(key)) is not None and stored.reusable:
            have[(pid, i)] = as_sample(stored).model_copy(
                update={"problem_id": pid, "sample_idx": i, "seed": seeds[pid] + i, "drawn": False}
            )
    if count_read:
        progress.advance(stage, len(have))
    todo = {p.problem_id: [i for i in range(k) if (p.problem_id, i) not in have] for p in problems}
    wanted = [p for p in problems if todo[p.problem_id]]

    max_tokens = llm.configs["policy"].max_tokens
    undrawn = 0

    async def draw(problem: Problem, indices: list[int]) -> tuple[list[Rollout], list[LLMCall]]:
        nonlocal undrawn
        pid = problem.problem_id
        worst = 0
        if allowance is not None and sampling.agent is None:
            once, each = worst_cost(problem, library, domain, max_tokens)
            granted = await allowance.reserve(once, each, len(indices))
            if granted < len(indices):
                undrawn += len(indices) - granted
                progress.advance(stage, len(indices) - granted)
                indices = indices[:granted]
            if not indices:
                return [], []
            worst = once + granted * each
        try:
            batch = await rollout_problem(
                problem, library, domain, llm, k, sampling.temperature, seeds[pid], sampling.agent, indices
            )
        except BaseException:
            if allowance is not None:  # what it cost is unknown: the most it could
                await allowance.settle(worst, worst)
            raise
        if allowance is not None:
            await allowance.settle(worst, tokens(batch.llm_calls))
        graded = await grade([problem], batch.rollouts, domain, judge)
        for r, g in zip(batch.rollouts, graded):
            sample = graded_sample(
                r, g, seeds[pid] + r.sample_idx, keys[(pid, r.sample_idx)], model=sampling.model, drawn_at=utcnow()
            )
            have[(pid, r.sample_idx)] = sample
            if keep is not None:
                keep(sample)
        progress.advance(stage, len(batch.rollouts))
        return batch.rollouts, batch.llm_calls

    # one request per problem where the endpoint returns n samples at once (the prompt is paid once); else one
    # per sample, each kept as it comes
    together = llm.configs["policy"].supports_n and sampling.agent is None
    work = (
        [(p, todo[p.problem_id]) for p in wanted]
        if together
        else [(p, [i]) for p in wanted for i in todo[p.problem_id]]
    )
    parts = await asyncio.gather(*[draw(p, indices) for p, indices in work])
    sent = list({p.problem_id: p for (p, _), (rollouts, _) in zip(work, parts) if rollouts}.values())
    raise_if_all_failed(sent, [r for rollouts, _ in parts for r in rollouts])
    calls = [c.model_copy(update={"stage": stage.value}) for _, part_calls in parts for c in part_calls]
    measured = [have[(p.problem_id, i)] for p in problems for i in range(k) if (p.problem_id, i) in have]
    return Measured(measured, calls, undrawn)


def graded_sample(
    r: Rollout, g: Reward, seed: int, key: str, *, model: str | None = None, drawn_at: datetime | None = None
) -> Sample:
    """A graded rollout as a sample drawn under ``key`` by ``model`` (its identity, ``Sampling.model``)."""
    return Sample(
        problem_id=r.problem_id,
        sample_idx=r.sample_idx,
        seed=seed,
        reward=g.reward,
        extracted=g.extracted,
        error=r.error or g.error,
        judge_reason=g.judge_reason,
        final_text=r.final_text,
        tokens_in=r.tokens_in,
        tokens_out=r.tokens_out,
        latency_s=r.latency_s,
        n_turns=r.n_turns,
        tool_calls=r.tool_calls,
        tool_errors=r.tool_errors,
        draw_key=key,
        drawn=True,
        model_identity=model,
        drawn_at=drawn_at,
    )
