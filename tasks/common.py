"""What every stage task shares: Prefect options and the cache key.

A stage task's result is persisted and keyed by the task name, the run config's fingerprint and a hash of
its inputs (records, library version, step, chunk). So a retried flow run (UI "Retry",
``prefect flow-run retry``) gets completed task runs back as ``Cached`` instead of calling models again, and
a changed config never reuses stale results.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel
from prefect import task

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


def stage_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    return f"clgrpo-{context.task.name}-{inputs_hash(parameters)}"


def stage_task(name: str, *, run_name: str) -> Callable[[F], F]:
    """The @task decorator every stage uses: persisted results, input-keyed cache, named runs. Results are
    not also kept in Prefect's in-memory result cache (up to 1,000 per process): the caller gets the value
    directly, a cache hit reads it back from storage, and a long run's memory stays flat (benchmarks/REPORT.md)."""
    return task(  # type: ignore[return-value]
        name=name,
        task_run_name=run_name,
        persist_result=True,
        cache_result_in_memory=False,
        cache_key_fn=stage_cache_key,
        retries=0,
    )


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive batches of at most ``size`` items: one task run each."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def artifact_key(run_id: str, name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for a run's artifact."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{name}".lower()).strip("-")
