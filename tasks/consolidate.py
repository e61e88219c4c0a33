"""Stage: turn all group proposals of a step into one final plan of operations.

With ``learning.consolidation: passthrough`` the group proposals are the plan, after de-duplication (no
learner call). Otherwise up to ``consolidate_chunk_size`` proposals go to one learner call. Beyond that the proposals
are consolidated hierarchically: one call per chunk, then a final pass over the chunk plans (a single giant call
degrades). Every plan, intermediate or final, is returned as a ``Proposal`` record (group_id ``chunk-N`` or
``final``); a final plan that cannot be parsed even after the repair re-ask yields no operations and is kept
with its raw text and error. A failed learner call fails the stage (a retry resumes here).

Lineage is kept by the system, not the model: a planned operation keeps only the groups it names that were
among the proposals; one that names none is matched to the proposals it came from (``attribute_sources``).
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

from clgrpo.experience.library import ExperienceLibrary, normalize_text
from clgrpo.llm import LLMClient, shared_client
from clgrpo.process import progress
from clgrpo.prompts.consolidate import consolidate_messages
from clgrpo.prompts.lessons import LessonAsk
from clgrpo.prompts.repair import repair_messages
from domains import domain_for
from domains.learner import operations_schema, overlap, restates
from schemas.config import LearningConfig, RunConfig
from schemas.records import LibraryVersion, LLMCall, Operation, Proposal
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.outputs import FINAL, Plans

LINEAGE_OVERLAP = 0.5  # word-trigram share (either way) at which a planned text counts as from a proposed one


def render_proposals(proposals: list[Proposal]) -> str:
    """One JSON object per proposed operation, labelled with the group(s) it came from."""
    lines = []
    for proposal in proposals:
        for op in proposal.operations:
            group = ",".join(op.source_groups) or proposal.group_id
            lines.append(
                json.dumps(
                    {"group": group, "op": op.op.value, "ids": op.target_ids, "text": op.text or ""}, ensure_ascii=False
                )
            )
    return "\n".join(lines)


async def _plan(
    group_id: str,
    proposals: list[Proposal],
    library: ExperienceLibrary,
    ask: LessonAsk,
    llm: LLMClient,
    cfg: LearningConfig,
) -> tuple[Proposal, list[LLMCall]]:
    known_groups = {g for p in proposals for op in p.operations for g in (op.source_groups or [p.group_id])}

    def messages(constrained: bool) -> list[dict[str, str]]:
        return consolidate_messages(
            ask, render_proposals(proposals), library.render_for_prompt(), show_example=not constrained
        )

    # a final plan needs at most one operation per proposed one plus one per library entry
    bound = sum(len(p.operations) for p in proposals) + len(library)
    schema = operations_schema(
        bound,
        live_ids=[e.id for e in library],
        sources=sorted(known_groups),
        min_words=cfg.min_words,
        max_words=cfg.max_words,
        pattern=cfg.lesson_pattern,
    )
    reply = await llm.complete_operations(
        messages, stage=Stage.CONSOLIDATE, json_schema=schema, repair=partial(repair_messages, ask, sources=True)
    )
    progress.advance(Stage.CONSOLIDATE)
    operations = attribute_sources(
        [
            op.model_copy(
                update={"source_groups": [g for g in op.source_groups if g in known_groups and not _plan_id(g)]}
            )
            for op in reply.operations
        ],
        proposals,
    )
    plan = Proposal(group_id=group_id, operations=operations, raw_text=reply.raw_text, parse_error=reply.parse_error)
    return plan, reply.calls


def _plan_id(group: str) -> bool:
    return group == FINAL or group.startswith("chunk-")


def _proposed(proposals: list[Proposal]) -> list[tuple[Operation, list[str]]]:
    """Each proposed operation with the groups it came from (a chunk plan's operation: the groups it names)."""
    items = []
    for proposal in proposals:
        for op in proposal.operations:
            groups = [g for g in (op.source_groups or [proposal.group_id]) if not _plan_id(g)]
            if groups:
                items.append((op, groups))
    return items


def match_sources(op: Operation, proposals: list[Proposal]) -> tuple[list[str], str]:
    """The groups whose proposals ``op`` came from, matched by the system (not the model), and how: proposals
    with the same (normalized) text; proposals that targeted one of ``op``'s ids (a modify, merge, delete or keep
    of an id inherits the groups that proposed to change it); and, where no text is the same, proposals whose
    text shares at least ``LINEAGE_OVERLAP`` of its word trigrams with ``op``'s (either way) or whose content
    words ``op`` restates. ``([], "")`` when nothing matches."""
    proposed = _proposed(proposals)
    groups: list[str] = []
    how: list[str] = []
    if op.text:
        key = normalize_text(op.text)
        same = [g for q, gs in proposed if q.text and normalize_text(q.text) == key for g in gs]
        if same:
            groups += same
            how.append("same text")
    if op.target_ids:
        ids = set(op.target_ids)
        targeted = [g for q, gs in proposed if ids & set(q.target_ids) for g in gs]
        if targeted:
            groups += targeted
            how.append("same ids")
    if op.text and "same text" not in how:
        scored = [(max(overlap(op.text, q.text), overlap(q.text, op.text)), gs) for q, gs in proposed if q.text]
        near = [(score, gs) for score, gs in scored if score >= LINEAGE_OVERLAP]
        if near:
            groups += [g for _, gs in near for g in gs]
            how.append(f"text overlap {max(score for score, _ in near):.2f}")
        else:
            similar = [
                g
                for q, gs in proposed
                if q.text and (restates(op.text, q.text) or restates(q.text, op.text))
                for g in gs
            ]
            if similar:
                groups += similar
                how.append("similar wording")
    return list(dict.fromkeys(groups)), " + ".join(how)


def attribute_sources(operations: list[Operation], proposals: list[Proposal]) -> list[Operation]:
    """Lineage is kept by the system: an operation whose plan names no (known) group gets the groups of the
    proposals it matches (``match_sources``); the rationale says so (``[sources matched: ...]``), or, when
    nothing matches an operation with a text (add, modify, merge), that it has no known source
    (``[sources: none matched]``); the sources stay empty then (a delete or keep may come from no proposal)."""
    attributed = []
    for op in operations:
        if not op.source_groups:
            groups, how = match_sources(op, proposals)
            note = f"[sources matched: {how}]" if groups else "[sources: none matched]" if op.text else ""
            if note:
                op = op.model_copy(update={"source_groups": groups, "rationale": f"{op.rationale} {note}".strip()})
        attributed.append(op)
    return attributed


def passthrough(proposals: list[Proposal]) -> Plans:
    """The group proposals are the final plan, de-duplicated: operations of the same kind on the same ids with
    the same (normalized) text become one operation that names every proposing group. Nothing else is dropped:
    conflicting operations on one id reach the library, which rejects all but the first with the reason."""
    combined: dict[tuple[str, tuple[str, ...], str, str], Operation] = {}
    total = 0
    for proposal in proposals:
        for op in proposal.operations:
            total += 1
            groups = op.source_groups or [proposal.group_id]
            problem = normalize_text(op.example.problem) if op.example is not None else ""
            key = (op.op.value, tuple(op.target_ids), normalize_text(op.text or ""), problem)
            kept = combined.get(key)
            merged = groups if kept is None else list(dict.fromkeys([*kept.source_groups, *groups]))
            combined[key] = (kept or op).model_copy(update={"source_groups": merged})
    operations = list(combined.values())
    note = (
        f"passthrough: {total} proposed operation(s) from {len(proposals)} group(s); "
        f"{total - len(operations)} duplicate(s) combined"
    )
    return Plans([Proposal(group_id=FINAL, operations=operations, raw_text=note)])


async def consolidate(
    proposals: list[Proposal], library: ExperienceLibrary, ask: LessonAsk, llm: LLMClient, cfg: LearningConfig
) -> Plans:
    """The step's plan from the groups' proposals: passed through, or the learner's (in chunks, then a final
    pass over the chunks' plans). ``ask``: the learner prompts' settings (``LearnerPrompts.ask``)."""
    # group-id order: the order a resumed step reads proposals back in, so a rerun sends the same prompts
    usable = sorted((p for p in proposals if p.operations), key=lambda p: p.group_id)
    if not usable:
        return Plans()
    if cfg.consolidation == "passthrough":
        return passthrough(usable)
    examples = [op for p in usable for op in p.operations if op.example is not None]
    if examples:  # a solution is kept whole, not rewritten: worked examples bypass the learner's consolidation
        lessons = [
            p.model_copy(update={"operations": [op for op in p.operations if op.example is None]}) for p in usable
        ]
        planned = await consolidate(lessons, library, ask, llm, cfg)
        final = next((p for p in planned.proposals if p.group_id == FINAL), Proposal(group_id=FINAL))
        rest = [p for p in planned.proposals if p.group_id != FINAL]
        with_examples = final.model_copy(update={"operations": [*final.operations, *examples]})
        return Plans([*rest, with_examples], planned.llm_calls)
    plans: list[Proposal] = []
    calls: list[LLMCall] = []
    size = cfg.consolidate_chunk_size
    if len(usable) > size:
        chunks = [usable[i : i + size] for i in range(0, len(usable), size)]
        results = await asyncio.gather(
            *[_plan(f"chunk-{i}", chunk, library, ask, llm, cfg) for i, chunk in enumerate(chunks)]
        )
        plans = [plan for plan, _ in results]
        calls = [c for _, cs in results for c in cs]
        usable = [p for p in plans if p.operations]
    final, final_calls = (
        await _plan(FINAL, usable, library, ask, llm, cfg)
        if usable
        else (Proposal(group_id=FINAL, parse_error=None), [])
    )
    return Plans([*plans, final], [*calls, *final_calls])


def consolidation_calls(n_proposals: int, cfg: LearningConfig) -> int:
    """Learner calls a consolidation of ``n_proposals`` usable proposals makes (at most: the chunk plans, then
    the final pass)."""
    if cfg.consolidation == "passthrough" or n_proposals == 0:
        return 0
    size = cfg.consolidate_chunk_size
    return 1 if n_proposals <= size else -(-n_proposals // size) + 1


@stage_task(Stage.CONSOLIDATE, run_name="consolidate-step{step}")
async def consolidate_task(config: RunConfig, step: int, proposals: list[Proposal], library: LibraryVersion) -> Plans:
    return await consolidate(
        proposals,
        ExperienceLibrary.from_version(library),
        domain_for(config).learner_prompts.ask(config.learning),
        shared_client(config),
        config.learning,
    )
