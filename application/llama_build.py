"""Building llama.cpp's ``llama-server`` once from PyPI sources, so that it runs on any x86-64 CPU it meets.

The llama.cpp tree vendored in the pinned ``llama-cpp-python`` source distribution (``pip download
--no-binary``, sha256-checked) is built without ``-march=native`` (``GGML_NATIVE=OFF``): the server and llama.cpp
itself in a first cmake tree without any CPU kernels (``GGML_CPU=OFF``, ``GGML_BACKEND_DL=ON``), then, from a
second tree of the same sources (``GGML_CPU_ALL_VARIANTS=ON``), only the CPU kernel variants this engine needs:
``x64`` (any x86-64), ``haswell`` (AVX2) and the best variant this CPU supports. At start-up ggml loads, from the
binary's folder, the best variant the CPU it runs on supports (ggml's own run-time scoring): the folder runs on
any x86-64 and at full speed on the machine that built it. AMX kernels (``sapphirerapids``) are never built:
ggml uses them when it repacks weights at load, and on a Xeon VM that advertises AMX without enabling it the
first ``ldtilecfg`` kills the server (seen on this project's machine: SIGILL/SIGSEGV at the warm-up decode).

Building all of ggml's x86 variants (``GGML_CPU_ALL_VARIANTS`` alone) took 703 s on 2 cores; three take about
a third of that. While cmake runs, a line at least every ``PROGRESS_EVERY_S`` says how far it is, for how long,
about how long is left, and where the log is. One build per cache at a time: a second clgrpo process waits for
the first one's build (a lock file in the cache) and then uses it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from clgrpo.models.weights import cache_lock, cache_root, pip_download_source, sha256_of
from clgrpo.process.leftovers import temp_prefix

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp (ggml 0.25.3) with the server sources
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LAYOUT = "portable-1"  # the folder's layout and options (a change builds a new folder)
# both trees: no -march=native, backends as loadable modules found next to the binary, which finds its libraries
# next to itself ($ORIGIN), so the folder can move
COMMON_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
SERVER_OPTIONS = ("-DGGML_CPU=OFF", "-DLLAMA_BUILD_SERVER=ON")
KERNEL_OPTIONS = ("-DGGML_CPU_ALL_VARIANTS=ON", "-DLLAMA_BUILD_SERVER=OFF")
PROGRESS_EVERY_S = 15.0
# ggml's x86 CPU variants (ggml/src/CMakeLists.txt), best last, as the /proc/cpuinfo flags each needs; the AMX
# variant is left out on purpose (module text)
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
_HASWELL = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
X86_VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("x64", ()),
    ("haswell", _HASWELL),
    ("alderlake", (*_HASWELL, "avx_vnni")),
    ("skylakex", (*_HASWELL, *_AVX512)),
    ("cannonlake", (*_HASWELL, *_AVX512, "avx512vbmi")),
    ("cascadelake", (*_HASWELL, *_AVX512, "avx512_vnni")),
    ("icelake", (*_HASWELL, *_AVX512, "avx512vbmi", "avx512_vnni")),
    ("cooperlake", (*_HASWELL, *_AVX512, "avx512_vnni", "avx512_bf16")),
    ("zen4", (*_HASWELL, *_AVX512, "avx512vbmi", "avx512_vnni", "avx512_bf16")),
)
# what the two cmake phases weigh in the overall progress (their measured shares of one build on 2 cores)
PHASE_WEIGHTS = {"server": 0.7, "kernels": 0.3}

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The engine could not be built; the message says why and what to do."""


# --- where it lives --------------------------------------------------------------------------------------
def engine_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """The built engine: ``llama-server``, its libraries and CPU kernel modules, ``build.json``."""
    return cache_root(cache) / "bin" / f"llama.cpp-{LLAMA_CPP_PYTHON}-{LAYOUT}"


def built_binary(cache: str | os.PathLike[str] | None = None) -> Path | None:
    """The built server, or None when no finished build is in the cache (``build.json`` is written last)."""
    folder = engine_dir(cache)
    binary = folder / "llama-server"
    return binary if (folder / "build.json").is_file() and binary.is_file() else None


def build_log_path(cache: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache) / "bin" / "llama-server-build.log"


# --- the CPU -----------------------------------------------------------------------------------------------
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where /proc/cpuinfo says nothing)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def kernel_variants(flags: frozenset[str]) -> list[str]:
    """The CPU kernel variants to build: x64 (any x86-64), haswell (AVX2) and the best one ``flags`` allow."""
    usable = [name for name, needs in X86_VARIANTS if all(flag in flags for flag in needs)]
    chosen = ["x64", "haswell", usable[-1]]
    return list(dict.fromkeys(chosen))


# --- the build ---------------------------------------------------------------------------------------------
@dataclass
class BuildReport:
    binary: Path
    seconds: float
    variants: list[str]
    built: bool  # False: another process built it while this one waited, or it was there already


def build_engine(
    cache: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    log: Log = print,
    jobs: int | None = None,
) -> BuildReport:
    """Build the engine once into the cache (see the module text); a concurrent build is waited for."""
    if not force and (binary := built_binary(cache)) is not None:
        return BuildReport(binary, 0.0, _recorded_variants(binary.parent), built=False)
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"building llama-server needs {' and '.join(missing)} (Debian: apt-get install cmake g++)")
    with build_lock(cache, log):
        if not force and (binary := built_binary(cache)) is not None:
            log(f"llama-server was built by another clgrpo process meanwhile: {binary}")
            return BuildReport(binary, 0.0, _recorded_variants(binary.parent), built=False)
        return _build(cache, log, jobs or len(os.sched_getaffinity(0)))


def _build(cache: str | os.PathLike[str] | None, log: Log, jobs: int) -> BuildReport:
    target = engine_dir(cache)
    log_path = build_log_path(cache)
    log_path.parent.mkdir(parents=True, exist_ok=True)  # a fresh cache has no bin/ yet
    variants = kernel_variants(cpu_flags())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=temp_prefix("llama-build")) as tmp:
        source = _unpacked_source(Path(tmp), log)
        log(
            f"building llama-server from llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON} sources) with CPU kernels "
            f"{', '.join(variants)} (about 4 to 8 minutes on 2 cores, once; log: {log_path})"
        )
        watch = _Progress(log, log_path, started)
        with log_path.open("wb") as out:
            server = Path(tmp) / "server"
            kernels = Path(tmp) / "kernels"
            _cmake(["-S", str(source), "-B", str(server), *COMMON_OPTIONS, *SERVER_OPTIONS], out, watch, "server")
            _cmake(["--build", str(server), "--target", "llama-server", "-j", str(jobs)], out, watch, "server")
            _cmake(["-S", str(source), "-B", str(kernels), *COMMON_OPTIONS, *KERNEL_OPTIONS], out, watch, "kernels")
            targets = [f"ggml-cpu-{v}" for v in variants]
            _cmake(["--build", str(kernels), "--target", *targets, "-j", str(jobs)], out, watch, "kernels")
        _install(server / "bin", kernels / "bin", variants, target)
    seconds = time.monotonic() - started
    _write_json(
        target / "build.json",
        {
            "llama_cpp_python": LLAMA_CPP_PYTHON,
            "sdist_sha256": SDIST_SHA256,
            "layout": LAYOUT,
            "options": [*COMMON_OPTIONS],
            "server_options": [*SERVER_OPTIONS],
            "kernel_options": [*KERNEL_OPTIONS],
            "variants": variants,
            "built_on_flags": sorted(cpu_flags()),
            "seconds": round(seconds, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    log(f"built {target / 'llama-server'} in {_duration(seconds)}")
    return BuildReport(target / "llama-server", seconds, variants, built=True)


def _unpacked_source(tmp: Path, log: Log) -> Path:
    log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} source distribution from PyPI (77 MB) ...")
    try:
        archive = pip_download_source("llama-cpp-python", LLAMA_CPP_PYTHON, tmp / "sdist")
    except RuntimeError as exc:  # ModelError: pip's own last line
        raise BuildError(str(exc)) from exc
    if sha256_of(archive) != SDIST_SHA256:
        raise BuildError(f"sha256 mismatch for {archive.name}: expected {SDIST_SHA256} (not the pinned release)")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp / "src", members=members, filter="data")
    return tmp / "src" / prefix


def _install(server_bin: Path, kernel_bin: Path, variants: list[str], target: Path) -> None:
    """The server, its libraries and the CPU kernel modules into ``target`` (replaced whole, never half)."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in server_bin.iterdir():
        if item.name == "llama-server" or ".so" in item.name:
            shutil.copy2(item, staging / item.name, follow_symlinks=False)
    for variant in variants:
        shutil.copy2(kernel_bin / f"libggml-cpu-{variant}.so", staging / f"libggml-cpu-{variant}.so")
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)


def _recorded_variants(folder: Path) -> list[str]:
    try:
        return list(json.loads((folder / "build.json").read_text())["variants"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _write_json(path: Path, data: object) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


# --- running cmake where the user can see it ---------------------------------------------------------------
_PERCENT = re.compile(rb"^\[\s*(\d+)%\]", re.MULTILINE)


class _Progress:
    """A line at least every ``PROGRESS_EVERY_S`` while cmake runs: phase, percentage, elapsed, about how long
    is left, the log."""

    def __init__(self, log: Log, log_path: Path, started: float) -> None:
        self.log, self.log_path, self.started = log, log_path, started
        self.done: dict[str, float] = {}  # phase -> its finished fraction

    def fraction(self) -> float:
        return sum(PHASE_WEIGHTS[p] * f for p, f in self.done.items())

    def update(self, phase: str, percent: int | None) -> None:
        if percent is not None:
            self.done[phase] = max(self.done.get(phase, 0.0), percent / 100)
        elapsed = time.monotonic() - self.started
        overall = self.fraction()
        left = f", about {_duration(elapsed / overall - elapsed)} left" if overall >= 0.05 else ""
        where = "the server" if phase == "server" else "the CPU kernels"
        self.log(
            f"  building llama-server: {overall:.0%} ({where} {self.done.get(phase, 0.0):.0%}) after "
            f"{_duration(elapsed)}{left} (log: {self.log_path})"
        )


def _cmake(args: list[str], out: BinaryIO, watch: _Progress, phase: str) -> None:
    """One cmake call, its output appended to the build log; progress lines meanwhile; a failure is one line."""
    out.flush()
    start = out.tell()
    process = subprocess.Popen(["cmake", *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        while True:
            try:
                code = process.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                watch.update(phase, _last_percent(watch.log_path, start))
    except BaseException:
        process.kill()
        process.wait()
        raise
    if "--build" in args:
        watch.done[phase] = 1.0 if code == 0 else watch.done.get(phase, 0.0)
    if code != 0:
        tail = watch.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise BuildError(
            f"cmake {' '.join(args[:2])} ... failed (exit {code}): {' / '.join(tail)} (whole log: {watch.log_path})"
        )


def _last_percent(log_path: Path, start: int) -> int | None:
    """The last ``[ NN%]`` cmake printed since ``start`` (bytes into the log)."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - 65536))
            found = _PERCENT.findall(f.read())
    except OSError:
        return None
    return int(found[-1]) if found else None


# --- one build per cache -----------------------------------------------------------------------------------
@contextmanager
def build_lock(cache: str | os.PathLike[str] | None, log: Log, *, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """One build per cache: a second process waits for the first one's (saying so, and where its log is)."""
    what = f"building llama-server into {engine_dir(cache).parent} (log: {build_log_path(cache)})"
    with cache_lock(cache_root(cache) / "locks" / "llama-build.lock", what, log, every_s=every_s):
        yield


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
