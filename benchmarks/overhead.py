"""Fixed overhead of one ``clgrpo train``: the console script on a run whose model work is negligible (4 problems x
G=2 against the asyncio latency server at ~1 ms per call), minus the interpreter's own start.

Two setups: ``PREFECT_API_URL`` pointing at a running ``prefect server start`` (what a deployment or a user with
a server has), and no API URL (Prefect starts a temporary server for the run and stops it after).

    python benchmarks/overhead.py                 # 5 runs per setup; ~1.5 min
    python benchmarks/overhead.py --repeats 10 --json overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

CONFIG = """\
db_path: {workdir}/runs/overhead.duckdb
domain: math
dataset: {{path: {workdir}/problems.jsonl, limit: 4}}
policy: {{model: scripted, base_url: "{base_url}", api_key_env: null, max_tokens: 512, supports_n: false}}
grpo: {{group_size: 2, epochs: 1, batch_size: 4}}
concurrency: 16
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return wall


def _script(name: str) -> str:
    """The console script installed beside this interpreter (the venv need not be on PATH), else PATH's."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or name


def prefect_server(env: dict[str, str], port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [_script("prefect"), "server", "start", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise SystemExit("prefect server start did not answer within 120 s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from async_server import AsyncLatencyServerProcess
    from harness import machine
    from latency_server import LatencyModel

    from clgrpo.testing.scripted_llm import make_problems, write_jsonl

    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-overhead-"))
    write_jsonl(make_problems(2, seed=0), workdir / "problems.jsonl")
    env = {
        **os.environ,
        "PREFECT_HOME": str(workdir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "CLGRPO_STATE_DIR": str(workdir / "state"),
    }
    env.pop("PREFECT_API_URL", None)
    clgrpo = _script("clgrpo")
    results: dict[str, list[float]] = {"python -c pass": [], "running server": [], "temporary server": []}
    model = LatencyModel(median_s=0.001, sigma=0.1, tail_p=0.0, tokens_per_s=0.0)
    with AsyncLatencyServerProcess(model, supports_n=False) as llm:
        config = workdir / "overhead.yaml"
        config.write_text(CONFIG.format(workdir=workdir, base_url=llm.base_url))
        port = free_port()
        server = prefect_server(env, port)
        try:
            with_server = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
            run = 0
            for _ in range(args.repeats):
                results["python -c pass"].append(timed([sys.executable, "-c", "pass"], env))
                for setup, setup_env in (("running server", with_server), ("temporary server", env)):
                    run += 1
                    results[setup].append(
                        timed([clgrpo, "train", "--config", str(config), "--run-id", f"r{run}"], setup_env)
                    )
                print(
                    f"run {_ + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results.items()),
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(timeout=30)
    start = statistics.median(results["python -c pass"])
    print(f"\n{machine()}; load average {os.getloadavg()[0]:.1f}; {args.repeats} runs, median [min-max] s")
    for setup, walls in results.items():
        line = f"{setup:>17}: {statistics.median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}]"
        if setup != "python -c pass":
            line += f"   overhead beyond Python start {statistics.median(walls) - start:.2f}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
