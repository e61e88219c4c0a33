"""The checks off the critical path: a training step against a latency server with the library gate off, on
(the product's defaults) and with lesson trials on too. Reports each step's wall time, the gated step over the
ungated one (paired by latency draws), the ungated step over its own LLM critical path, and what the checks add
after the step's plan: their time after the last learner call ends, and their own chain (the sum over their
waves after the plan of each wave's longest call: what no concurrency removes; a wave is the calls that start
before the calls of the wave so far have all ended, as a look starts when the look before it has ended).

    python benchmarks/gated_step.py                    # 40 problems x G=5, concurrency 256, 3 repeats (~4 min)
    python benchmarks/gated_step.py --repeats 5 --json gated.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RunSpec, fmt, machine, prefect_harness, run_once, spread, start_server, table
from latency_server import LatencyModel

from clgrpo.storage.store import LLM_CALL_SENT_AT, Store
from schemas.stages import Stage

CHECK_STAGES = (Stage.VALIDATE_LESSONS.value, Stage.LIBRARY_GATE.value)
SETTINGS = ("off", "default", "trials")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--median-s", type=float, default=1.0, help="median time to first token")
    parser.add_argument("--sigma", type=float, default=0.6)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    return parser.parse_args(argv)


def checks_after_plan(db: Path, run_id: str) -> dict[str, float]:
    """From the stored calls: how long the checks ran after the last learner or rollout call ended, and the chain
    of their waves there (each wave's longest call, summed)."""
    with Store(db, read_only=True) as store:
        calls = store.query(  # started_at: when a call was sent, after waiting its turn
            f"SELECT stage, {LLM_CALL_SENT_AT} AS started_at, latency_s FROM llm_calls WHERE run_id = ?", [run_id]
        )
    if calls.empty:
        return {"checks_after_s": 0.0, "checks_chain_s": 0.0, "checks_calls": 0}
    calls["ended_at"] = calls["started_at"] + calls["latency_s"].map(lambda s: timedelta(seconds=s))
    checks = calls[calls["stage"].isin(CHECK_STAGES)].sort_values("started_at")
    plan_end = calls[~calls["stage"].isin(CHECK_STAGES)]["ended_at"].max()
    after = checks[checks["started_at"] >= plan_end]
    chain, wave_end, wave_longest = 0.0, None, 0.0
    for started, ended, latency in zip(after["started_at"], after["ended_at"], after["latency_s"]):
        if wave_end is None or started >= wave_end:  # a look starts once the look before it has ended
            chain += wave_longest
            wave_end, wave_longest = ended, 0.0
        wave_end, wave_longest = max(wave_end, ended), max(wave_longest, latency)
    chain += wave_longest
    end = calls["ended_at"].max()
    return {
        "checks_after_s": max(0.0, (end - plan_end).total_seconds()) if not checks.empty else 0.0,
        "checks_chain_s": chain,
        "checks_calls": len(checks),
        "checks_beside_rollouts": int((checks["started_at"] < plan_end).sum()),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = LatencyModel(median_s=args.median_s, sigma=args.sigma)
    runs: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-gated-"))
    with prefect_harness(), start_server(model, supports_n=False) as server:
        run_once(RunSpec(n_problems=8, group_size=args.group_size), server, workdir, "warmup", critical_path=False)
        for repeat in range(args.repeats):
            for checks in SETTINGS:
                spec = RunSpec(
                    n_problems=args.problems,
                    group_size=args.group_size,
                    concurrency=args.concurrency,
                    latency_seed=repeat,
                    checks=checks,
                )  # the same latency draws for the three settings of a repeat
                run_id = f"{checks}-r{repeat}"
                figures = run_once(spec, server, workdir, run_id, critical_path=checks == "off")
                figures |= checks_after_plan(workdir / f"{run_id}.duckdb", run_id)
                figures |= {"repeat": repeat, "checks": checks}
                runs.append(figures)
                print(
                    f"run {repeat + 1}/{args.repeats} {checks}: step {figures['step_wall_s']:.2f}s, checks after the "
                    f"plan {figures['checks_after_s']:.2f}s (chain {figures['checks_chain_s']:.2f}s)",
                    flush=True,
                )
    report(runs, args, model)
    if args.json:
        payload = {"machine": machine(), "latency_model": asdict(model), "args": vars(args), "runs": runs}
        args.json.write_text(json.dumps(payload, indent=1, default=str))


def report(runs: list[dict], args: argparse.Namespace, model: LatencyModel) -> None:
    by_repeat: dict[int, dict[str, dict]] = defaultdict(dict)
    for run in runs:
        by_repeat[run["repeat"]][run["checks"]] = run
    print(
        f"\n{machine()}; {args.problems} problems x G={args.group_size}, concurrency {args.concurrency}, "
        f"{args.repeats} repeats, median [min-max]; latency model {asdict(model)}"
    )
    rows = []
    for checks in SETTINGS:
        group = [r[checks] for r in by_repeat.values()]
        ratio = [r[checks]["step_wall_s"] / r["off"]["step_wall_s"] for r in by_repeat.values()]
        rows.append(
            [
                checks,
                fmt(spread([g["step_wall_s"] for g in group])),
                fmt(spread(ratio), 3),
                fmt(spread([g["ratio_own"] for g in group]), 3) if checks == "off" else "",
                fmt(spread([g["checks_after_s"] for g in group])),
                fmt(spread([g["checks_chain_s"] for g in group])),
                f"{group[0]['checks_calls']} ({group[0].get('checks_beside_rollouts', 0)} beside the rollouts)",
            ]
        )
    headers = [
        "checks",
        "step wall s",
        "/ step without checks",
        "ungated / its CP",
        "checks after plan s",
        "their chain s",
        "check calls (repeat 1)",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
