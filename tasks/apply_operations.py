"""Stage: apply the final plan to the library, producing the next immutable version."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from clgrpo.experience.library import ExperienceLibrary, NearDuplicates, Screen
from clgrpo.experience.retrieval import embed_cached
from clgrpo.models.embeddings import make_embedder
from clgrpo.storage.store import Store
from domains import domain_for
from domains.guard import LessonGuard, first_rejection
from domains.learner import SAME_LESSON, LessonScreen, overlap
from schemas.config import BlockedLesson, LearningConfig, RunConfig
from schemas.records import ExperienceStat, LibraryVersion, Operation, OperationResult, Problem
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.outputs import Applied


def apply_operations(
    library: ExperienceLibrary,
    operations: list[Operation],
    *,
    step: int,
    cfg: LearningConfig,
    screen: Screen | None = None,
    near: NearDuplicates | None = None,
    domains: Mapping[str, str | None] | None = None,
) -> tuple[ExperienceLibrary, list[OperationResult]]:
    """Every operation comes back applied or rejected with its reason; the new version's number is ``step``."""
    return library.apply(
        operations,
        step=step,
        max_words=cfg.max_words,
        min_words=cfg.min_words,
        max_size=cfg.max_library_size,
        screen=screen,
        near=near,
        domains=domains,
    )


def lesson_screen(config: RunConfig, problems: Sequence[Problem]) -> Screen:
    """What every lesson text (add, modify, merge) must pass: the domain's ``LessonScreen`` (prompt copies, loops,
    problem copies, a source problem's answer, ``lesson_pattern``), then the ``LessonGuard`` at
    ``learning.guard`` strictness (``unsafe: ...`` / ``leaks_problem: ...``). The first reason wins. A worked
    example passes the guard's checks against injected instructions only (``LessonGuard.example``)."""
    guard = LessonGuard(config.learning.guard, problems)
    lessons = first_rejection(
        BlockedScreen(config.learning.blocked),
        LessonScreen(domain_for(config).learner_prompts, problems, config.learning.lesson_pattern),
        guard,
    )

    def screen(op: Operation) -> str | None:
        return guard.example(op) if op.example is not None else lessons(op)

    return screen


class BlockedScreen:
    """Rejects a lesson that says (nearly) what a blocked one says: word-trigram overlap both ways at
    ``SAME_LESSON`` (with near-duplicate control on, an embedding within its threshold is caught as well)."""

    def __init__(self, blocked: Sequence[BlockedLesson]) -> None:
        self.blocked = list(blocked)

    def __call__(self, op: Operation) -> str | None:
        text = op.text or ""
        for b in self.blocked:
            if text and min(overlap(text, b.text), overlap(b.text, text)) >= SAME_LESSON:
                return f"rejected before: {b.reason}"
        return None


async def near_duplicates_for(
    config: RunConfig, store: Store, library: ExperienceLibrary, operations: Sequence[Operation]
) -> NearDuplicates | None:
    """The near-duplicate control of ``library.near_duplicates`` for one batch: embeddings of the live lessons
    and of every operation text. None when it is off."""
    settings = config.library
    if settings.near_duplicates == "off":
        return None
    blocked = [(b.text, b.reason) for b in config.learning.blocked]
    texts = [e.text for e in library] + [op.text for op in operations if op.text] + [t for t, _ in blocked]
    embedder = make_embedder(settings.embedding)
    try:
        vectors = await embed_cached(store, embedder, texts)
    finally:
        await embedder.aclose()
    return NearDuplicates(vectors, settings.near_duplicate_similarity, settings.near_duplicates, blocked)


@stage_task(Stage.APPLY_OPERATIONS, run_name="apply-operations-step{step}")
def apply_operations_task(
    config: RunConfig,
    step: int,
    library: LibraryVersion,
    operations: list[Operation],
    problems: list[Problem],
    near: NearDuplicates | None = None,
    usefulness: Mapping[str, ExperienceStat] | None = None,
) -> Applied:
    """``problems``: the step's training problems (a lesson may not copy one or state its answer; a lesson takes
    their domain tag); ``near``: the near-duplicate control (``near_duplicates_for``); ``usefulness``: each live
    experience's stats so far, which the token budget (``library.max_tokens``) evicts by."""
    new, results = apply_plan(
        config, step, ExperienceLibrary.from_version(library), operations, problems, near, usefulness
    )
    return Applied(results, new.to_version())


def apply_plan(
    config: RunConfig,
    step: int,
    library: ExperienceLibrary,
    operations: Sequence[Operation],
    problems: Sequence[Problem],
    near: NearDuplicates | None = None,
    usefulness: Mapping[str, ExperienceStat] | None = None,
) -> tuple[ExperienceLibrary, list[OperationResult]]:
    """The library after ``operations`` as the stage applies them (the library gate measures the same one)."""
    domains = {p.problem_id: p.domain_tag for p in problems} if any(p.domain_tag for p in problems) else None
    new, results = apply_operations(
        library,
        list(operations),
        step=step,
        cfg=config.learning,
        screen=lesson_screen(config, list(problems)),
        near=near,
        domains=domains,
    )
    if config.library.max_tokens is not None:
        new, evicted = new.evict_to_budget(config.library.max_tokens, usefulness or {}, first_seq=len(results))
        results += evicted
    return new, results
