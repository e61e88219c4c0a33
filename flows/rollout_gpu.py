"""The rollout stage as its own flow, deployed on the ``cuda`` work pool, and the orchestrator's side of it.

With ``rollout.placement: pool`` the training flow starts one ``rollout-gpu`` child run per chunk through
``run_deployment``. The idempotency key is derived from (run, config, step, chunk, inputs), so a retried parent
finds the child it already started instead of launching a duplicate; if that child ended Failed or Crashed, the
same child run is scheduled again (as ``prefect flow-run retry`` does), so retrying the parent after a GPU
failure re-runs the chunk without a second child (a child cancelled with its stopped parent is followed by a
new child run instead: see ``start_or_rerun_child``); so does a child that completed but left failed
samples (its ingested hand-off is moved aside, so failures are never replayed). The child writes its batch as JSON to
the hand-off storage (a local path shared with the workers, or any fsspec URL) at a path fixed by the same
key; the orchestrator reads it back and alone writes DuckDB. A hand-off file that already exists (a parent
that crashed after the child finished) is ingested without starting anything.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any
from uuid import UUID

import fsspec
from prefect import flow, get_client, get_run_logger
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
from prefect.deployments.flow_runs import arun_deployment
from prefect.states import Cancelling, Scheduled

from clgrpo.process import stopping
from schemas.config import HybridConfig, RolloutPlacement, RunConfig
from schemas.records import LibraryVersion, LLMCall, Problem, Rollout
from schemas.stages import Stage
from tasks.checkpoint import export_dir
from tasks.common import inputs_hash
from tasks.outputs import Rollouts
from tasks.rollout import rollout_task


class RemoteRolloutError(RuntimeError):
    pass


def handoff_url(config: RunConfig, step: int, chunk: int, key: str) -> str:
    base = config.rollout.handoff_storage or str(export_dir(config) / "handoff")
    return f"{base.rstrip('/')}/{config.run_id}/step{step:04d}-chunk{chunk:03d}-{key}.json"


def write_handoff(url: str, batch: Rollouts, meta: dict[str, str | None]) -> None:
    payload = {
        "rollouts": [r.model_dump(mode="json") for r in batch.rollouts],
        "calls": [c.model_dump(mode="json") for c in batch.llm_calls],
        "meta": meta,
    }
    if "://" not in url:
        Path(url).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{url}.partial"
    with fsspec.open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    fs, path = fsspec.core.url_to_fs(url)
    fs.mv(fsspec.core.url_to_fs(tmp)[1], path)  # readers never see a half-written file


def read_handoff(url: str) -> tuple[Rollouts, dict[str, str | None]] | None:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return None
    with fsspec.open(url, "r", encoding="utf-8") as handle:
        payload = json.load(handle)
    batch = Rollouts(
        [Rollout.model_validate(r) for r in payload["rollouts"]], [LLMCall.model_validate(c) for c in payload["calls"]]
    )
    return batch, payload.get("meta", {})


@flow(name="rollout-gpu", flow_run_name="rollout-{config.run_id}-step{step}-chunk{chunk}", persist_result=True)
async def rollout_gpu(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], library: LibraryVersion, handoff: str
) -> str:
    """Sample one chunk's rollouts on this worker's GPU and leave them at ``handoff``."""
    return await stopping.flow_body(partial(_rollout_gpu, config, step, chunk, problems, library, handoff))


async def _rollout_gpu(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], library: LibraryVersion, handoff: str
) -> str:
    stopping.note_stage(f"step {step} rollout chunk {chunk}")
    batch = await rollout_task(config, step, chunk, problems, library)
    meta = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "host": os.uname().nodename}
    write_handoff(handoff, batch, meta)
    get_run_logger().info(
        "step %d chunk %d: %d rollouts handed off to %s (CUDA_VISIBLE_DEVICES=%s)",
        step,
        chunk,
        len(batch.rollouts),
        handoff,
        meta["cuda_visible_devices"],
    )
    return handoff


async def rollout_on_pool(
    config: RunConfig, step: int, chunk: int, problems: list[Problem], library: LibraryVersion, *, db_id: str = ""
) -> Rollouts:
    """The orchestrator's side: start (or find) the child run for this chunk and ingest its hand-off.
    ``db_id``: the identity of the database the batch is for, so a re-created database never ingests a
    hand-off (or finds a child run) of another one."""
    key = inputs_hash(
        {
            "fingerprint": config.fingerprint(),
            "run_id": config.run_id,
            "step": step,
            "chunk": chunk,
            "problems": problems,
            "library": library,
            "db_id": db_id,
        }
    )
    url = handoff_url(config, step, chunk, key)
    found = read_handoff(url)
    if found is None:
        parameters = {
            "config": config.model_dump(mode="json"),
            "step": step,
            "chunk": chunk,
            "problems": [p.model_dump(mode="json") for p in problems],
            "library": library.model_dump(mode="json"),
            "handoff": url,
        }
        child = await start_or_rerun_child(
            config, parameters, f"clgrpo-rollout-{key}", rerun_completed=_exists(failed_marker(url))
        )
        ensure_completed(child, Stage.ROLLOUT, f"rollout.timeout_s={config.rollout.timeout_s:g}s")
        found = read_handoff(url)
        if found is None:
            raise RemoteRolloutError(
                f"rollout child run {child.name} completed but left nothing at {url}: "
                "is handoff_storage shared between the GPU workers and the orchestrator?"
            )
    batch, meta = found
    get_run_logger().info(
        "step %d chunk %d: ingested %d rollouts from %s (worker CUDA_VISIBLE_DEVICES=%s)",
        step,
        chunk,
        len(batch.rollouts),
        url,
        meta.get("cuda_visible_devices"),
    )
    # never replayed: a retried parent runs the child again instead of re-reading failures
    if any(r.error is not None for r in batch.rollouts):
        fs, path = fsspec.core.url_to_fs(url)
        fs.mv(path, fsspec.core.url_to_fs(failed_marker(url))[1])
    return batch


def ensure_completed(child: FlowRun, stage: Stage, limit: str) -> None:
    """Raise ``RemoteRolloutError`` unless the child run ended Completed (``limit``: the wait it was given)."""
    if child.state is None or not child.state.is_final():
        raise RemoteRolloutError(
            f"{stage} child run {child.name} ({child.id}) still "
            f"{child.state.name if child.state else 'unknown'} after {limit}: is a worker "
            "polling the pool?"
        )
    if not child.state.is_completed():
        raise RemoteRolloutError(
            f"{stage} child run {child.name} ({child.id}) ended {child.state.name}: {child.state.message or ''}"
        )


def failed_marker(url: str) -> str:
    """Where an ingested hand-off that held failed samples is moved to (kept for inspection)."""
    return f"{url}.had-failures"


def _exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


async def start_or_rerun_child(
    config: RunConfig,
    parameters: dict,
    idempotency_key: str,
    *,
    rerun_completed: bool = False,
    deployment: str | None = None,
    placement: Placement | None = None,
) -> FlowRun:
    """Start the chunk's child run, or find the one an earlier attempt of the parent started; a found child
    that ended unsuccessfully (or, with ``rerun_completed``, one whose hand-off held failed samples) is scheduled
    again (same run, its run count goes up). Waits for it to end, at most ``rollout.timeout_s``. ``deployment``
    and ``placement`` (timeout, poll interval): another stage's (hybrid's numeric_update), else the rollout's."""
    placement = placement or config.rollout
    child = await arun_deployment(
        deployment or config.rollout.deployment, parameters=parameters, idempotency_key=idempotency_key, timeout=0
    )
    if child.state is not None and child.state.is_cancelled():
        # stopped with its parent: a new child run (the same run scheduled again races the worker's cancellation
        # of it); its key derives from the cancelled one, so a later attempt of the parent finds it again
        get_run_logger().warning(
            "child run %s (%s) was cancelled: starting a new child run for its work", child.name, child.id
        )
        return await start_or_rerun_child(
            config,
            parameters,
            f"{idempotency_key}-after-{child.id}",
            rerun_completed=rerun_completed,
            deployment=deployment,
            placement=placement,
        )
    async with get_client() as client:
        state = child.state
        if state is not None and state.is_final() and (not state.is_completed() or rerun_completed):
            why = "left failed samples" if state.is_completed() else f"ended {state.name}"
            get_run_logger().warning(
                "child run %s (%s) %s in an earlier attempt: running it again", child.name, child.id, why
            )
            result: OrchestrationResult[Any] = await client.set_flow_run_state(
                child.id, Scheduled(message="re-run by its retried parent"), force=True
            )
            if result.status != SetStateStatus.ACCEPT:
                raise RemoteRolloutError(
                    f"child run {child.name} ({child.id}) could not be scheduled "
                    f"again: {result.status.value} {result.details}"
                )
        return await wait_until_final(client, child.id, placement)


Placement = RolloutPlacement | HybridConfig  # where a child run's timeout and poll interval come from


async def wait_until_final(client: PrefectClient, flow_run_id: UUID, placement: Placement) -> FlowRun:
    """Poll the run until it is final or ``placement.timeout_s`` passed (then return it as it stands)."""
    deadline = time.monotonic() + placement.timeout_s
    try:
        while True:
            run = await client.read_flow_run(flow_run_id)
            if (run.state is not None and run.state.is_final()) or time.monotonic() >= deadline:
                return run
            await asyncio.sleep(placement.poll_interval_s)
    except asyncio.CancelledError:
        if stopping.requested() is not None:  # the parent was stopped: its child stops too (a rerun reschedules it)
            await _cancel_child(client, flow_run_id)
        raise


async def _cancel_child(client: PrefectClient, flow_run_id: UUID) -> None:
    """Ask the child's worker to stop it (Prefect's Cancelling state, what the UI's Cancel sets)."""
    try:
        await asyncio.wait_for(
            client.set_flow_run_state(flow_run_id, Cancelling(message=f"its parent was {stopping.describe()}")),
            timeout=5,
        )
    except Exception as exc:  # noqa: BLE001 - the parent's stop goes on; the child ends on its own
        get_run_logger().warning("could not cancel rollout child run %s: %s", flow_run_id, exc)
