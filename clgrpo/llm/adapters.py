"""LoRA adapters of the policy: where they live, what base model they belong to, and references to them.

An adapter the numeric step saves (``clgrpo.models.hybrid``) is a peft folder (``adapter_model.safetensors`` +
``adapter_config.json``) under the run's export dir, ``<db dir>/<run_id>/adapter_step<N>/``, with
``clgrpo_adapter.json`` naming the base model it was trained on, and a row in the ``adapters`` table. A
reference is a folder, ``RUN_ID:STEP`` or ``RUN_ID:latest`` (resolved through that table). An adapter is
loaded only on the base model it was trained on: another model is refused naming both.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from clgrpo.models.weights import ModelError, ModelLocation, resolve_model_path
from schemas.config import ModelConfig, RunConfig
from schemas.records import AdapterVersion
from schemas.stages import Stage

if TYPE_CHECKING:
    from clgrpo.storage.store import Store

META_FILE = "clgrpo_adapter.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_REF = re.compile(r"^(?P<run>[A-Za-z0-9_.-]+):(?P<step>\d+|latest)$")


class AdapterError(ValueError):
    """An adapter that cannot be used; the message is one line naming it."""


def adapter_dir(export_dir: Path, step: int) -> Path:
    return export_dir / f"adapter_step{step}"


def model_identity(location: ModelLocation) -> str:
    """``<name>@<hash of config.json>``: the same weights give the same identity on every machine (the cache
    folder of ``embedded`` differs per user), different architectures or checkpoints differ."""
    folder = location.folder
    name = location.gguf_file or (folder.parent.name if folder.name == "hf" else folder.name)
    config = folder / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.is_file() else "gguf"
    return f"{name}@{digest}"


def policy_identity(cfg: ModelConfig) -> str:
    try:
        return model_identity(resolve_model_path(cfg.model_path or cfg.model))
    except ModelError as exc:
        raise AdapterError(str(exc)) from exc


def write_meta(folder: Path, base_model: str, step: int, run_id: str) -> None:
    (folder / META_FILE).write_text(json.dumps({"base_model": base_model, "step": step, "run_id": run_id}))


def adapter_base(folder: str | Path) -> str | None:
    """The base model an adapter folder was trained on (None: not one of ours, no record of it)."""
    try:
        return json.loads((Path(folder) / META_FILE).read_text())["base_model"]
    except (OSError, ValueError, KeyError):
        return None


def check_adapter(folder: str | Path, cfg: ModelConfig) -> None:
    """The folder holds a peft adapter trained on ``cfg``'s model; else one ``AdapterError`` line."""
    path = Path(folder)
    if not (path / WEIGHTS_FILE).is_file() or not (path / "adapter_config.json").is_file():
        raise AdapterError(f"adapter {path}: no {WEIGHTS_FILE} + adapter_config.json there (a peft LoRA folder)")
    base, policy = adapter_base(path), policy_identity(cfg)
    if base is not None and base != policy:
        raise AdapterError(
            f"adapter {path} was trained on base model {base}, but the policy is {policy} "
            f"({cfg.model_path or cfg.model}): an adapter loads only on its own base model"
        )


def resolve_adapter(ref: str, store: Store | None) -> str:
    """A folder as it is; ``RUN_ID:STEP`` / ``RUN_ID:latest`` -> the path of that stored adapter."""
    if Path(ref).expanduser().is_dir():
        return str(Path(ref).expanduser().resolve())
    match = _REF.match(ref)
    if match is None:
        raise AdapterError(f"adapter {ref!r}: no such folder, and not RUN_ID:STEP or RUN_ID:latest")
    if store is None:
        raise AdapterError(f"adapter {ref!r}: a stored adapter needs the run's database")
    run_id, step = match["run"], match["step"]
    rows = store.records(AdapterVersion, run_id, None if step == "latest" else int(step), Stage.NUMERIC_UPDATE)
    if not rows:
        raise AdapterError(
            f"adapter {ref!r}: {store.path} has no adapter of run {run_id!r}"
            f"{'' if step == 'latest' else f' at step {step}'} (hybrid.enabled trains one per step)"
        )
    return rows[-1].path


CONDITION_KINDS = ("adapter", "both")  # evaluation conditions with the adapter: alone (no library), or with it


def split_condition(ref: str) -> tuple[str | None, str]:
    """``adapter:RUN:STEP`` -> ("adapter", "RUN:STEP"); ``both:RUN:STEP`` -> ("both", ...); a library
    reference (``none``, a file, ``RUN:VERSION``) -> (None, ref)."""
    kind, sep, rest = ref.partition(":")
    return (kind, rest) if sep and kind in CONDITION_KINDS and rest else (None, ref)


def adapter_step(folder: str) -> int | None:
    """The training step of a stored adapter folder (``adapter_step<N>``), None for another folder."""
    match = re.fullmatch(r"adapter_step(\d+)", Path(folder).name)
    return int(match[1]) if match else None


def adapter_hash(folder: str) -> str:
    """Content hash of an adapter's weights (evaluation fingerprints)."""
    return hashlib.sha256((Path(folder) / WEIGHTS_FILE).read_bytes()).hexdigest()[:16]


def with_adapter(config: RunConfig, adapter: str | None) -> RunConfig:
    """The config whose policy uses ``adapter`` (a resolved folder; None: the base weights)."""
    return config.model_copy(update={"policy": config.policy.model_copy(update={"adapter": adapter})})


def resolve_policy_adapter(config: RunConfig, store: Store | None) -> RunConfig:
    """``policy.adapter`` as a checked folder (a ``RUN:STEP`` reference resolved); unchanged when unset."""
    if config.policy.adapter is None:
        return config
    folder = resolve_adapter(config.policy.adapter, store)
    if config.policy.backend == "transformers":
        check_adapter(folder, config.policy)
    return with_adapter(config, folder)
