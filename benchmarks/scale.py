"""Scale: does the flow keep a fast endpoint busy, and does anything cold sit on the critical path?

Scenarios (each run in a fresh process with a throw-away Prefect API, the asyncio latency server in its own
process, the real training flow with pipelining, one DuckDB file):

  small    40 problems x G=5, one step, concurrency 256 (never binds), the step benchmark's latency model
           (median 0.8 s + 100 tokens/s): wall and LLM span against the critical path of the calls made; the
           gap between a group's last rollout and its first summary (where a cold verifier would show).
  small-mv the same, every answer graded by math-verify in the verifier pool (started cold with the run),
           as for answers that are not a single boxed integer.
  1k       1,000 problems x G=5, one step, concurrency 256 and 512, a fast server (median 0.2 s, no generation
           time, admits 1,024 at once): the flow process's CPU per LLM call and the client's share of it, the
           server's requests in flight over time (a plot) against the calls the flow had waiting or running,
           the LLM span against the cap-limited schedule, garbage-collection pauses.
  10k      10,000 problems x G=5 in steps of 1,000, concurrency 256, the same fast server: whether the figures
           hold over a long run (CPU per call, pauses, memory).

    python benchmarks/scale.py                         # small (x2 kinds) x3, 1k at 256 and 512 x3, 10k once; ~15 min
    python benchmarks/scale.py --scenarios small 1k --repeats 1 --json scale.json --plot-dir plots

Acceptance figures (issue 18): client CPU <= 1 ms per call, >= 90% of the configured concurrency in flight while
the flow has that many calls to make, LLM span <= 1.5x the cap-limited schedule at 1,000 x G=5; the 40 x G=5
step within 1.10x its critical path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gc_pauses import GCPauses  # noqa: E402

FAST = dict(median_s=0.2, sigma=0.5, tail_p=0.0, tokens_per_s=0.0, max_concurrency=1024)
STEP = dict(median_s=0.8, sigma=0.5, tail_p=0.02, tokens_per_s=100.0, max_concurrency=1024)
SAMPLE_S = 0.02  # demand sampling interval


@dataclass(frozen=True)
class Scenario:
    name: str
    problems: int
    concurrency: int
    batch_size: int
    latency: dict
    critical_path: bool = True
    math_verify_all: bool = False  # grade every answer in the math-verify pool (no integer shortcut)


def scenarios(names: list[str], concurrencies: list[int]) -> list[Scenario]:
    out = []
    for name in names:
        if name == "small":
            out.append(Scenario("small", 40, 256, 40, STEP))
        elif name == "small-mv":
            out.append(Scenario("small-mv", 40, 256, 40, STEP, math_verify_all=True))
        elif name == "1k":
            out += [Scenario("1k", 1000, c, 1000, FAST) for c in concurrencies]
        elif name == "10k":
            out.append(Scenario("10k", 10_000, 256, 1000, FAST, critical_path=False))
        else:
            raise SystemExit(f"unknown scenario {name!r} (small, small-mv, 1k, 10k)")
    return out


class Demand:
    """How many LLM calls the flow has started and not finished (waiting for a slot or at the server), sampled
    every ``SAMPLE_S`` from a thread, by wrapping ``LLMClient._call``."""

    def __init__(self) -> None:
        self.active = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((time.monotonic(), self.active))

    def __enter__(self) -> "Demand":
        from clgrpo.llm.client import LLMClient

        original, demand = LLMClient._call, self

        async def counted(self_, *args, **kwargs):
            demand.active += 1
            try:
                return await original(self_, *args, **kwargs)
            finally:
                demand.active -= 1

        self._original = original
        LLMClient._call = counted
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        from clgrpo.llm.client import LLMClient

        LLMClient._call = self._original
        self._stop.set()
        self._thread.join()


def in_flight_at(log, offset: float, times: list[float]) -> list[int]:
    """Requests in service at the server at each time (the server's own start/end stamps)."""
    events = sorted([(e.started + offset, 1) for e in log] + [(e.ended + offset, -1) for e in log])
    out, level, j = [], 0, 0
    for t in times:
        while j < len(events) and events[j][0] <= t:
            level += events[j][1]
            j += 1
        out.append(level)
    return out


def group_gaps(records) -> list[float]:
    """Per group: first summary start minus last rollout end (server clock): verification, stage hand-off."""
    last_rollout: dict[str, float] = {}
    first_summary: dict[str, float] = {}
    for r in records:
        if r.group is None:
            continue
        if r.role == "policy":
            last_rollout[r.group] = max(last_rollout.get(r.group, -math.inf), r.ended)
        elif r.role == "trajectory summarizer":
            start = r.ended - r.service_s
            first_summary[r.group] = min(first_summary.get(r.group, math.inf), start)
    return [first_summary[g] - last_rollout[g] for g in first_summary if g in last_rollout]


def child(scenario: Scenario, out: Path, plot: Path | None, repeat: int) -> None:
    from async_server import AsyncLatencyServerProcess
    from critical_path import limits
    from harness import LoopSampler, Probe, RunSpec, make_config, peak_rss_mib, prefect_harness
    from latency_server import LatencyModel

    from clgrpo.process.runtime import tune_gc
    from flows import train as train_module

    tune_gc()  # as `clgrpo train` does after its imports
    if scenario.math_verify_all:  # answers that need math-verify (fractions, expressions): the pool grades all
        import domains.math.verify as verify_module

        verify_module.integer_answer = lambda output, answer: None
    spec = RunSpec(
        n_problems=scenario.problems,
        concurrency=scenario.concurrency,
        batch_size=scenario.batch_size,
        latency_seed=repeat,
    )
    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-scale-"))
    model = LatencyModel(**scenario.latency, seed=repeat)
    with prefect_harness(), AsyncLatencyServerProcess(model, supports_n=False) as server:
        warm = make_config(RunSpec(n_problems=8), server.base_url, workdir, "warmup")
        asyncio.run(train_module.train(warm))  # one-off costs of a process (first task runs, imports)
        from domains.math.verify import shutdown_pool

        shutdown_pool()  # the measured run starts its verifier pool cold, as a fresh `clgrpo train` does
        server.reset(repeat)
        cfg = make_config(spec, server.base_url, workdir, "scale")
        probe = Probe()
        server_cpu0 = server.cpu_s()
        with probe.installed(), LoopSampler(probe) as sampler, Demand() as demand, GCPauses() as pauses:
            cpu0, t0 = time.process_time(), time.monotonic()
            asyncio.run(train_module.train(cfg))
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        server_cpu = server.cpu_s() - server_cpu0
        served = server.collect()
    figures = measure(scenario, served, demand, probe, sampler, wall, cpu, pauses, limits, plot)
    figures.update(repeat=repeat, server_cpu_s=server_cpu, peak_rss_mib=peak_rss_mib())
    out.write_text(json.dumps(figures))


def measure(scenario, served, demand, probe, sampler, wall, cpu, pauses, limits, plot) -> dict:
    offset = served.clock_offset_s
    log = served.log
    calls = len(log)
    span_lo = min(e.started for e in log) + offset
    span_hi = max(e.ended for e in log) + offset
    times = [t for t, _ in demand.samples if span_lo <= t <= span_hi]
    wanted = [d for t, d in demand.samples if span_lo <= t <= span_hi]
    flying = in_flight_at(log, offset, times)
    cap = scenario.concurrency
    saturated = [f for f, d in zip(flying, wanted) if d >= cap]
    usable = sum(min(cap, d) for d in wanted)
    shares = sampler.shares()
    steps_s = sum(end - start for start, end in probe.steps)
    figures = {
        "scenario": scenario.name,
        "problems": scenario.problems,
        "concurrency": cap,
        "llm_calls": calls,
        "flow_wall_s": wall,
        "step_wall_s": steps_s,
        "llm_span_s": span_hi - span_lo,
        "cpu_s": cpu,
        "cpu_ms_per_call": 1000 * cpu / calls,
        "client_ms_per_call": 1000 * shares.get("llm client", 0.0) * steps_s / calls,
        "loop_shares": shares,
        "saturated_s": len(saturated) * SAMPLE_S,
        "sustained_share": (statistics.fmean(saturated) / cap) if saturated else math.nan,
        "usable_share": sum(flying) / usable if usable else math.nan,
        "server_max_in_flight": served.max_in_flight,
        "server_mean_in_flight": statistics.fmean(flying) if flying else 0.0,
        "gc_pause_s": sum(pauses.total.values()),
        "gc_full": pauses.count[2],
        "gc_full_s": pauses.total[2],
        "gc_longest_ms": 1000 * pauses.longest,
        "store_s": probe.store_s,
        "median_service_s": statistics.median(r.service_s for r in served.records),
    }
    gaps = group_gaps(served.records)
    if gaps:
        figures.update(gap_median_s=statistics.median(gaps), gap_max_s=max(gaps))
    if scenario.critical_path:
        bound = limits(served.records, cap)
        figures.update(
            cp_s=bound.pipelined_s,
            span_over_cp=(span_hi - span_lo) / bound.pipelined_s,
            wall_over_cp=steps_s / bound.pipelined_s,
        )
    if plot is not None:
        draw(plot, scenario, [t - span_lo for t in times], flying, wanted, figures)
    return figures


def draw(
    path: Path, scenario: Scenario, times: list[float], flying: list[int], wanted: list[int], figures: dict
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(
        times,
        [min(d, 2 * scenario.concurrency) for d in wanted],
        color="0.6",
        lw=1,
        label="calls the flow had started (waiting or in service; clipped at 2x)",
    )
    ax.plot(times, flying, color="C0", lw=1.2, label="in service at the server")
    ax.axhline(scenario.concurrency, color="C3", ls="--", lw=1, label=f"concurrency {scenario.concurrency}")
    ax.set_xlabel("s since the first request")
    ax.set_ylabel("requests")
    title = (
        f"{scenario.problems} problems x G=5, concurrency {scenario.concurrency}: "
        f"{figures['cpu_ms_per_call']:.2f} ms flow CPU / call, span {figures['llm_span_s']:.1f} s"
    )
    if "cp_s" in figures:
        title += f" ({figures['span_over_cp']:.2f}x schedule)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_child(scenario: Scenario, repeat: int, plot_dir: Path | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    plot = plot_dir / f"in-flight-{scenario.name}-c{scenario.concurrency}-r{repeat}.png" if plot_dir else None
    command = [
        sys.executable,
        __file__,
        "--child",
        json.dumps(scenario.__dict__),
        "--out",
        str(out),
        "--repeat",
        str(repeat),
    ] + (["--plot", str(plot)] if plot else [])
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["small", "small-mv", "1k", "10k"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 512], help="for the 1k scenario")
    parser.add_argument("--repeats", type=int, default=3, help="runs of small and 1k (10k runs once)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot-dir", type=Path, default=Path("benchmarks/plots"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--plot", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Scenario(**json.loads(args.child)), args.out, args.plot, args.repeat)
        return
    runs = []
    for scenario in scenarios(args.scenarios, args.concurrency):
        for repeat in range(1 if scenario.name == "10k" else args.repeats):
            figures = run_child(scenario, repeat, args.plot_dir)
            runs.append(figures)
            print(summary_line(figures), flush=True)
    report(runs)
    if args.json:
        from harness import machine

        args.json.write_text(
            json.dumps({"machine": machine(), "args": vars(args), "runs": runs}, indent=1, default=str)
        )


def summary_line(f: dict) -> str:
    line = (
        f"{f['scenario']} conc {f['concurrency']}: wall {f['flow_wall_s']:.1f}s, span {f['llm_span_s']:.1f}s, "
        f"{f['llm_calls']} calls, flow CPU {f['cpu_ms_per_call']:.2f} ms/call (client ~{f['client_ms_per_call']:.2f}), "
        f"in flight {f['server_mean_in_flight']:.0f} (max {f['server_max_in_flight']}), sustained "
        f"{f['sustained_share']:.2f} over {f['saturated_s']:.1f}s, GC {f['gc_pause_s']:.2f}s ({f['gc_full']} full, "
        f"longest {f['gc_longest_ms']:.0f} ms)"
    )
    if "cp_s" in f:
        line += f", CP {f['cp_s']:.2f}s: span/CP {f['span_over_cp']:.3f}, step/CP {f['wall_over_cp']:.3f}"
    if "gap_median_s" in f:
        line += f", rollout->summary gap p50 {f['gap_median_s']:.2f}s"
    return line


def report(runs: list[dict]) -> None:
    from harness import fmt, machine, spread, table

    print(f"\n{machine()}; median [min-max] per scenario")
    keys = [
        ("flow_wall_s", "wall s", 1),
        ("llm_span_s", "LLM span s", 1),
        ("cp_s", "schedule (CP) s", 2),
        ("span_over_cp", "span / CP", 3),
        ("wall_over_cp", "step wall / CP", 3),
        ("cpu_ms_per_call", "flow CPU ms / call", 2),
        ("client_ms_per_call", "client ms / call (sampled)", 2),
        ("sustained_share", "in flight / conc while saturated", 2),
        ("server_mean_in_flight", "mean in flight", 0),
        ("gc_pause_s", "GC pauses s", 2),
        ("gc_longest_ms", "longest GC ms", 0),
        ("gap_median_s", "rollout->summary gap p50 s", 2),
        ("peak_rss_mib", "peak RSS MiB", 0),
    ]
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["scenario"], run["problems"], run["concurrency"]), []).append(run)
    headers = ["scenario", "problems", "conc", "calls"] + [label for _, label, _ in keys]
    rows = []
    for (name, problems, conc), group in groups.items():
        row = [name, problems, conc, group[0]["llm_calls"]]
        for key, _, digits in keys:
            values = [r[key] for r in group if key in r and not (isinstance(r[key], float) and math.isnan(r[key]))]
            row.append(fmt(spread(values), digits) if values else "-")
        rows.append(row)
    print(table(headers, rows))


if __name__ == "__main__":
    main()
