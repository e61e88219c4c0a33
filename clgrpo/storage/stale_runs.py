"""Flow runs left Running by a killed process, marked Crashed when their run is resumed.

A SIGKILL (or a power cut, an OOM kill) ends a flow run's process before Prefect can report anything, so the
flow run stays Running (or Pending) in Prefect's database forever. When the same run is started again, the
new flow run calls ``mark_stale_runs_crashed`` while it holds the run's lock (``clgrpo.storage.run_lock``: one live
process per run id and database, released by the kernel when its process dies), so no other live process can
be running this run on this database, and every other Running/Pending flow run of the same name (and the same
database) is a dead one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import UUID

log = logging.getLogger("clgrpo.stale_runs")

STALE_STATES = ("RUNNING", "PENDING")


def _db_path_of(parameters: Any) -> str | None:
    """The first ``db_path`` in a flow run's parameters (``config.db_path``, ``config.training.db_path``)."""
    if isinstance(parameters, Mapping):
        value = parameters.get("db_path")
        if isinstance(value, (str, Path)) and str(value):
            return str(value)
        for item in parameters.values():
            found = _db_path_of(item)
            if found:
                return found
    elif isinstance(parameters, (list, tuple)):
        for item in parameters:
            found = _db_path_of(item)
            if found:
                return found
    return None


def _same_path(a: str | Path, b: str | Path) -> bool:
    def norm(p: str | Path) -> Path:
        return Path(p).expanduser().resolve()

    try:
        return norm(a) == norm(b)
    except (OSError, RuntimeError, ValueError):
        return str(a) == str(b)


def _logger() -> Any:
    """The flow run's logger (its lines reach the Prefect UI and the run's log file) inside a flow run."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow run
        return log


def _runtime_flow_run() -> tuple[str | None, str | None, str | None]:
    """(id, name, flow name) of the flow run this code runs in, or Nones outside one."""
    try:
        from prefect.runtime import flow_run

        return flow_run.id, flow_run.name, flow_run.flow_name
    except Exception:  # noqa: BLE001 - outside a flow run
        return None, None, None


async def mark_stale_runs_crashed(
    flow_run_name: str | None = None,
    current_flow_run_id: UUID | str | None = None,
    *,
    db_path: str | Path | None = None,
    run_id: str | None = None,
    flow_name: str | None = None,
) -> int:
    """Mark Crashed every Running/Pending flow run named ``flow_run_name`` except ``current_flow_run_id``
    (both default to the flow run this is called from), and their Running/Pending task runs. Returns how many
    flow runs were marked; never raises (a Prefect API error is logged as a warning and counts as 0).

    Call it only while holding the run's lock (inside ``with RunLock(db_path, "train", run_id)``).
    ``db_path``: only flow runs whose parameters name the same database file are touched (the same run id in
    another database may be live). ``run_id``: named in the Crashed message. ``flow_name``: only flow runs of
    that flow (default: this flow run's flow)."""
    try:
        return await _mark(flow_run_name, current_flow_run_id, db_path, run_id, flow_name)
    except Exception as exc:  # noqa: BLE001 - housekeeping must never fail the run
        _logger().warning(
            "could not check for stale flow runs of %s: %s: %s", flow_run_name or "this run", type(exc).__name__, exc
        )
        return 0


async def _mark(
    flow_run_name: str | None,
    current_flow_run_id: UUID | str | None,
    db_path: str | Path | None,
    run_id: str | None,
    flow_name: str | None,
) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    here_id, here_name, here_flow = _runtime_flow_run()
    flow_run_name = flow_run_name or here_name
    current = current_flow_run_id if current_flow_run_id is not None else here_id
    flow_name = flow_name or here_flow
    if not flow_run_name:
        return 0
    current = str(current) if current is not None else None
    stale_types = [StateType[name] for name in STALE_STATES]
    message = f"the process running it was killed; found stale when run {run_id or flow_run_name} was resumed" + (
        f" (flow run {current})" if current else ""
    )

    marked = 0
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])) if flow_name else None,
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[flow_run_name]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=stale_types)),
            ),
        )
        for run in runs:
            if current is not None and str(run.id) == current:
                continue
            if db_path is not None:
                theirs = _db_path_of(run.parameters)
                if theirs is None or not _same_path(theirs, db_path):
                    continue
            try:
                tasks = await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
                    task_run_filter=TaskRunFilter(
                        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=stale_types))
                    ),
                )
                for task in tasks:
                    await client.set_task_run_state(task.id, Crashed(message=message), force=True)
            except Exception as exc:  # noqa: BLE001 - the flow run still gets its state
                _logger().warning("could not mark the task runs of stale flow run %s Crashed: %s", run.id, exc)
            await client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            marked += 1
            _logger().warning(
                "flow run %s (%s) was left %s by a killed process: marked Crashed",
                run.name,
                run.id,
                run.state.type.value if run.state else "unfinished",
            )
    return marked
