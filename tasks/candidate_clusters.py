"""Near-duplicate candidates of one step, clustered before any trial: a cluster is tried once.

Contrast extraction often proposes one lesson several times in other words (issue 47: four of five kept
candidates of one run were one lesson). Trying each is paying for the same measurement again. Candidates of
the same kind and target are clustered when their texts are near-duplicates: cosine similarity of their
embeddings at or above the near-duplicate threshold where the step embedded them (``NearDuplicates``), else
word-trigram overlap both ways at ``SAME_LESSON``. Each cluster is tried with its best-rated text (the lesson
rater's "specific" first, then the shortest, then the first in the plan), carrying the source groups of all
its members; when the trial rejects it, the next member in that order is tried, up to
``lesson_validation.cluster_tries`` members (embeddings cannot tell "the difference" from "the difference plus
one": seen on `ranges`, where a cluster of eight stood or fell with its shortest text); the members never tried
are rejected as its repeats, naming the one tried first. Worked examples cluster apart from lessons: those whose
problems read alike (``EXAMPLE_FORM``), tried the policy's own first, then the shortest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clgrpo.experience.library import NearDuplicates, normalize_text, problem_similarity, word_count
from clgrpo.llm import LLMClient
from domains import Domain
from domains.learner import SAME_LESSON, overlap
from schemas.records import LLMCall, Operation
from schemas.stages import Stage
from tasks.specificity import rate


@dataclass(frozen=True)
class Cluster:
    members: tuple[int, ...]  # plan positions, in plan order (``representatives``: in the order they are tried)


def duplicate_of(a: str, b: str, near: NearDuplicates | None) -> str | None:
    """How two lesson texts say the same thing ("cosine 0.93", "word overlap 0.85"), or None: their embeddings'
    cosine at the near-duplicate threshold where the step embedded both, or word-trigram overlap both ways at
    ``SAME_LESSON``."""
    if near is not None:
        va, vb = near.vectors.get(normalize_text(a)), near.vectors.get(normalize_text(b))
        if va is not None and vb is not None:
            cosine = float(sum(x * y for x, y in zip(va, vb)))
            if cosine >= near.threshold:
                return f"cosine {cosine:.2f}"
    words = min(overlap(a, b), overlap(b, a))
    return f"word overlap {words:.2f}" if words >= SAME_LESSON else None


def cluster(plan: Sequence[Operation], eligible: Sequence[int], near: NearDuplicates | None) -> list[Cluster]:
    """Greedy single pass in plan order: a candidate joins the first cluster of the same kind and target with a
    member it nearly duplicates, else starts one. (Complete linkage, every member, was tried and measured worse on
    `ranges`: more single-problem trials in plan order spread the checks budget over generic candidates;
    benchmarks/learning_runs/experiments/complete-linkage.)"""
    clusters: list[list[int]] = []
    for seq in eligible:
        op = plan[seq]
        for members in clusters:
            first = plan[members[0]]
            same_kind = (first.op, first.target_ids, first.example is None) == (
                op.op,
                op.target_ids,
                op.example is None,
            )
            if same_kind and any(_alike(plan[m], op, near) for m in members):
                members.append(seq)
                break
        else:
            clusters.append([seq])
    return [Cluster(tuple(members)) for members in clusters]


EXAMPLE_FORM = 0.8  # word overlap (numbers left out) at which two worked examples' problems are of one form


def _alike(a: Operation, b: Operation, near: NearDuplicates | None) -> bool:
    """Two lessons that say the same thing, or two worked examples of one form: their problems of one task tag
    reading alike, numbers aside (what ``ExperienceLibrary.examples_for`` would show in each other's place)."""
    if a.example is not None and b.example is not None:
        same_tag = a.example.task_tag == b.example.task_tag
        return same_tag and problem_similarity(a.example.problem, b.example.problem) >= EXAMPLE_FORM
    return duplicate_of(a.text or "", b.text or "", near) is not None


async def representatives(
    plan: Sequence[Operation], clusters: Sequence[Cluster], llm: LLMClient, domain: Domain, max_words: int
) -> tuple[dict[int, Cluster], list[LLMCall]]:
    """The plan position that stands for each cluster (its best-rated text) with the cluster's members in the
    order they are tried (it first), asking the lesson rater about the members of clusters with more than one."""
    crowded = [c for c in clusters if len(c.members) > 1 and plan[c.members[0]].example is None]
    rated = [seq for c in crowded for seq in c.members]
    ratings, calls = (
        await rate(
            [plan[seq].text or "" for seq in rated],
            llm,
            domain=domain.learner_prompts.domain,
            stage=Stage.VALIDATE_LESSONS,
        )
        if rated
        else ([], [])
    )
    specific = {seq for seq, r in zip(rated, ratings) if r.verdict == "specific"}

    def rank(seq: int) -> tuple[bool, bool, int, int]:
        words = word_count(plan[seq].text or "")
        if (example := plan[seq].example) is not None:  # the policy's own words first, then the shortest
            return (example.origin != "rollout", False, words, seq)
        return (seq not in specific, words > max_words, words, seq)

    ranked = [tuple(sorted(c.members, key=rank)) for c in clusters]
    return {members[0]: Cluster(members) for members in ranked}, calls


def joined(plan: Sequence[Operation], chosen: int, members: Sequence[int]) -> Operation:
    """The representative's operation carrying every member's source groups (in plan order, once each); a worked
    example keeps its own group (it is shown to every problem but its own)."""
    if plan[chosen].example is not None:
        return plan[chosen]
    groups = list(dict.fromkeys(g for seq in members for g in plan[seq].source_groups))
    return plan[chosen].model_copy(update={"source_groups": groups})
