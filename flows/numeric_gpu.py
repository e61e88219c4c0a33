"""The numeric_update stage (hybrid learning) as its own flow, deployed on the ``cuda`` work pool, and the
orchestrator's side of it (``hybrid.placement: pool``), built like ``flows.rollout_gpu``.

The training flow starts one ``numeric-update-gpu`` child run per step through ``run_deployment`` with an
idempotency key derived from (run, config, step, inputs, parent adapter, database), so a retried parent finds
the child it already started (and schedules it again if it ended unsuccessfully). Adapters travel through the
hand-off storage (a local path shared with the workers or any fsspec URL) at a folder fixed by the same key:
the orchestrator uploads the parent adapter to ``<hand-off>/parent/``, the child trains on its own device and
leaves ``<hand-off>/adapter/`` and, last, ``<hand-off>/record.json``; the orchestrator copies the adapter into
the run's export dir and alone writes DuckDB. A hand-off with its record already there (a parent that crashed
after the child finished) is ingested without starting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import fsspec
from prefect import flow, get_run_logger

from clgrpo.llm.adapters import adapter_dir
from clgrpo.process import stopping
from flows.rollout_gpu import RemoteRolloutError, ensure_completed, start_or_rerun_child
from schemas.config import RunConfig
from schemas.records import AdapterVersion, NumericItem
from schemas.stages import Stage
from tasks.checkpoint import export_dir
from tasks.common import inputs_hash
from tasks.numeric_update import train_step

RECORD = "record.json"


def handoff_folder(config: RunConfig, step: int, key: str) -> str:
    base = config.hybrid.handoff_storage or str(export_dir(config) / "handoff")
    return f"{base.rstrip('/')}/{config.run_id}/numeric-step{step:04d}-{key}"


def upload_folder(local: Path, url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    for file in sorted(local.iterdir()):
        if file.is_file():
            fs.put_file(str(file), f"{root}/{file.name}")


def download_folder(url: str, local: Path) -> None:
    """The files of ``url`` into ``local`` (replaced; written under a temporary name, then renamed)."""
    fs, root = fsspec.core.url_to_fs(url)
    partial_dir = local.with_name(f"{local.name}.partial")
    shutil.rmtree(partial_dir, ignore_errors=True)
    partial_dir.mkdir(parents=True)
    for entry in fs.ls(root, detail=False):
        fs.get_file(entry, str(partial_dir / Path(entry).name))
    shutil.rmtree(local, ignore_errors=True)
    partial_dir.rename(local)


def _exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


@flow(name="numeric-update-gpu", flow_run_name="numeric-update-{config.run_id}-step{step}", persist_result=True)
async def numeric_update_gpu(
    config: RunConfig,
    step: int,
    items: list[NumericItem],
    skipped: int,
    has_parent: bool,
    library_version: int,
    handoff: str,
) -> str:
    """Train the step's adapter on this worker's device and leave it (and its record) at ``handoff``."""
    return await stopping.flow_body(
        partial(_numeric_update_gpu, config, step, items, skipped, has_parent, library_version, handoff)
    )


async def _numeric_update_gpu(
    config: RunConfig,
    step: int,
    items: list[NumericItem],
    skipped: int,
    has_parent: bool,
    library_version: int,
    handoff: str,
) -> str:
    import asyncio

    stopping.note_stage(f"step {step} numeric_update")
    with tempfile.TemporaryDirectory(prefix="clgrpo-numeric-") as tmp:
        parent = None
        if has_parent:
            parent = Path(tmp) / "parent"
            download_folder(f"{handoff}/parent", parent)
        target = Path(tmp) / f"adapter_step{step}"
        record = await asyncio.to_thread(
            train_step, config, step, items, skipped, None if parent is None else str(parent), library_version, target
        )
        upload_folder(target, f"{handoff}/adapter")
    meta = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "host": os.uname().nodename}
    with fsspec.open(f"{handoff}/{RECORD}", "w", encoding="utf-8") as handle:  # last: the hand-off is complete
        json.dump({"record": record.model_dump(mode="json"), "meta": meta}, handle)
    get_run_logger().info(
        "step %d numeric_update: adapter (%d completions, %s) handed off to %s (CUDA_VISIBLE_DEVICES=%s)",
        step,
        record.rows_used,
        record.device,
        handoff,
        meta["cuda_visible_devices"],
    )
    return handoff


async def numeric_update_on_pool(
    config: RunConfig,
    step: int,
    items: list[NumericItem],
    skipped: int,
    parent: str | None,
    library_version: int,
    export: str,
    *,
    db_id: str = "",
) -> AdapterVersion:
    """The orchestrator's side: hand the parent adapter over, start (or find) the step's child run, and copy
    the adapter it left into ``<export>/adapter_step<N>/``. The returned record names the local folder."""
    key = inputs_hash(
        {
            "fingerprint": config.fingerprint(),
            "run_id": config.run_id,
            "step": step,
            "items": items,
            "parent": parent,
            "library_version": library_version,
            "db_id": db_id,
        }
    )
    url = handoff_folder(config, step, key)
    if not _exists(f"{url}/{RECORD}"):
        if parent is not None:
            upload_folder(Path(parent), f"{url}/parent")
        parameters = {
            "config": config.model_dump(mode="json"),
            "step": step,
            "items": [i.model_dump(mode="json") for i in items],
            "skipped": skipped,
            "has_parent": parent is not None,
            "library_version": library_version,
            "handoff": url,
        }
        child = await start_or_rerun_child(
            config, parameters, f"clgrpo-numeric-{key}", deployment=config.hybrid.deployment, placement=config.hybrid
        )
        ensure_completed(child, Stage.NUMERIC_UPDATE, f"hybrid.timeout_s={config.hybrid.timeout_s:g}s")
        if not _exists(f"{url}/{RECORD}"):
            raise RemoteRolloutError(
                f"numeric_update child run {child.name} completed but left nothing at {url}: "
                "is hybrid.handoff_storage shared between the GPU workers and the orchestrator?"
            )
    with fsspec.open(f"{url}/{RECORD}", "r", encoding="utf-8") as handle:
        payload = json.load(handle)
    target = adapter_dir(Path(export), step)
    download_folder(f"{url}/adapter", target)
    record = AdapterVersion.model_validate(payload["record"]).model_copy(
        update={"path": str(target), "parent_path": parent}
    )
    get_run_logger().info(
        "step %d numeric_update: ingested the adapter from %s (worker %s, device %s, CUDA_VISIBLE_DEVICES=%s)",
        step,
        url,
        payload["meta"].get("host"),
        record.device,
        payload["meta"].get("cuda_visible_devices"),
    )
    return record
