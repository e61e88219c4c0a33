"""One training step in agent mode (``rollout.mode: agent``) against the latency server: turns and tool calls
per rollout, where the tool time goes (waiting for an interpreter vs running the code), the LLM time, and the
step's wall time against its critical path.

    python benchmarks/agent_step.py          # 40 x G=5: conc 256 / pool 16 three times, conc 32 and pool 200 once
    python benchmarks/agent_step.py --repeats 5 --extra 256:64 --json agent.json

Setup: the real training flow (Prefect task runs under a throw-away Prefect API, DuckDB, math-verify pool, the
one LLM client over HTTP, the real python sandbox of ``clgrpo/sandbox/pool.py``) against the latency server in its
own process (``benchmarks/latency_server.py``), whose scripted world acts as a ReAct agent when a policy request
lists tools: its first turn calls the python tool (with probability ``--p-base`` without the family's lesson,
0.9 with it; a tenth of those calls have a syntax error, fixed on the next turn), after a tool result it
answers the printed number; otherwise it answers directly. Every turn is one call with its own latency draw
(the model of ``benchmarks/REPORT.md``: lognormal time to first token, median 0.8 s, 2% Pareto stragglers, plus
100 tokens/s). The world tags each tool-calling reply (`` [call N]``), so the server knows which call every
later turn follows.

Critical path (``critical_path.py``, pipelined design): the calls the server served with their drawn service
times, list-scheduled greedily on ``concurrency`` slots with zero pipeline overhead. An agent rollout is the
chain turn0 -> tool -> turn1 -> tool -> ... : a later turn becomes ready when its parent turn has ended plus
the measured wall time of the tool call in between (``PythonSession.run`` as the flow saw it: waiting for an
interpreter + the call; it holds no LLM slot). Then, per group, summaries after all turns of all its samples,
extraction (a repair after its first ask), consolidation after all groups, as for direct rollouts. The tool
times are the flow's measured ones, so a slow sandbox (pool full, cold starts) lengthens the critical path
itself; the "tool wait" columns show how much of them is waiting for an interpreter, and "CP, tools w/o wait"
is the same schedule with each tool gap cut to the call's own time (what the step would be bound by if an
interpreter were always free).

"Rollout phase" is the step start to the end of the last policy call at the server, against the makespan of the
policy calls alone (same model): how much the agent loop, the client and Prefect's task runs add to the turns.

Figures per run: turns and tool calls per rollout (rollouts table), tool time (rollouts table: total, and per
call; the flow's per-call measurements: p50/p99, wait for an interpreter, exec), LLM time (sum of the policy
calls' client-measured latencies in ``llm_calls``, and the server's drawn service times), session close (kill +
reap + remove the directory, at each rollout's end), step wall (``Trainer.run_step`` to the end of its
checkpoint), critical path and their ratio.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from critical_path import dependencies, longest_chain, makespan
from harness import (  # sets up Prefect's environment first
    RunSpec,
    fmt,
    machine,
    make_config,
    prefect_harness,
    run_once,
    spread,
    table,
)
from latency_server import LatencyModel, LatencyServerProcess

import clgrpo.sandbox.pool as sandbox_module
import tasks.rollout as rollout_module
from clgrpo.storage.store import Store

TAG_RE = re.compile(r"\[call (\d+)\]")
_ROLLOUT: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("bench_rollout", default=None)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class ToolProbe:
    """Per tool call: which rollout, the caller's time for ``PythonSession.run``, its wait for an interpreter
    and its own wall time; per session the time to close it; interpreter starts."""

    calls: dict[tuple[str, int], list[dict]] = field(default_factory=lambda: defaultdict(list))
    closes: list[float] = field(default_factory=list)
    spawns: list[float] = field(default_factory=list)

    @contextmanager
    def installed(self) -> Iterator["ToolProbe"]:
        probe = self
        original_rollout = rollout_module.agent_rollout
        session = sandbox_module.PythonSession
        run, close, spawn = session.run, session._close, sandbox_module.PythonSandbox._spawn

        async def agent_rollout(*args: Any, base: dict, **kwargs: Any) -> Any:
            _ROLLOUT.set((base["problem_id"], base["sample_idx"]))  # this task's context: its tool calls see it
            return await original_rollout(*args, base=base, **kwargs)

        async def timed_run(self_: Any, code: str) -> Any:
            t0 = time.monotonic()
            result = await run(self_, code)
            probe.calls[_ROLLOUT.get()].append(
                {
                    "s": time.monotonic() - t0,
                    "wait_s": result.wait_s,
                    "exec_s": result.wall_s,
                    "error": result.error is not None,
                }
            )
            return result

        async def timed_close(self_: Any) -> None:
            t0 = time.monotonic()
            try:
                await close(self_)
            finally:
                probe.closes.append(time.monotonic() - t0)

        async def timed_spawn(self_: Any) -> Any:
            t0 = time.monotonic()
            interp = await spawn(self_)
            probe.spawns.append(time.monotonic() - t0)
            return interp

        rollout_module.agent_rollout = agent_rollout
        session.run, session._close, sandbox_module.PythonSandbox._spawn = timed_run, timed_close, timed_spawn
        try:
            yield self
        finally:
            rollout_module.agent_rollout = original_rollout
            session.run, session._close, sandbox_module.PythonSandbox._spawn = run, close, spawn


def read_rollouts(db_path: str, run_id: str) -> tuple[list[Any], dict[str, Any]]:
    with Store(db_path, read_only=True) as store:
        rollouts = store.records("rollouts", run_id)
        calls = store.query(
            "SELECT count(*) AS n, sum(latency_s) AS latency, max(turn) AS max_turn, "
            "count(DISTINCT call_id) AS distinct_calls FROM llm_calls "
            "WHERE run_id = ? AND stage = 'rollout'",
            [run_id],
        )
    return rollouts, calls.to_dict(orient="records")[0]


def agent_figures(
    spec: RunSpec, server: LatencyServerProcess, cfg_db: str, run_id: str, probe: ToolProbe, base: dict[str, Any]
) -> dict[str, Any]:
    served = server.collect()
    rollouts, policy = read_rollouts(cfg_db, run_id)
    # the tool time before each later turn: the k-th tagged reply of a rollout made its k-th tool call
    gaps: dict[str, float] = {}
    exec_gaps: dict[str, float] = {}  # the same without the wait for an interpreter
    unmatched = 0
    for r in rollouts:
        tags = [t for turn in r.turns if turn.kind == "assistant" for t in TAG_RE.findall(turn.content)]
        measured = probe.calls.get((r.problem_id, r.sample_idx), [])
        if len(measured) != len(tags):
            unmatched += 1
        for k, tag in enumerate(tags):
            gaps[tag] = measured[k]["s"] if k < len(measured) else r.tool_time_s / max(1, r.tool_calls)
            exec_gaps[tag] = measured[k]["s"] - measured[k]["wait_s"] if k < len(measured) else gaps[tag]
    served_records = sorted(served.records, key=lambda c: (c.role != "policy", c.ended - c.service_s))
    records = [replace(c, gap_s=gaps.get(c.parent, 0.0)) for c in served_records]
    deps = dependencies(records, "pipelined")
    cp = makespan(records, deps, spec.concurrency)
    chain = longest_chain(records, deps)
    cp_no_wait = makespan(
        [replace(c, gap_s=exec_gaps.get(c.parent, 0.0)) for c in served_records], deps, spec.concurrency
    )
    policy_calls = [c for c in records if c.role == "policy"]
    policy_deps = dependencies(policy_calls, "pipelined")
    rollout_cp = makespan(policy_calls, policy_deps, spec.concurrency)
    start = base["_step_start"]
    last_policy_end = max(c.ended for c in policy_calls) + served.clock_offset_s

    tool_calls = [c for calls in probe.calls.values() for c in calls]
    per_call_table = [r.tool_time_s / r.tool_calls for r in rollouts if r.tool_calls]
    chains = defaultdict(float)  # rollout chain length by its first turn, following the tags
    by_tag = {c.tag: c for c in policy_calls if c.tag is not None}
    for c in policy_calls:
        root, length = c, c.service_s + c.gap_s
        while root.parent is not None and root.parent in by_tag:
            root = by_tag[root.parent]
        chains[id(root)] += length
    wall = base["step_wall_s"]
    return {
        "rollouts": len(rollouts),
        "failed_rollouts": sum(r.error is not None for r in rollouts),
        "turns_mean": statistics.mean(r.n_turns for r in rollouts),
        "turns_max": max(r.n_turns for r in rollouts),
        "tool_calls_mean": statistics.mean(r.tool_calls for r in rollouts),
        "tool_calls_total": sum(r.tool_calls for r in rollouts),
        "tool_errors_total": sum(r.tool_errors for r in rollouts),
        "rollouts_with_tools": sum(r.tool_calls > 0 for r in rollouts),
        "tool_time_total_s": sum(r.tool_time_s for r in rollouts),
        "tool_per_call_table_p50_ms": 1e3 * pct(per_call_table, 50),
        "tool_per_call_table_p99_ms": 1e3 * pct(per_call_table, 99),
        "tool_call_p50_ms": 1e3 * pct([c["s"] for c in tool_calls], 50),
        "tool_call_p99_ms": 1e3 * pct([c["s"] for c in tool_calls], 99),
        "tool_wait_p50_ms": 1e3 * pct([c["wait_s"] for c in tool_calls], 50),
        "tool_wait_p99_ms": 1e3 * pct([c["wait_s"] for c in tool_calls], 99),
        "tool_wait_total_s": sum(c["wait_s"] for c in tool_calls),
        "tool_exec_p50_ms": 1e3 * pct([c["exec_s"] for c in tool_calls], 50),
        "tool_exec_p99_ms": 1e3 * pct([c["exec_s"] for c in tool_calls], 99),
        "session_close_p50_ms": 1e3 * pct(probe.closes, 50),
        "session_close_p99_ms": 1e3 * pct(probe.closes, 99),
        "sessions": len(probe.closes),
        "interpreter_starts": len(probe.spawns),
        "interpreter_start_p50_ms": 1e3 * pct(probe.spawns, 50),
        "interpreter_start_p99_ms": 1e3 * pct(probe.spawns, 99),
        "unmatched_rollouts": unmatched,
        "policy_calls": int(policy["n"]),
        "max_turn": int(policy["max_turn"]),
        "llm_time_s": float(policy["latency"]),  # client-measured, sum over policy calls
        "llm_served_s": sum(c.service_s for c in policy_calls),  # drawn at the server
        "rollout_chain_p50_s": pct(list(chains.values()), 50),
        "rollout_chain_max_s": max(chains.values()),
        "cp_s": cp,
        "cp_chain_s": chain,
        "ratio": wall / cp,
        "cp_no_wait_s": cp_no_wait,
        "ratio_no_wait": wall / cp_no_wait,
        "rollout_phase_s": last_policy_end - start,
        "rollout_cp_s": rollout_cp,
        "rollout_ratio": (last_policy_end - start) / rollout_cp,
    }


def run(spec: RunSpec, server: LatencyServerProcess, workdir: Path, run_id: str) -> dict[str, Any]:
    probe = ToolProbe()
    starts: list[float] = []
    import flows.train as train_module

    original = train_module.Trainer.run_step

    async def mark(self_: Any, planned: Any, library: Any) -> Any:
        starts.append(time.monotonic())
        return await original(self_, planned, library)

    train_module.Trainer.run_step = mark  # inside the harness's own wrapper: the same start, within microseconds
    try:
        with probe.installed():
            figures = run_once(spec, server, workdir, run_id, critical_path=False)
    finally:
        train_module.Trainer.run_step = original
    figures["_step_start"] = starts[0]
    cfg = make_config(spec, server.base_url, workdir, run_id)
    figures.update(agent_figures(spec, server, cfg.db_path, run_id, probe, figures))
    del figures["_step_start"]
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=256, help="LLM concurrency (256 never binds for 40 x 5)")
    parser.add_argument(
        "--pool-size",
        type=int,
        default=16,
        help="sandbox interpreters alive at once (rollout.agent.sandbox.pool_size; default 16)",
    )
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the main cell (new latency draws each)")
    parser.add_argument(
        "--extra",
        nargs="*",
        default=["32:16", "256:200"],
        metavar="CONC:POOL",
        help="further cells, one run each: a binding cap, one interpreter per rollout",
    )
    parser.add_argument(
        "--p-base",
        type=float,
        default=0.8,
        help="scripted policy without the lesson: share of first turns that call the tool (and of "
        "direct answers that are right)",
    )
    parser.add_argument("--protocol", default="auto", choices=["auto", "tools", "text"])
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--median-s", type=float, default=LatencyModel.median_s, help="median time to first token")
    parser.add_argument("--sigma", type=float, default=LatencyModel.sigma)
    parser.add_argument("--tail-p", type=float, default=LatencyModel.tail_p)
    parser.add_argument("--tokens-per-s", type=float, default=LatencyModel.tokens_per_s)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = LatencyModel(median_s=args.median_s, sigma=args.sigma, tail_p=args.tail_p, tokens_per_s=args.tokens_per_s)
    options = {"p_base": args.p_base, "tag_tool_calls": True, "distinct_repeats": True}
    runs: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="clgrpo-bench-agent-"))
    began = time.monotonic()
    common = dict(
        group_size=args.group_size, mode="agent", max_turns=args.max_turns, protocol=args.protocol, spares=args.spares
    )
    with prefect_harness(), LatencyServerProcess(model, world_options=options) as server:
        run(RunSpec(n_problems=8, pool_size=args.pool_size, **common), server, workdir, "warmup")
        cells = [(args.concurrency, args.pool_size, r) for r in range(args.repeats)]
        cells += [(*map(int, cell.split(":")), 0) for cell in args.extra]
        for concurrency, pool, repeat in cells:
            spec = RunSpec(
                n_problems=args.problems, concurrency=concurrency, pool_size=pool, latency_seed=repeat, **common
            )
            figures = run(spec, server, workdir, f"agent-c{concurrency}-p{pool}-r{repeat}")
            figures.update(repeat=repeat, pool_size=pool)
            runs.append(figures)
            print(
                f"c={concurrency} pool={pool} run {repeat}: step {figures['step_wall_s']:.2f}s, critical path "
                f"{figures['cp_s']:.2f}s, ratio {figures['ratio']:.3f}; rollout phase "
                f"{figures['rollout_phase_s']:.2f}s vs {figures['rollout_cp_s']:.2f}s",
                flush=True,
            )
    print(report(runs, args, model, time.monotonic() - began))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": machine(), "latency_model": asdict(model), "args": vars(args), "runs": runs},
                indent=1,
                default=str,
            )
        )


def report(runs: list[dict], args: argparse.Namespace, model: LatencyModel, elapsed: float) -> str:
    cells: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in runs:
        cells[(r["concurrency"], r["pool_size"])].append(r)
    out = [
        f"\n{machine()}; {args.problems} problems x G={args.group_size}, agent mode ({args.protocol}), "
        f"main cell {args.repeats} runs, others 1, median [min-max]; p_base {args.p_base}; "
        f"latency model {asdict(model)}; "
        f"benchmark wall {elapsed:.0f}s"
    ]

    def col(group: list[dict], key: str, digits: int = 2) -> str:
        return fmt(spread([g[key] for g in group]), digits)

    rows = []
    for (conc, pool), g in cells.items():
        rows.append(
            [
                conc,
                pool,
                col(g, "step_wall_s"),
                col(g, "cp_s"),
                col(g, "ratio", 3),
                col(g, "cp_no_wait_s"),
                col(g, "ratio_no_wait", 3),
                col(g, "rollout_phase_s"),
                col(g, "rollout_cp_s"),
                col(g, "rollout_ratio", 3),
                col(g, "llm_time_s", 1),
                col(g, "llm_served_s", 1),
                f"{max(r['server_max_in_flight'] for r in g)} / "
                f"{spread([r['server_mean_in_flight'] for r in g])['median']:.1f}",
                col(g, "loop_busy_share"),
                f"{spread([r['loop_shares'].get('sandbox', 0.0) for r in g])['median']:.2f}",
                f"{max(r['peak_rss_mib'] for r in g):.0f}",
            ]
        )
    out.append(
        table(
            [
                "conc",
                "pool",
                "step wall s",
                "CP s",
                "wall / CP",
                "CP s, tools w/o wait",
                "wall / that CP",
                "rollout phase s",
                "rollout CP s",
                "phase / CP",
                "LLM time s (client)",
                "LLM time s (served)",
                "server max / mean in flight",
                "loop busy",
                "loop in sandbox",
                "peak RSS MiB",
            ],
            rows,
        )
    )
    rows = []
    for (conc, pool), g in cells.items():
        turns = f"{spread([r['turns_mean'] for r in g])['median']:.2f} / {max(r['turns_max'] for r in g)}"
        rows.append(
            [
                conc,
                pool,
                turns,
                col(g, "tool_calls_mean"),
                f"{spread([r['tool_errors_total'] for r in g])['median']:.0f}",
                col(g, "tool_time_total_s"),
                f"{spread([r['tool_per_call_table_p50_ms'] for r in g])['median']:.1f} / "
                f"{spread([r['tool_per_call_table_p99_ms'] for r in g])['median']:.1f}",
                f"{spread([r['tool_call_p50_ms'] for r in g])['median']:.1f} / "
                f"{spread([r['tool_call_p99_ms'] for r in g])['median']:.1f}",
                f"{spread([r['tool_wait_p50_ms'] for r in g])['median']:.1f} / "
                f"{spread([r['tool_wait_p99_ms'] for r in g])['median']:.1f}",
                f"{spread([r['tool_exec_p50_ms'] for r in g])['median']:.2f} / "
                f"{spread([r['tool_exec_p99_ms'] for r in g])['median']:.2f}",
                f"{spread([r['interpreter_start_p50_ms'] for r in g])['median']:.0f} / "
                f"{spread([r['interpreter_start_p99_ms'] for r in g])['median']:.0f}",
                f"{spread([r['session_close_p50_ms'] for r in g])['median']:.1f} / "
                f"{spread([r['session_close_p99_ms'] for r in g])['median']:.1f}",
            ]
        )
    out.append("\nPer rollout and per tool call (medians over runs; p50 / p99 within a run)")
    out.append(
        table(
            [
                "conc",
                "pool",
                "turns mean / max",
                "tool calls / rollout",
                "tool errors",
                "tool time total s",
                "tool per call ms (table)",
                "run() ms",
                "wait ms",
                "exec ms",
                "interp start ms",
                "session close ms",
            ],
            rows,
        )
    )
    last = runs[-1]
    out.append(
        f"\nper run: {last['rollouts']} rollouts ({last['rollouts_with_tools']} with tool calls, "
        f"{last['failed_rollouts']} failed), {last['policy_calls']} policy calls, "
        f"{last['sessions']} sandbox sessions, {last['interpreter_starts']} interpreter starts; "
        f"rollout chain p50 {last['rollout_chain_p50_s']:.2f}s max {last['rollout_chain_max_s']:.2f}s; "
        f"rollouts whose tool calls did not match their tags: {max(r['unmatched_rollouts'] for r in runs)}"
    )
    loads = [x for r in runs for x in r["load_avg_1m"]]
    out.append(f"1-minute load average at run starts/ends: {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
