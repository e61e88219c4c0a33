"""Stage: the semantic group advantage: for each selected group, the learner's proposal for the library.

(The numeric advantage of every group, and which groups are selected, is verify's second output:
``tasks.verify.compute_group_advantages``.) The learner compares the attempts and proposes operations on the
library, returned as a ``Proposal`` per group (parse failures kept with the raw text). Two ways to ask
(``learning.extract``): ``operations`` shows every attempt (the attempt itself and its summary) and asks for a
JSON edit list; ``contrast`` shows one correct and one wrong attempt side by side and asks for the step where
they part and one lesson, ``learning.candidates`` times over other pairs and draws (lesson validation then
chooses among them). ``learning.fallback: contrast`` asks the contrast way when an operations reply has no
usable operation. Every learner reply of a group is kept in its proposal's ``raw_text``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from dataclasses import dataclass
from functools import partial

from clgrpo.experience.example_checks import example_flaw
from clgrpo.experience.library import ExperienceLibrary, word_count
from clgrpo.llm import LLMCallError, LLMClient, shared_client
from clgrpo.llm.structured import StructuredOutputError, parse_contrast
from clgrpo.process import progress
from clgrpo.prompts.attempts import Attempt, clip, tool_trace, trajectory_text
from clgrpo.prompts.contrast import contrast_messages, generalize_messages
from clgrpo.prompts.extract import extract_messages
from clgrpo.prompts.lessons import LessonAsk
from clgrpo.prompts.repair import repair_messages
from clgrpo.storage.journal import StageItems
from domains import domain_for
from domains.learner import GROUP_KINDS, LearnerPrompts, LessonScreen, contrast_schema, operations_schema
from schemas.config import LearningConfig, RunConfig
from schemas.records import (
    GroupAdvantage,
    LibraryVersion,
    LLMCall,
    Operation,
    OpKind,
    Problem,
    Proposal,
    Reward,
    Rollout,
    Summary,
    WorkedExample,
)
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.outputs import GroupProposals

CALL_FAILED = "learner call failed: "

ATTEMPT_CHARS = 3000  # of each attempt's trajectory shown to the extractor (head and tail)


@dataclass
class Group:
    """A selected group as the learner stages see it."""

    problem: Problem
    rollouts: list[Rollout]
    rewards: list[Reward]


def build_groups(
    problems: list[Problem], rollouts: list[Rollout], rewards: list[Reward], advantages: list[GroupAdvantage]
) -> list[Group]:
    selected = {a.problem_id for a in advantages if a.selected}
    reward_of = {(r.problem_id, r.sample_idx): r for r in rewards}
    # a sample the learner may see: not failed, and graded unless the group has no ground truth
    usable = [
        r
        for r in rollouts
        if r.error is None
        and r.problem_id in selected
        and (reward_of[(r.problem_id, r.sample_idx)].graded or reward_of[(r.problem_id, r.sample_idx)].verified)
    ]
    return [
        Group(
            p,
            [r for r in usable if r.problem_id == p.problem_id],
            [reward_of[(r.problem_id, r.sample_idx)] for r in usable if r.problem_id == p.problem_id],
        )
        for p in problems
        if p.problem_id in selected
    ]


@dataclass(frozen=True)
class Learner:
    """What every ask of the stage shares: the domain's wording (and its screen of copied lessons), the
    prompts' settings built once from the learning config, the client and the learning config itself."""

    prompts: LearnerPrompts
    ask: LessonAsk
    llm: LLMClient
    cfg: LearningConfig
    policy_model: str = ""  # the author of a worked example taken from a rollout

    @classmethod
    def of(cls, prompts: LearnerPrompts, llm: LLMClient, cfg: LearningConfig, policy_model: str = "") -> Learner:
        return cls(prompts, prompts.ask(cfg), llm, cfg, policy_model)


def _attempts(group: Group, summaries: dict[tuple[str, int], Summary], use_groundtruth: bool) -> list[Attempt]:
    """Each attempt as the extractor sees it: the trajectory itself (tool calls and results inline for agent
    rollouts), with its summary when there is one."""
    attempts = []
    for rollout, reward in zip(group.rollouts, group.rewards):
        summary = summaries.get((rollout.problem_id, rollout.sample_idx))
        agent = _used_tools(rollout)
        attempts.append(
            Attempt(
                rollout.sample_idx,
                clip(trajectory_text(rollout.turns), ATTEMPT_CHARS),
                reward.reward if use_groundtruth else None,
                truncated=rollout.truncated,
                tools="" if agent else tool_trace(rollout.turns),
                summary=summary.text if summary and not summary.error else "",
            )
        )
    return attempts


def worked_example(group: Group, author: str) -> Operation | None:
    """The group's candidate worked example: the attempt the group advantage favours most (the highest reward,
    above the group mean; finished, not cut off; the shortest of those whose text has no flaw an example must not
    show, ``clgrpo.experience.example_checks``), kept whole, when it was graded (against the problem's answer, by
    the judge, or, for a trace without a reference, by the group's agreement); None when no attempt qualifies."""
    graded = [(r, w) for r, w in zip(group.rollouts, group.rewards) if w.reward is not None]
    if not graded:
        return None
    mean = statistics.fmean(w.reward for _, w in graded if w.reward is not None)
    best = max(w.reward for _, w in graded if w.reward is not None)
    favoured = [
        (r, w)
        for r, w in graded
        if w.reward == best and best > mean and not r.truncated and w.reward_source is not None
    ]
    if not favoured:
        return None
    favoured.sort(key=lambda rw: (len(rw[0].final_text), rw[0].sample_idx))
    flaws = {r.sample_idx: example_flaw(r.final_text, used_tools=_used_tools(r)) for r, _ in favoured}
    clean = [(r, w) for r, w in favoured if flaws[r.sample_idx] is None]
    if not clean:
        return None
    rollout, reward = clean[0]
    passed = "".join(f"; attempt {i} not shown: {why}" for i, why in flaws.items() if why is not None)
    answer = group.problem.answer or reward.extracted
    if answer is None or not rollout.final_text.strip():
        return None
    example = WorkedExample(
        problem=group.problem.problem,
        answer=answer,
        author=author,
        reward=best,
        origin="rollout",
        task_tag=group.problem.tag,
    )
    return Operation(
        op=OpKind.ADD,
        text=rollout.final_text.strip(),
        rationale=f"worked example: attempt {rollout.sample_idx}, reward {best:g} against the group mean {mean:.2f}"
        + passed,
        source_groups=[group.problem.problem_id],
        example=example,
    )


def _used_tools(rollout: Rollout) -> bool:
    return any(t.kind != "assistant" for t in rollout.turns)


def contrast_pairs(group: Group) -> list[tuple[int, int]]:
    """(better, worse) attempt positions for contrast asks: every attempt rewarded above the group mean against
    every one below it, finished attempts before cut-off ones, ordered so that consecutive asks see other
    attempts."""
    values = [r.reward for r in group.rewards]
    graded = [v for v in values if v is not None]
    if not graded:
        return []
    mean = statistics.fmean(graded)
    order = sorted(range(len(values)), key=lambda i: group.rollouts[i].truncated)
    better = [i for i in order if (v := values[i]) is not None and v > mean]
    worse = [i for i in order if (v := values[i]) is not None and v < mean]
    return [(better[(k + j) % len(better)], worse[j]) for k in range(len(better)) for j in range(len(worse))]


async def _extract_one(
    group: Group, summaries: dict[tuple[str, int], Summary], library: ExperienceLibrary, learner: Learner
) -> GroupProposals:
    cfg = learner.cfg
    group_id = group.problem.problem_id
    done = StageItems(Stage.GROUP_ADVANTAGE, Proposal)
    reused = done.get(group_id)
    if reused is not None:
        progress.advance(Stage.GROUP_ADVANTAGE)
        return GroupProposals([reused])
    attempts = _attempts(group, summaries, cfg.use_groundtruth)
    try:
        if cfg.extract == "contrast":
            batch = await _contrast_candidates(group, attempts, library, learner)
        else:
            batch = await _operations_proposal(group, attempts, library, learner)
    finally:
        progress.advance(Stage.GROUP_ADVANTAGE)
    proposal = batch.proposals[0]
    if cfg.examples != "off" and (example := worked_example(group, learner.policy_model)) is not None:
        proposal = proposal.model_copy(update={"operations": [*proposal.operations, example]})
        batch = GroupProposals([proposal], batch.llm_calls)
    summarized = not cfg.summarize or all(_has_summary(r, summaries) for r in group.rollouts)
    if summarized and not call_failed(proposal):  # else redo it once the summaries or the calls are redone
        done.put(group_id, proposal)
    return batch


async def _operations_proposal(
    group: Group, attempts: list[Attempt], library: ExperienceLibrary, learner: Learner
) -> GroupProposals:
    """The group's edit list as JSON; with ``fallback: contrast`` a reply with no usable operation is followed by
    contrast asks, whose candidates replace it (both kinds of reply kept in the raw text)."""
    cfg, group_id = learner.cfg, group.problem.problem_id
    messages = partial(_extract_prompt, learner.ask, group.problem, attempts, library.render_for_prompt())
    schema = operations_schema(
        cfg.max_ops_per_group,
        kinds=GROUP_KINDS,
        live_ids=[e.id for e in library],
        min_words=cfg.min_words,
        max_words=cfg.max_words,
        pattern=cfg.lesson_pattern,
    )
    try:
        reply = await learner.llm.complete_operations(
            messages, stage=Stage.GROUP_ADVANTAGE, json_schema=schema, repair=partial(repair_messages, learner.ask)
        )
    except LLMCallError as exc:
        return GroupProposals([Proposal(group_id=group_id, parse_error=f"{CALL_FAILED}{exc}")], exc.calls)
    operations = [op.model_copy(update={"source_groups": [group_id]}) for op in reply.operations]
    proposal = Proposal(
        group_id=group_id, operations=operations, raw_text=reply.raw_text, parse_error=reply.parse_error
    )
    unusable = _unusable(operations, learner.prompts)
    if cfg.fallback != "contrast" or unusable is None:
        return GroupProposals([proposal], reply.calls)
    fallback = await _contrast_candidates(group, attempts, library, learner)
    contrast = fallback.proposals[0]
    raw = json.dumps(
        {
            "operations_reply": reply.raw_text,
            "why_contrast": unusable,
            "contrast_replies": json.loads(contrast.raw_text or "[]"),
        },
        ensure_ascii=False,
    )
    return GroupProposals([contrast.model_copy(update={"raw_text": raw})], [*reply.calls, *fallback.llm_calls])


def _extract_prompt(
    ask: LessonAsk, problem: Problem, attempts: list[Attempt], library_text: str, constrained: bool
) -> list[dict[str, str]]:
    """The operations ask; an unconstrained reply gets a complete example reply to follow."""
    return extract_messages(ask, problem, attempts, library_text, show_example=not constrained)


def _unusable(operations: list[Operation], prompts: LearnerPrompts) -> str | None:
    """Why an operations reply has nothing to apply (what the contrast fallback answers), or None."""
    if not operations:
        return "the reply proposed no operation"
    if all(op.text and prompts.copied_from_prompt(op.text) for op in operations):
        return "every proposed lesson copies the prompt"
    return None


async def _contrast_candidates(
    group: Group, attempts: list[Attempt], library: ExperienceLibrary, learner: Learner
) -> GroupProposals:
    """``cfg.candidates`` contrast asks, each over the next (better, worse) pair with its own draw: one
    candidate operation per usable reply; every reply kept (raw text: a JSON list)."""
    cfg, llm = learner.cfg, learner.llm
    group_id, pairs = group.problem.problem_id, contrast_pairs(group)
    if not pairs:
        return GroupProposals(
            [
                Proposal(
                    group_id=group_id, parse_error="no contrast: no attempt is rewarded above or below the group mean"
                )
            ]
        )
    live_ids = [e.id for e in library]
    schema = contrast_schema(live_ids, min_words=cfg.min_words, max_words=cfg.max_words)
    asks = [pairs[c % len(pairs)] for c in range(cfg.candidates)]

    def ask(better: Attempt, worse: Attempt, constrained: bool) -> list[dict[str, str]]:
        return contrast_messages(
            learner.ask, group.problem, better, worse, library.render_for_prompt(), live_ids=live_ids,
            show_example=not constrained,
        )  # fmt: skip

    replies = await asyncio.gather(
        *[
            llm.complete(
                partial(ask, attempts[b], attempts[w]),
                stage=Stage.GROUP_ADVANTAGE,
                json_schema=schema,
                schema_name="lesson",
                redraw=c,
            )
            for c, (b, w) in enumerate(asks)
        ],
        return_exceptions=True,
    )
    operations, kept, errors, calls = [], [], [], []
    for c, ((b, w), reply) in enumerate(zip(asks, replies)):
        entry: dict = {"candidate": c + 1, "attempts": [attempts[b].sample_idx, attempts[w].sample_idx]}
        kept.append(entry)
        if isinstance(reply, LLMCallError):
            calls += reply.calls
            entry["error"] = f"{CALL_FAILED}{reply}"
            errors.append(entry["error"])
            continue
        if isinstance(reply, BaseException):
            raise reply
        calls += reply.calls
        entry["reply"] = reply.text
        try:
            op = parse_contrast(reply.text, live_ids)
        except StructuredOutputError as exc:
            entry["error"] = str(exc)
            errors.append(f"candidate {c + 1}: {exc}")
            continue
        op = op.model_copy(update={"source_groups": [group_id]})
        if (why := not_general(op, group.problem, learner.prompts, cfg)) is not None:
            asked = ask(attempts[b], attempts[w], llm.constrains_json("learner"))
            op, rewrite_calls, entry["generalized"] = await _generalize(op, asked, why, learner, c)
            calls += rewrite_calls
        note = f"[contrast, candidate {c + 1}: attempt {attempts[b].sample_idx} vs {attempts[w].sample_idx}]"
        operations.append(op.model_copy(update={"rationale": f"{op.rationale} {note}".strip()}))
    all_calls_failed = all(e.startswith(CALL_FAILED) for e in errors) and len(errors) == len(asks)
    error = None if operations else errors[0] if all_calls_failed else "no usable candidate: " + "; ".join(errors)
    return GroupProposals(
        [
            Proposal(
                group_id=group_id,
                operations=operations,
                raw_text=json.dumps(kept, ensure_ascii=False),
                parse_error=error,
            )
        ],
        calls,
    )


def not_general(op: Operation, problem: Problem, prompts: LearnerPrompts, cfg: LearningConfig) -> str | None:
    """Why a candidate's lesson cannot be kept as written and a rewrite may fix it: too long, or about its own
    problem (its numbers, its text, its answer); None when it reads as a general lesson."""
    words = word_count(op.text or "")
    if words > cfg.max_words:
        return f"it has {words} words, more than {cfg.max_words}"
    return LessonScreen(prompts, [problem])(op)


async def _generalize(
    op: Operation, asked: list[dict[str, str]], why: str, learner: Learner, draw: int
) -> tuple[Operation, list[LLMCall], dict]:
    """One request to rewrite a candidate as a general lesson; the rewrite replaces it when it parses (the
    draft, the reason and the reply are kept)."""
    record: dict = {"draft": op.text, "why": why}
    messages = generalize_messages(learner.ask, asked, op.text or "", why)
    schema = contrast_schema(min_words=learner.cfg.min_words, max_words=learner.cfg.max_words)
    schema = {**schema, "properties": {"lesson": schema["properties"]["lesson"]}, "required": ["lesson"]}
    try:
        reply = await learner.llm.complete(
            messages, stage=Stage.GROUP_ADVANTAGE, json_schema=schema, schema_name="lesson", redraw=draw
        )
    except LLMCallError as exc:
        record["error"] = str(exc)
        return op, exc.calls, record
    record["reply"] = reply.text
    try:
        rewritten = parse_contrast(reply.text)
    except StructuredOutputError as exc:
        record["error"] = str(exc)
        return op, reply.calls, record
    note = f"{op.rationale} [rewritten as a general lesson: the draft {why}]".strip()
    return op.model_copy(update={"text": rewritten.text, "rationale": note}), reply.calls, record


def _has_summary(rollout: Rollout, summaries: dict[tuple[str, int], Summary]) -> bool:
    summary = summaries.get((rollout.problem_id, rollout.sample_idx))
    return summary is not None and summary.error is None


def call_failed(proposal: Proposal) -> bool:
    """The learner call itself failed (after retries): a failed item, unlike a reply that could not be parsed
    (the model's answer, stored and counted)."""
    return (proposal.parse_error or "").startswith(CALL_FAILED)


async def extract_group_advantage(
    groups: list[Group],
    summaries: list[Summary],
    library: ExperienceLibrary,
    prompts: LearnerPrompts,
    llm: LLMClient,
    cfg: LearningConfig,
    policy_model: str = "",
) -> GroupProposals:
    """One proposal per selected group (possibly with no operations, or with a parse error); with
    ``learning.examples`` on, each carries its worked example (``worked_example``) too."""
    by_key, learner = {(s.problem_id, s.sample_idx): s for s in summaries}, Learner.of(prompts, llm, cfg, policy_model)
    parts = await asyncio.gather(*[_extract_one(g, by_key, library, learner) for g in groups])
    return GroupProposals.joined(parts)


@stage_task(Stage.GROUP_ADVANTAGE, run_name="group-advantage-step{step}-chunk{chunk}")
async def group_advantage_task(
    config: RunConfig,
    step: int,
    chunk: int,
    problems: list[Problem],
    rollouts: list[Rollout],
    rewards: list[Reward],
    advantages: list[GroupAdvantage],
    summaries: list[Summary],
    library: LibraryVersion,
) -> GroupProposals:
    groups = build_groups(problems, rollouts, rewards, advantages)
    return await extract_group_advantage(
        groups,
        summaries,
        ExperienceLibrary.from_version(library),
        domain_for(config).learner_prompts,
        shared_client(config),
        config.learning,
        config.policy.model,
    )
