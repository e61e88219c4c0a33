"""The sandboxed Python tool pool (clgrpo.sandbox.pool): interpreter start latency, cold vs from a spare, and tool-call
throughput with many concurrent sessions for several pool sizes.

    python benchmarks/tool_pool.py                      # about 1 minute on 2 cores
    python benchmarks/tool_pool.py --starts 50 --sessions 64 --calls 50 --pools 2 4 8 --json pool.json

(a) start: ``--starts`` sessions one after another, each timing its first run("1"): ``wait_s`` is the time to get
an interpreter (cold: spawn Python + import the worker + apply the restrictions; spare: apply the restrictions
to an interpreter started ahead), "first call" adds the call itself. For the spare case each session starts
only once the next spare is ready (the steady state when rollouts are not back to back).
(b) throughput: ``--sessions`` concurrent sessions each make ``--calls`` short calls
(``x = sum(range(1000)); print(x)``) in a pool of ``pool_size`` interpreters with 2 spares; latency is the
caller's time for run(), waiting for an interpreter included; "first call" is each session's first run()
(waiting for a slot and binding an interpreter), "later calls" the rest (one round trip each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clgrpo.sandbox.pool import PythonSandbox
from schemas.config import SandboxConfig

CALL = "x = sum(range(1000)); print(x)"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def start_latency(starts: int, spare: bool) -> dict:
    sandbox = PythonSandbox(SandboxConfig(pool_size=2, spares=1 if spare else 0))
    waits, firsts = [], []
    try:
        for _ in range(starts):
            if spare:
                await sandbox.start()
                await asyncio.shield(sandbox._spares[0])  # the spare is ready: measure binding only
            async with sandbox.session() as session:
                begin = time.perf_counter()
                result = await session.run("1")
                firsts.append(time.perf_counter() - begin)
                waits.append(result.wait_s)
                assert result.error is None, result
    finally:
        await sandbox.aclose()
    return {
        "kind": "spare" if spare else "cold",
        "n": starts,
        "wait_p50_ms": 1e3 * statistics.median(waits),
        "wait_p99_ms": 1e3 * pct(waits, 99),
        "first_call_p50_ms": 1e3 * statistics.median(firsts),
        "first_call_p99_ms": 1e3 * pct(firsts, 99),
    }


async def throughput(pool_size: int, sessions: int, calls: int) -> dict:
    sandbox = PythonSandbox(SandboxConfig(pool_size=pool_size, spares=2))
    latencies: list[float] = []
    firsts: list[float] = []
    later: list[float] = []

    async def rollout() -> None:
        async with sandbox.session() as session:
            for i in range(calls):
                begin = time.perf_counter()
                result = await session.run(CALL)
                latencies.append(time.perf_counter() - begin)
                (later if i else firsts).append(latencies[-1])
                assert result.error is None and result.output == "499500\n", result

    try:
        await sandbox.start()
        await asyncio.gather(*list(sandbox._spares))
        cpu0, begin = os.times(), time.perf_counter()
        await asyncio.gather(*(rollout() for _ in range(sessions)))
        wall = time.perf_counter() - begin
        cpu1 = os.times()
    finally:
        await sandbox.aclose()
    total = sessions * calls
    parent_cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    children_cpu = (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system)
    return {
        "pool_size": pool_size,
        "sessions": sessions,
        "calls": total,
        "wall_s": wall,
        "calls_per_s": total / wall,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * pct(latencies, 99),
        "first_p50_ms": 1e3 * statistics.median(firsts),
        "first_p99_ms": 1e3 * pct(firsts, 99),
        "later_p50_ms": 1e3 * statistics.median(later) if later else 0.0,
        "later_p99_ms": 1e3 * pct(later, 99) if later else 0.0,
        "parent_cpu_s": parent_cpu,
        "interpreter_cpu_s": children_cpu,
    }


async def main(args: argparse.Namespace) -> dict:
    starts = [await start_latency(args.starts, spare=False), await start_latency(args.starts, spare=True)]
    runs = [await throughput(size, args.sessions, args.calls) for size in args.pools]
    return {"starts": starts, "throughput": runs, "load": os.getloadavg(), "cores": os.cpu_count()}


def report(figures: dict) -> str:
    lines = [
        "| start | n | wait p50 ms | wait p99 ms | first call p50 ms | first call p99 ms |",
        "|-------|---|-------------|-------------|-------------------|-------------------|",
    ]
    for s in figures["starts"]:
        lines.append(
            f"| {s['kind']} | {s['n']} | {s['wait_p50_ms']:.1f} | {s['wait_p99_ms']:.1f} | "
            f"{s['first_call_p50_ms']:.1f} | {s['first_call_p99_ms']:.1f} |"
        )
    lines += [
        "",
        "| pool_size | sessions x calls | wall s | calls/s | run() p50 / p99 ms | first call p50 / p99 ms | "
        "later calls p50 / p99 ms | parent CPU s | interpreters CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["throughput"]:
        lines.append(
            f"| {r['pool_size']} | {r['sessions']} x {r['calls'] // r['sessions']} | {r['wall_s']:.2f} | "
            f"{r['calls_per_s']:.0f} | {r['p50_ms']:.2f} / {r['p99_ms']:.1f} | "
            f"{r['first_p50_ms']:.1f} / {r['first_p99_ms']:.1f} | "
            f"{r['later_p50_ms']:.2f} / {r['later_p99_ms']:.2f} | {r['parent_cpu_s']:.2f} | "
            f"{r['interpreter_cpu_s']:.2f} |"
        )
    lines.append(
        f"\nload average at the end: {' / '.join(f'{x:.2f}' for x in figures['load'])}, {figures['cores']} cores"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--pools", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = asyncio.run(main(args))
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
