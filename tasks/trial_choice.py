"""Choosing what a step's lesson trials try (``tasks.validate_lessons``).

The candidates: each add, modify or merge of the plan that the library's rules would accept, applied alone as
``apply_operations`` would apply it (a near-duplicate merged into the lesson it repeats); a delete or keep is not
tried, and neither is a lesson an earlier step rejected by measurement (the run's ledger, ``Rejected``).
Near-duplicate candidates are one cluster (``tasks.candidate_clusters``): its best-rated member is tried first,
carrying every member's source groups, and the next member only if none tried so far was kept; worked examples
whose problems read alike are one cluster too. A worked example is tried on problems other than its own (it is
never shown to its own problem), whatever ``trials_on`` says.
``trial_problems``: the problems a candidate is tried on, in order; ``budget_order``: the order in which the
checks budget admits candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from clgrpo.experience.library import ExperienceLibrary, NearDuplicates, normalize_text, problem_similarity
from clgrpo.llm import LLMClient
from clgrpo.process.words import counted
from domains import Domain
from domains.learner import SAME_LESSON, overlap
from schemas.config import LessonValidation, RunConfig
from schemas.records import GroupAdvantage, LessonTrial, LLMCall, Operation, OpKind, OpStatus, Problem, text_hash
from tasks.apply_operations import apply_operations, lesson_screen
from tasks.candidate_clusters import cluster, duplicate_of, joined, representatives

VALIDATED = (OpKind.ADD, OpKind.MODIFY, OpKind.MERGE)
# A worked example's trial, where the step has a library gate. Measured on `ranges` and `durations` (issue 57's
# tuning notes): a trial of one problem x 3 samples cannot see what a solved problem does (k-shot 0.00 -> 0.41),
# and the trials' share of the checks budget affords about two of them; the gate measures every change of the
# step together on the problems set aside, paired, with its own reserve.
GATE_TRIES_EXAMPLES = (
    "a worked example: tried by the library gate with the step's other changes (a single problem's trial is too "
    "small to see what a solved problem shown beside others does)"
)


@dataclass
class Candidate:
    """A plan operation to try: its position in the plan, the library with it applied alone, its problems."""

    seq: int
    operation: Operation
    library: ExperienceLibrary  # the library with this operation applied
    problems: list[Problem]


def quoted(op: Operation, limit: int = 60) -> str:
    """Another candidate named by its text (the printed lists number operations in their own order)."""
    text = " ".join((op.text or "").split())
    return f'"{text[:limit]}..."' if len(text) > limit else f'"{text}"'


def trial_problems(
    op: Operation,
    problems: Sequence[Problem],
    advantages: Sequence[GroupAdvantage],
    count: int,
    salt: str,
    pool: Sequence[Problem] = (),
    others_only: bool = False,
) -> list[Problem]:
    """The problems a candidate is tried on, in order, ``count`` at most. Sources first: its source problems,
    then other step problems (mixed rewards first, then the rest, each in a fixed pseudo-random order). Others
    only: no source problem; problems of the sources' task tag, the step's with mixed rewards first, then the
    step's others, then the rest of ``pool`` (the run's training problems); for a worked example, those whose text
    reads most like its problem first (where retrieval would show it; seen on `ranges`: a "seats" example tried
    on a "days" problem)."""
    mixed = {a.problem_id for a in advantages if a.selected}
    step_ids = {p.problem_id for p in problems}

    def order(p: Problem) -> tuple[bool, bool, str]:
        return (p.problem_id not in step_ids, p.problem_id not in mixed, text_hash(f"{salt}:{p.problem_id}"))

    if not others_only:
        sources = [p for p in problems if p.problem_id in op.source_groups]
        rest = sorted((p for p in problems if p.problem_id not in op.source_groups), key=order)
        return [*sources, *rest][:count]
    everything = {p.problem_id: p for p in [*problems, *pool]}
    tags = {p.tag for p in everything.values() if p.problem_id in op.source_groups}
    candidates = [
        p for p in everything.values() if p.problem_id not in op.source_groups and (not tags or p.tag in tags)
    ]
    if op.example is not None:  # where it will be shown: the problems that read most like its own first
        solved = op.example.problem
        return sorted(candidates, key=lambda p: (-round(problem_similarity(solved, p.problem), 6), *order(p)))[:count]
    return sorted(candidates, key=order)[:count]


@dataclass(frozen=True)
class Rejected:
    """A lesson an earlier step rejected by measurement (its trial or the library gate): the run's ledger."""

    step: int
    text: str
    reason: str


def rejected_before(op: Operation, ledger: Sequence[Rejected]) -> Rejected | None:
    """An earlier rejection of (nearly) the same lesson, or of the same worked example (its solution word for word:
    solutions of one kind of problem share most words): such a candidate is not tried again."""
    text = op.text or ""
    if op.example is not None:
        return next((r for r in ledger if text and normalize_text(r.text) == normalize_text(text)), None)
    return next((r for r in ledger if text and min(overlap(text, r.text), overlap(r.text, text)) >= SAME_LESSON), None)


def to_try(
    config: RunConfig,
    library: ExperienceLibrary,
    plan: list[Operation],
    problems: list[Problem],
    advantages: list[GroupAdvantage],
    step: int,
    pool: Sequence[Problem] = (),
    near: NearDuplicates | None = None,
    ledger: Sequence[Rejected] = (),
    clustered: Mapping[int, str] | None = None,
    only: AbstractSet[int] | None = None,
    gated: bool = False,
) -> tuple[list[Candidate], dict[int, str], dict[int, str]]:
    """The plan's operations worth a trial (applied alone, as apply_operations would apply it: a near-duplicate
    is merged into the lesson it repeats, and the merged library is what is tried; they pass the library's rules),
    why each other one is not tried, and those rejected untried (tried once: a repeat, or refused by the
    library as it would be at apply). ``clustered``: plan positions
    another member of their cluster stands for, with the reason (``cluster_plan``); ``gated``: the step has a
    library gate, which is a worked example's trial (``GATE_TRIES_EXAMPLES``)."""
    settings = config.learning.lesson_validation
    screen = lesson_screen(config, problems)
    candidates: list[Candidate] = []
    untested: dict[int, str] = {}
    repeats: dict[int, str] = {}
    for seq, op in enumerate(plan):
        if only is not None and seq not in only:
            continue
        if op.op not in VALIDATED:
            untested[seq] = f"{op.op.value} operations are not validated"
            continue
        if (earlier := rejected_before(op, ledger)) is not None:
            repeats[seq] = f"rejected before, not tried again: step {earlier.step}: {earlier.reason}"
            continue
        if clustered and seq in clustered:
            repeats[seq] = clustered[seq]
            continue
        alone, results = apply_operations(library, [op], step=step, cfg=config.learning, screen=screen, near=near)
        if results[0].status != OpStatus.APPLIED:  # it would be refused at apply too, whatever its trial said
            repeats[seq] = f"the library refuses it: {results[0].reason}"
            continue
        if gated and op.example is not None:
            untested[seq] = GATE_TRIES_EXAMPLES
            continue
        tried = (
            alone
            if library.shown is None
            else alone.with_shown(_shown_with(library.shown, alone, results[0].result_id))
        )
        count = settings.problems * settings.looks
        # a worked example is never shown to its own problem: it is tried where it is shown, on the others
        others = settings.trials_on == "others" or op.example is not None
        salt = f"{step}" if others else f"{step}:{op.text}"  # others: one order per tag, so baselines are shared
        order = trial_problems(op, problems, advantages, count, salt, pool, others)
        if not order:
            untested[seq] = "not tried: no other training problem of its task tag to try it on"
            continue
        candidates.append(Candidate(seq, op, tried, order))
    return candidates, untested, repeats


def _shown_with(shown: dict[str, list[str]], library: ExperienceLibrary, new_id: str | None) -> dict[str, list[str]]:
    """Routed prompts (``library.injection: top_k``) keep what they were shown that is still live, plus the
    candidate's lesson."""
    live = {e.id for e in library}
    return {
        pid: [i for i in ids if i in live] + ([new_id] if new_id and new_id not in ids else [])
        for pid, ids in shown.items()
    }


def next_members(
    config: RunConfig,
    library: ExperienceLibrary,
    plan: list[Operation],
    ranked: Sequence[tuple[int, ...]],
    attempt: int,
    decided: Mapping[int, LessonTrial],
    problems: list[Problem],
    advantages: list[GroupAdvantage],
    step: int,
    pool: Sequence[Problem],
    near: NearDuplicates | None,
) -> list[Candidate]:
    """The member tried at ``attempt`` (0: the representative) of each cluster none of whose members tried so
    far was kept, carrying the cluster's source groups."""
    chosen = {
        members[attempt]: members
        for members in ranked
        if len(members) > attempt and not any(m in decided and decided[m].verdict == "kept" for m in members[:attempt])
    }
    if not chosen:
        return []
    tried = [joined(plan, seq, chosen[seq]) if seq in chosen else op for seq, op in enumerate(plan)]
    candidates, _, _ = to_try(config, library, tried, problems, advantages, step, pool, near, only=set(chosen))
    return candidates


async def cluster_plan(
    config: RunConfig,
    step: int,
    library: ExperienceLibrary,
    plan: list[Operation],
    problems: list[Problem],
    near: NearDuplicates | None,
    ledger: Sequence[Rejected],
    llm: LLMClient,
    domain: Domain,
    gated: bool = False,
) -> tuple[list[Operation], dict[int, str], list[tuple[int, ...]], list[LLMCall]]:
    """The plan as tried first (each cluster's representative carrying all its members' source groups), the
    members another one stands for with the reason, the clusters of several members in the order their members
    are tried, and the rater's calls (``tasks.candidate_clusters``). Only candidates the library accepts are
    clustered: a refused one could not stand for the others. ``gated``: worked examples go to the library gate,
    one of each form (``GATE_TRIES_EXAMPLES``)."""
    screen = lesson_screen(config, problems)

    def accepted(op: Operation) -> bool:
        _, results = apply_operations(library, [op], step=step, cfg=config.learning, screen=screen, near=near)
        return results[0].status == OpStatus.APPLIED

    eligible = [
        seq
        for seq, op in enumerate(plan)
        if op.op in VALIDATED and rejected_before(op, ledger) is None and accepted(op)
    ]
    chosen, calls = await representatives(plan, cluster(plan, eligible, near), llm, domain, config.learning.max_words)
    tried, clustered, tries = list(plan), {}, config.learning.lesson_validation.cluster_tries
    for rep, members in chosen.items():
        tried[rep] = joined(plan, rep, members.members)
        for seq in members.members:
            if seq != rep and plan[seq].example is not None and gated:
                clustered[seq] = (
                    f"lesson validation: a worked example of the same form as {quoted(plan[rep])} (its problem "
                    f"reads alike); one example of a form goes on to the library gate (the policy's own words "
                    f"first, then the shortest)"
                )
            elif seq != rep and plan[seq].example is not None:
                clustered[seq] = (
                    f"lesson validation: a worked example of the same form as {quoted(plan[rep])} (its problem "
                    f"reads alike); their cluster's examples are tried shortest first until one is kept, "
                    f"{counted(tries, 'member')} at most"
                )
            elif seq != rep:
                how = duplicate_of(plan[rep].text or "", plan[seq].text or "", near) or "through another member"
                clustered[seq] = (
                    f"lesson validation: a near-duplicate of {quoted(plan[rep])} ({how}); their cluster's members "
                    f"are tried best-rated first until one is kept, {counted(tries, 'member')} at most"
                )
    ranked = [
        members.members
        for rep, members in chosen.items()
        if len(members.members) > 1 and not (gated and plan[rep].example is not None)
    ]
    return tried, clustered, ranked, calls


def budget_order(candidates: Sequence[Candidate], settings: LessonValidation) -> list[Candidate]:
    """The order in which the checks budget admits candidates: worked examples first (a small policy gains far more
    from a solved problem than from a rule: benchmarks/REPORT.md, "Learning quality"), then the plan's order, or
    (``support``) the candidates more groups proposed first, then the plan's."""
    if settings.order == "plan":
        return sorted(candidates, key=lambda c: (c.operation.example is None, c.seq))
    return sorted(candidates, key=lambda c: (c.operation.example is None, -len(set(c.operation.source_groups)), c.seq))
