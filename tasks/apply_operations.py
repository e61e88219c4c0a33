"""Stage: apply the final plan to the library, producing the next immutable version."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clgrpo.library import ExperienceLibrary, Screen
from domains import get_domain
from domains.guard import LessonGuard, first_rejection
from domains.learner import LessonScreen
from schemas.config import LearningConfig, RunConfig
from schemas.records import LibraryVersion, Operation, OperationResult, Problem
from tasks.common import stage_task

STAGE = "apply_operations"


@dataclass
class Applied:
    library: LibraryVersion
    results: list[OperationResult]


def apply_operations(library: ExperienceLibrary, operations: list[Operation], *, step: int,
                     cfg: LearningConfig, screen: Screen | None = None) -> tuple[ExperienceLibrary, list[OperationResult]]:
    """Every operation comes back applied or rejected with its reason; the new version's number is ``step``."""
    return library.apply(operations, step=step, max_words=cfg.max_words, min_words=cfg.min_words,
                         max_size=cfg.max_library_size, screen=screen)


def lesson_screen(config: RunConfig, problems: Sequence[Problem]) -> Screen:
    """What every lesson text (add, modify, merge) must pass: the domain's ``LessonScreen`` (prompt copies, loops,
    problem copies, a source problem's answer, ``lesson_pattern``), then the ``LessonGuard`` at
    ``learning.guard`` strictness (``unsafe: ...`` / ``leaks_problem: ...``). The first reason wins."""
    return first_rejection(
        LessonScreen(get_domain(config.domain).learner_prompts, problems, config.learning.lesson_pattern),
        LessonGuard(config.learning.guard, problems))


@stage_task(STAGE, run_name="apply-operations-step{step}")
def apply_operations_task(config: RunConfig, step: int, library: LibraryVersion, operations: list[Operation],
                          problems: list[Problem]) -> Applied:
    """``problems``: the step's training problems (a lesson may not copy one or state its answer)."""
    new, results = apply_operations(ExperienceLibrary.from_version(library), operations, step=step,
                                    cfg=config.learning, screen=lesson_screen(config, problems))
    return Applied(new.to_version(), results)
