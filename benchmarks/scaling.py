"""Scaling series: one epoch over 100 / 1,000 / 10,000 problems (G=5, steps of ``--batch-size`` problems) against a
fast server, each size in a fresh process so its peak RSS is its own. Shows how wall time, CPU time and memory
grow with the number of problems once LLM latency is (nearly) out of the way.

    python benchmarks/scaling.py                        # 100 and 1,000 problems, 1 run each (about 4 minutes)
    python benchmarks/scaling.py --sizes 100 1000 10000 --repeats 3 --json scaling.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FAST = dict(median_s=0.002, sigma=0.5, tail_p=0.0, tokens_per_s=0.0)  # 1-5 ms per call, no generation time


def child(size: int, batch_size: int, concurrency: int, out: Path) -> None:
    from harness import RunSpec, prefect_harness, run_once, start_server
    from latency_server import LatencyModel

    spec = RunSpec(n_problems=size, concurrency=concurrency, batch_size=batch_size)
    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-scaling-"))
    with prefect_harness(), start_server(LatencyModel(**FAST), spec.supports_n) as server:
        run_once(RunSpec(n_problems=8), server, workdir, "warmup", critical_path=False)  # one-off start-up costs
        figures = run_once(spec, server, workdir, f"scaling-{size}", critical_path=False)
    out.write_text(json.dumps(figures, default=str))


def run_size(size: int, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    command = [
        sys.executable,
        __file__,
        "--child",
        str(size),
        "--batch-size",
        str(args.batch_size),
        "--concurrency",
        str(args.concurrency),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--batch-size", type=int, default=100, help="problems per step")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.batch_size, args.concurrency, args.out)
        return
    runs = []
    for repeat in range(args.repeats):
        for size in args.sizes:
            figures = run_size(size, args)
            figures["repeat"] = repeat
            runs.append(figures)
            print(
                f"run {repeat + 1}/{args.repeats} {size} problems: {figures['flow_wall_s']:.1f}s in "
                f"{figures['steps']} steps, peak RSS {figures['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    report(runs, args)
    if args.json:
        from harness import machine

        args.json.write_text(
            json.dumps(
                {"machine": machine(), "latency_model": FAST, "args": vars(args), "runs": runs}, indent=1, default=str
            )
        )


def report(runs: list[dict], args: argparse.Namespace) -> None:
    from harness import fmt, machine, spread, table

    by_size = defaultdict(list)
    for run in runs:
        by_size[run["n_problems"]].append(run)
    print(
        f"\n{machine()}; G=5, {args.batch_size} problems per step, concurrency {args.concurrency}, "
        f"server {FAST}; {args.repeats} run(s) per size, median [min-max]"
    )
    headers = [
        "problems",
        "steps",
        "LLM calls",
        "wall s",
        "wall ms / problem",
        "CPU ms / problem",
        "DuckDB ms / problem",
        "server max in flight",
        "peak RSS MiB",
    ]
    rows = []
    for size, group in sorted(by_size.items()):
        per = lambda key, size=size, group=group: spread([1000 * r[key] / size for r in group])  # noqa: E731
        rows.append(
            [
                size,
                group[0]["steps"],
                group[0]["llm_calls"],
                fmt(spread([r["flow_wall_s"] for r in group]), 1),
                fmt(per("flow_wall_s"), 1),
                fmt(per("cpu_s"), 1),
                fmt(per("store_s"), 1),
                max(r["server_max_in_flight"] for r in group),
                fmt(spread([r["peak_rss_mib"] for r in group]), 0),
            ]
        )
    print(table(headers, rows))


if __name__ == "__main__":
    main()
