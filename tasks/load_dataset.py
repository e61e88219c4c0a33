"""Stage: load, validate and order the training problems."""

from __future__ import annotations

from domains import get_domain
from schemas.config import RunConfig
from schemas.records import Problem
from tasks.common import stage_task

STAGE = "load_dataset"


def load_dataset(config: RunConfig) -> list[Problem]:
    return get_domain(config.domain).load_dataset(config.dataset)


@stage_task(STAGE, run_name="load-dataset")
def load_dataset_task(config: RunConfig, source_digest: str) -> list[Problem]:
    """``source_digest`` (the data file's content hash) only keys the cache: a changed file is reloaded."""
    return load_dataset(config)
