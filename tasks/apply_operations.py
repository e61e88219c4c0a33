"""Stage: apply the final plan to the library, producing the next immutable version."""

from __future__ import annotations

from dataclasses import dataclass

from clgrpo.library import ExperienceLibrary
from schemas.config import LearningConfig, RunConfig
from schemas.records import LibraryVersion, Operation, OperationResult
from tasks.common import stage_task

STAGE = "apply_operations"


@dataclass
class Applied:
    library: LibraryVersion
    results: list[OperationResult]


def apply_operations(library: ExperienceLibrary, operations: list[Operation], *, step: int,
                     cfg: LearningConfig) -> tuple[ExperienceLibrary, list[OperationResult]]:
    """Every operation comes back applied or rejected with its reason; the new version's number is ``step``."""
    new, results = library.apply(operations, step=step, max_words=cfg.max_words, max_size=cfg.max_library_size)
    return new, results


@stage_task(STAGE, run_name="apply-operations-step{step}")
def apply_operations_task(config: RunConfig, step: int, library: LibraryVersion,
                          operations: list[Operation]) -> Applied:
    new, results = apply_operations(ExperienceLibrary.from_version(library), operations, step=step,
                                    cfg=config.learning)
    return Applied(new.to_version(), results)
