"""Engines for the demo's model on this CPU: tokens/s of llama-server with each CPU kernel variant of the built
engine, and of a prebuilt alternative (xllamacpp's CPU wheel from PyPI, installed into a temporary virtualenv).

The requests are the demo's kind: ``--requests`` chats ("how many whole numbers from a to b ..."), a system
prompt with a few lessons, ``--max-tokens`` each, ``--concurrency`` in flight, 8 server slots, Qwen2.5-Coder-0.5B.
Each engine serves alone, one after another (run it on an idle machine). The figures are in benchmarks/REPORT.md
("Engines").

    python benchmarks/engines.py                      # the built engine's kernels present here, then xllamacpp
    python benchmarks/engines.py --no-xllamacpp --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from application.llama_build import built_binary  # noqa: E402
from application.llama_server import LlamaEngine, LlamaServer, free_port  # noqa: E402
from clgrpo.models.weights import QWEN_05B, fetch_model  # noqa: E402

XLLAMACPP = "2026.10.11549"
SYSTEM = "You are a careful math solver. Think step by step and put the final integer answer in \\boxed{}. " + " ".join(
    f"[E{i}] When counting whole numbers from a to b inclusive, use b - a + 1." for i in range(6)
)
XLLAMACPP_SERVER = textwrap.dedent("""\
    import signal, sys
    import xllamacpp as x
    p = x.CommonParams()
    p.model.path, p.model_alias, p.port = sys.argv[1], "m", int(sys.argv[2])
    p.n_parallel, p.n_ctx = 8, 8 * 4096
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[3])
    server = x.Server(p)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
""")


async def _one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[int, int]:
    rng = random.Random(i)
    a = rng.randint(10, 500)
    b = a + rng.randint(5, 900)
    question = f"How many whole numbers are there from {a} to {b}, if both ends count?"
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
    }
    async with session.post(f"{url}/chat/completions", json=body) as reply:
        usage = (await reply.json())["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


async def throughput(url: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _one(session, url, 10**6, 16)  # warm-up

        async def bounded(i: int) -> tuple[int, int]:
            async with limit:
                return await _one(session, url, i, max_tokens)

        started = time.monotonic()
        done = await asyncio.gather(*[bounded(i) for i in range(requests)])
        seconds = time.monotonic() - started
    generated = sum(g for _, g in done)
    return {"seconds": round(seconds, 1), "generated": generated, "tokens_per_s": round(generated / seconds, 1)}


def kernel_folders(binary: Path, work: Path) -> dict[str, Path]:
    """One copy of the built engine per CPU kernel variant, holding only that variant."""
    folders = {}
    for module in sorted(binary.parent.glob("libggml-cpu-*.so")):
        variant = module.name.removeprefix("libggml-cpu-").removesuffix(".so")
        folder = work / variant
        shutil.copytree(binary.parent, folder, symlinks=True)
        for other in folder.glob("libggml-cpu-*.so"):
            if other.name != module.name:
                other.unlink()
        folders[variant] = folder / "llama-server"
    return folders


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def run_xllamacpp(gguf: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    venv = work / "xllamacpp-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([venv / "bin" / "pip", "install", "-q", f"xllamacpp=={XLLAMACPP}"], check=True)
    port = free_port()
    process = subprocess.Popen(
        [venv / "bin" / "python", "-c", XLLAMACPP_SERVER, str(gguf), str(port), str(args.threads)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, process)
        return asyncio.run(throughput(f"http://127.0.0.1:{port}/v1", args.requests, args.concurrency, args.max_tokens))
    finally:
        process.terminate()
        process.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-xllamacpp", action="store_true", help="only the built engine's kernels")
    ap.add_argument("--variants", help="kernel variants to run, comma-separated (default: all built but x64, slow)")
    ap.add_argument("--cache-dir")
    args = ap.parse_args()
    gguf = fetch_model(QWEN_05B, args.cache_dir).gguf
    binary = built_binary(args.cache_dir)
    if binary is None:
        sys.exit("llama-server is not built: clgrpo model build-server")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = kernel_folders(binary, Path(tmp))
        chosen = args.variants.split(",") if args.variants else [v for v in folders if v != "x64"]
        for variant in chosen:
            copy = folders[variant]
            server = LlamaServer(gguf, "m", slots=8, threads=args.threads, engine=LlamaEngine(copy))
            with server:
                results[f"llama-server ({variant} kernels)"] = asyncio.run(
                    throughput(server.base_url, args.requests, args.concurrency, args.max_tokens)
                )
            print(json.dumps({variant: results[f"llama-server ({variant} kernels)"]}), flush=True)
        if not args.no_xllamacpp:
            results[f"xllamacpp {XLLAMACPP} (prebuilt CPU wheel)"] = run_xllamacpp(gguf, Path(tmp), args)
    print("| engine | seconds | tokens generated | tokens/s |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']} | {r['generated']} | {r['tokens_per_s']} |")


if __name__ == "__main__":
    main()
