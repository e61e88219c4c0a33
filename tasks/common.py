"""What every stage task shares: Prefect options, an inputs hash, chunking.

Stage task results are NOT persisted or cached by Prefect. What a retried flow run (UI "Retry",
``prefect flow-run retry``) or a rerun must not redo lives in the run's database instead: stages already
written to DuckDB are read back, and the finished items of an unfinished stage are in its work journal
(``clgrpo.storage.journal``), which belongs to that database file. A cache keyed only by task inputs would replay
results, failed ones included, into any database, even a new one, after the endpoint was fixed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


_NOT_INPUTS = {"created_at", "started_at"}  # timestamps describe when, not what


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return _jsonable({k: v for k, v in value.model_dump(mode="json").items() if k not in _NOT_INPUTS})
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def inputs_hash(parameters: dict[str, Any]) -> str:
    payload = json.dumps(_jsonable(parameters), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def stage_task(name: str, *, run_name: str) -> Callable[[F], F]:
    """The @task decorator every stage uses: named task runs (visible in the Prefect UI), no persisted or
    cached results (see the module notes), nothing kept in Prefect's in-memory result cache either, so a long
    run's memory stays flat (benchmarks/REPORT.md)."""
    return task(  # type: ignore[return-value]  # a stage's Task is called like its function
        name=name,
        task_run_name=run_name,
        persist_result=False,
        cache_result_in_memory=False,
        cache_policy=NO_CACHE,
        retries=0,
    )


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive batches of at most ``size`` items: one task run each."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def artifact_key(run_id: str, name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for a run's artifact."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{name}".lower()).strip("-")
