"""One training step against a long-tail latency server: wall time vs the LLM-bound critical path, barrier vs
pipelined, where the time outside LLM waits goes, the concurrency the endpoint actually sees, peak RSS, and
LLM calls / tokens per stage.

    python benchmarks/step.py              # 100 problems x G=5, concurrency 64 and 128, 3 runs (~6.5 min, 2 cores)
    python benchmarks/step.py --repeats 5 --json step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # sets up Prefect's environment first
    RunSpec,
    fmt,
    machine,
    prefect_harness,
    run_once,
    spread,
    start_server,
    table,
)
from latency_server import LatencyModel


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--designs", nargs="+", default=["barrier", "pipelined"], choices=["barrier", "pipelined"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--median-s", type=float, default=LatencyModel.median_s, help="median time to first token")
    parser.add_argument("--sigma", type=float, default=LatencyModel.sigma)
    parser.add_argument("--tail-p", type=float, default=LatencyModel.tail_p)
    parser.add_argument("--tokens-per-s", type=float, default=LatencyModel.tokens_per_s)
    parser.add_argument("--supports-n", action="store_true", help="one policy request with n=G per problem")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = LatencyModel(median_s=args.median_s, sigma=args.sigma, tail_p=args.tail_p, tokens_per_s=args.tokens_per_s)
    runs: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-step-"))
    with prefect_harness(), start_server(model, args.supports_n) as server:
        warm = RunSpec(n_problems=8, group_size=args.group_size, supports_n=args.supports_n)
        run_once(warm, server, workdir, "warmup", critical_path=False)  # starts the verifier pool, imports
        for repeat in range(args.repeats):
            for concurrency in args.concurrency:
                for design in args.designs:
                    spec = RunSpec(
                        n_problems=args.problems,
                        group_size=args.group_size,
                        concurrency=concurrency,
                        pipeline=design == "pipelined",
                        supports_n=args.supports_n,
                        latency_seed=repeat,
                    )  # new draws per repeat, the same for both designs
                    figures = run_once(spec, server, workdir, f"{design}-c{concurrency}-r{repeat}")
                    figures["repeat"] = repeat
                    runs.append(figures)
                    print(
                        f"run {repeat + 1}/{args.repeats} c={concurrency} {design}: step {figures['step_wall_s']:.2f}s"
                        f", critical path {figures['step_wall_s'] / figures['ratio_own']:.2f}s, ratio "
                        f"{figures['ratio_own']:.3f}",
                        flush=True,
                    )
    report(runs, args, model)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": machine(), "latency_model": asdict(model), "args": vars(args), "runs": runs},
                indent=1,
                default=str,
            )
        )


def report(runs: list[dict], args: argparse.Namespace, model: LatencyModel) -> None:
    cells = defaultdict(list)
    for run in runs:
        cells[(run["concurrency"], run["design"])].append(run)
    print(
        f"\n{machine()}; {args.problems} problems x G={args.group_size}, {args.repeats} runs per cell, "
        f"median [min-max]; latency model {asdict(model)}; measured median call {runs[0]['median_latency_s']:.2f}s"
    )
    headers = [
        "conc",
        "design",
        "step wall s",
        "own CP s",
        "wall / own CP",
        "wall / pipelined CP",
        "outside LLM s",
        "DuckDB s",
        "Prefect s",
        "loop busy",
        "server max / mean in flight",
        "peak RSS MiB",
    ]
    rows = []
    for (concurrency, design), group in sorted(cells.items()):
        col = lambda key, group=group: spread([r[key] for r in group])  # noqa: E731
        own = [r["step_wall_s"] / r["ratio_own"] for r in group]
        rows.append(
            [
                concurrency,
                design,
                fmt(col("step_wall_s")),
                fmt(spread(own)),
                fmt(col("ratio_own"), 3),
                fmt(col("ratio_ideal"), 3),
                fmt(col("outside_llm_s")),
                fmt(col("store_s")),
                fmt(col("loop_prefect_s")),
                fmt(col("loop_busy_share")),
                f"{max(r['server_max_in_flight'] for r in group)} / {col('server_mean_in_flight')['median']:.1f}",
                f"{max(r['peak_rss_mib'] for r in group):.0f}",
            ]
        )
    print(table(headers, rows))
    loads = [x for r in runs for x in r["load_avg_1m"]]
    print(f"1-minute load average at run starts/ends: {min(loads):.1f}-{max(loads):.1f} ({machine().split(', ')[1]})")

    gains = []
    for concurrency in args.concurrency:
        by_repeat = defaultdict(dict)
        for run in runs:
            if run["concurrency"] == concurrency:
                by_repeat[run["repeat"]][run["design"]] = run
        paired = [
            r["barrier"]["step_wall_s"] / r["pipelined"]["step_wall_s"]
            for r in by_repeat.values()
            if {"barrier", "pipelined"} <= set(r)
        ]
        cp = [
            r["barrier"]["cp_barrier_s"] / r["barrier"]["cp_pipelined_s"] for r in by_repeat.values() if "barrier" in r
        ]
        if paired:
            gains.append([concurrency, fmt(spread(paired), 3), fmt(spread(cp), 3)])
    if gains:
        print(
            "\nPipelining gain (barrier step wall / pipelined step wall, paired by run; and the same for the "
            "critical paths)"
        )
        print(table(["conc", "measured gain", "critical-path gain"], gains))

    last = runs[-1]
    print("\nLLM calls and tokens per stage (one run; identical in every run; tokens = words)")
    print(
        table(
            ["stage", "calls", "tokens in", "tokens out"],
            [[s, v["calls"], v["tokens_in"], v["tokens_out"]] for s, v in last["per_stage"].items()],
        )
    )
    shares = defaultdict(list)
    for run in runs:
        for key, value in run["loop_shares"].items():
            shares[(run["design"], key)].append(value)
    print("\nEvent-loop thread during the step (sampled every 5 ms): share of samples, median over all runs")
    keys = sorted({k for _, k in shares})
    print(
        table(
            ["design", *keys],
            [
                [d, *(f"{spread(shares[(d, k)])['median']:.3f}" if shares.get((d, k)) else "0" for k in keys)]
                for d in args.designs
            ],
        )
    )


if __name__ == "__main__":
    main()
