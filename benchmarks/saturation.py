"""Is the engine kept busy? The demo's configuration on the real local engine (llama-server: the 0.5B policy with
8 slots and the 1.5B learner with 4, on this machine's cores), measured against that engine's own ceiling.

A recording proxy sits in front of each llama-server, so every request the run sends is kept (body, start, end,
prompt and generated tokens). After the run, the requests of each stage (and of the evaluation) are sent again
to the same server, restarted so that no prompt of the run is cached, as one saturating batch (all at once,
twice as many in flight as slots), one server at a time: that replay's wall time is what the engine needs for
the same work when nothing waits on anything. Reported:

- per phase (training, held-out evaluation): wall time, the engine's achieved tokens/s (prompt and generated,
  from the requests) and the saturation figure = replay time / phase wall time (1.0: the run went as fast as
  the engine allows; the two servers share the cores, so their replay times add up);
- the same per training stage (a stage's requests are those sent between its first LLM call, from llm_calls,
  and the next stage's; its window ends with its last reply), the time in each with no request in flight on
  either server, and the training time outside every stage's window (verification, DuckDB, Prefect).

    python benchmarks/saturation.py                       # ~25 minutes on 2 cores (models and engine cached)
    python benchmarks/saturation.py --report              # the same, figures into benchmarks/REPORT.md
    python benchmarks/saturation.py --no-eval             # the training step only (~18 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported
from harness import union_length  # noqa: E402  # first: an isolated, quiet Prefect without telemetry
from report_block import write_block  # noqa: E402

from application.demo import (  # noqa: E402
    DemoOptions,
    _start_llama_servers,
    demo_config,
    eval_settings,
    say,
    write_datasets,
)
from clgrpo.process import stopping  # noqa: E402
from clgrpo.storage.store import Store  # noqa: E402
from schemas.config import DatasetConfig  # noqa: E402

REPORT_BEGIN, REPORT_END = "<!-- saturation:begin -->", "<!-- saturation:end -->"


# --- the recording proxy ---------------------------------------------------------------------------------
@dataclass
class Sent:
    role: str
    path: str
    body: bytes
    start: float
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0


@dataclass
class RecordingProxy:
    """Forwards every request to ``upstream`` and keeps it (a thread with its own event loop)."""

    role: str
    upstream: str
    sent: list[Sent] = field(default_factory=list)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> str:
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True, name=f"proxy-{self.role}").start()
        ready.wait(30)
        return self.url

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._start(ready))
        self._loop.run_forever()

    async def _start(self, ready: threading.Event) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"
        ready.set()

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        record = Sent(self.role, request.path, body, time.time())
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        base = self.upstream.removesuffix("/v1")
        async with self._session.request(request.method, base + request.path_qs, data=body, headers=headers) as up:
            payload = await up.read()
            record.end, record.status = time.time(), up.status
        if request.path.endswith("/chat/completions"):
            usage = (json.loads(payload or b"{}") or {}).get("usage") or {}
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.sent.append(record)
        return web.Response(body=payload, status=up.status, content_type=up.content_type)


# --- the replay: the same requests as one saturating batch ----------------------------------------------
async def replay(upstream: str, sent: list[Sent], in_flight: int) -> dict[str, float]:
    """Send ``sent`` again to ``upstream``, ``in_flight`` at a time; wall time and tokens."""
    gate = asyncio.Semaphore(in_flight)
    tokens = {"prompt": 0, "completion": 0}
    base = upstream.removesuffix("/v1")

    async def one(session: aiohttp.ClientSession, item: Sent) -> None:
        async with (
            gate,
            session.post(base + item.path, data=item.body, headers={"content-type": "application/json"}) as r,
        ):
            usage = (await r.json()).get("usage") or {}
            tokens["prompt"] += int(usage.get("prompt_tokens") or 0)
            tokens["completion"] += int(usage.get("completion_tokens") or 0)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(one(session, item) for item in sent))
    return {"seconds": time.monotonic() - t0, **tokens, "requests": len(sent)}


# --- figures ---------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the Prefect server the flows started, the llama-servers)."""
    kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()]
    return kids + [d for k in kids for d in descendants(k)]


def flows_cpu_seconds(engine_pids: set[int]) -> float:
    """This process and its descendants but the engine's servers: the flows, their Prefect server, the proxy."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    others = [p for p in descendants(os.getpid()) if p not in engine_pids]
    return me.ru_utime + me.ru_stime + sum(cpu_seconds(p) for p in others if Path(f"/proc/{p}").exists())


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent outside idle and iowait so far (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def stage_starts(db: str, run_id: str) -> list[tuple[str, float]]:
    """(stage, when its first LLM call was made) in order. ``started_at`` is when a call was made, before it
    waited for its turn, so a stage's requests are those sent between its start and the next stage's."""
    with Store(db, read_only=True) as store:
        rows = store.con.execute(
            "SELECT stage, min(epoch(started_at)) FROM llm_calls WHERE run_id = ? GROUP BY stage ORDER BY 2", [run_id]
        ).fetchall()
    return [(r[0], float(r[1])) for r in rows]


def by_stage(sent: list[Sent], starts: list[tuple[str, float]], hi: float) -> dict[str, list[Sent]]:
    out: dict[str, list[Sent]] = {stage: [] for stage, _ in starts}
    for item in sent:
        if item.start <= hi:
            stage = next((st for st, t in reversed(starts) if t <= item.start + 0.01), None)
            if stage is not None:
                out[stage].append(item)
    return out


def work_figures(name: str, lo: float, hi: float, mine: list[Sent], replays: dict[str, dict]) -> dict[str, Any]:
    """A stretch of the run (a stage or a phase) against the replay of its requests."""
    wall = hi - lo
    ideal = sum(r["seconds"] for r in replays.values())
    roles = {}
    for role, r in replays.items():
        run = [s for s in mine if s.role == role]
        tokens = sum(s.prompt_tokens + s.completion_tokens for s in run)
        roles[role] = {
            "requests": len(run),
            "prompt_tokens": sum(s.prompt_tokens for s in run),
            "completion_tokens": sum(s.completion_tokens for s in run),
            "run_tokens_per_s": round(tokens / wall, 1),
            "replay_s": round(r["seconds"], 1),
            "replay_tokens_per_s": round((r["prompt"] + r["completion"]) / r["seconds"], 1),
        }
    return {
        "name": name,
        "wall_s": round(wall, 1),
        "idle_s": round(wall - union_length([(s.start, s.end) for s in mine], lo, hi), 1),
        "replay_s": round(ideal, 1),
        "saturation": round(ideal / wall, 2) if wall > 0 else None,
        "roles": roles,
    }


# --- the run ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from flows.evaluate import evaluate
    from flows.train import train

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    opts = DemoOptions(out=out, run_id="saturation", cache_dir=args.cache_dir)
    datasets = write_datasets(opts)
    seconds: dict[str, float] = {}
    servers = _start_llama_servers(opts, say, seconds)
    try:
        proxies = [RecordingProxy(role, s.base_url) for role, s in zip(("policy", "learner"), servers)]
        urls = [p.start() for p in proxies]
        config = demo_config(opts, datasets, "saturation", "llama-server", urls[0], urls[-1])
        if args.concurrency:
            config = config.model_copy(update={"concurrency": args.concurrency})
        phases: list[tuple[str, float, float]] = []
        engine_pids = {s.process.pid for s in servers if s.process}
        cpu0 = [cpu_seconds(p) for p in engine_pids], flows_cpu_seconds(engine_pids), time.monotonic()
        machine0 = machine_busy_seconds()
        t0 = time.time()
        stopping.run_command(train(config))
        phases.append(("training", t0, time.time()))
        if not args.no_eval:
            t0 = time.time()
            stopping.run_command(
                evaluate(
                    config,
                    eval_settings(opts, datasets),
                    ["none", "saturation:latest"],
                    eval_id="saturation-heldout",
                    train_dataset=DatasetConfig(path=datasets["train"]),
                )
            )
            phases.append(("evaluation", t0, time.time()))
        engine_cpu = sum(cpu_seconds(p) for p in engine_pids) - sum(cpu0[0])
        flows_cpu, elapsed = flows_cpu_seconds(engine_pids) - cpu0[1], time.monotonic() - cpu0[2]
        machine = machine_busy_seconds() - machine0
        sent = [s for p in proxies for s in p.sent]
        figures: dict[str, Any] = {
            "phases": [],
            "stages": [],
            "slots": {p.role: server.slots for p, server in zip(proxies, servers)},
            "cpu": {  # over the phases, before the replays
                "cores": len(os.sched_getaffinity(0)),
                "elapsed_s": round(elapsed, 1),
                "engine_cpu_s": round(engine_cpu, 1),
                "flows_cpu_s": round(flows_cpu, 1),
                "machine_busy_s": round(machine, 1),
                "busy_share": round(machine / (elapsed * len(os.sched_getaffinity(0))), 3),
            },
        }
        servers_by_role = {p.role: server for p, server in zip(proxies, servers)}

        def replay_all(label: str, items: list[Sent]) -> dict[str, dict]:
            """Each role's requests on a freshly started server (no prompt cached from the run)."""
            replays = {}
            for role, server in servers_by_role.items():
                mine = [s for s in items if s.role == role]
                if mine:
                    server.stop()
                    server.start()
                    say(f"  replaying {len(mine)} {role} requests of {label} ({server.slots * 2} in flight)")
                    replays[role] = asyncio.run(replay(server.base_url, mine, server.slots * 2))
            return replays

        _, t_lo, t_hi = phases[0]
        starts = stage_starts(config.db_path, "saturation")
        staged = by_stage([s for s in sent if t_lo <= s.start <= t_hi], starts, t_hi)
        for stage, start in starts:
            items = staged[stage]
            end = max((s.end for s in items), default=start)
            figures["stages"].append(work_figures(stage, start, end, items, replay_all(stage, items)))
        windows = [(st["name"], t) for st, (_, t) in zip(figures["stages"], starts)]
        stage_spans = [(t, t + st["wall_s"]) for st, (_, t) in zip(figures["stages"], windows)]
        training = work_figures("training", t_lo, t_hi, [s for s in sent if t_lo <= s.start <= t_hi], {})
        training["replay_s"] = round(sum(st["replay_s"] for st in figures["stages"]), 1)
        training["saturation"] = round(training["replay_s"] / training["wall_s"], 2)
        training["outside_stages_s"] = round(training["wall_s"] - union_length(stage_spans, t_lo, t_hi), 1)
        figures["phases"].append(training)
        for name, lo, hi in phases[1:]:
            mine = [s for s in sent if lo <= s.start <= hi]
            figures["phases"].append(work_figures(name, lo, hi, mine, replay_all(f"the {name} phase", mine)))
        figures["requests"] = [
            {"role": s.role, "start": round(s.start - t_lo, 3), "end": round(s.end - t_lo, 3),
             "prompt": s.prompt_tokens, "completion": s.completion_tokens}
            for s in sent
        ]  # fmt: skip
        return figures
    finally:
        for server in servers:
            server.stop()


def report_text(figures: dict[str, Any]) -> str:
    def row(w: dict[str, Any]) -> str:
        cells = []
        for role in ("policy", "learner"):
            r = w["roles"].get(role)
            cells.append(f"{r['run_tokens_per_s']} / {r['replay_tokens_per_s']}" if r else "-")
        return (
            f"| {w['name']} | {w['wall_s']} | {w['idle_s']} | {w['replay_s']} | {w['saturation']} "
            f"| {cells[0]} | {cells[1]} |"
        )

    head = "| {} | wall s | idle s | ceiling s | saturation | policy tokens/s, run / replay | learner, run / replay |"
    rule = "| --- | --- | --- | --- | --- | --- | --- |"
    lines = [
        REPORT_BEGIN,
        "Idle s: no request in flight on either server; ceiling s: the replay of the same requests on a fresh server, "
        "all at once (its time is what the engine needs for the work); saturation = ceiling / wall.",
        "",
        head.format("training stage"),
        rule,
    ]
    lines += [row(st) for st in figures["stages"]]
    training = figures["phases"][0]
    lines += [
        f"| outside every stage (verify, DuckDB, Prefect) | {training['outside_stages_s']} | | | | | |",
        "",
        head.format("phase"),
        rule,
    ]
    lines += [row(p) for p in figures["phases"]]
    cpu = figures["cpu"]
    lines += [
        "",
        f"CPU over the phases ({cpu['elapsed_s']} s on {cpu['cores']} cores): llama-server {cpu['engine_cpu_s']} s, "
        f"the flows and their Prefect server {cpu['flows_cpu_s']} s; the whole machine {cpu['machine_busy_s']} s: "
        f"its cores were {cpu['busy_share']:.0%} busy.",
        REPORT_END,
    ]
    return "\n".join(lines)


def write_report(figures: dict[str, Any]) -> None:
    heading = "Saturation: the demo's engine against its own ceiling"
    write_block(report_text(figures), REPORT_BEGIN, REPORT_END, heading)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-saturation")
    ap.add_argument("--cache-dir")
    ap.add_argument("--concurrency", type=int, help="requests in flight (default: the demo's)")
    ap.add_argument("--no-eval", action="store_true", help="the training step only")
    ap.add_argument("--report", action="store_true", help="write the figures into benchmarks/REPORT.md")
    ap.add_argument("--from-json", help="report the figures of an earlier run (its saturation.json)")
    args = ap.parse_args()
    if args.from_json:
        figures = json.loads(Path(args.from_json).read_text())
    else:
        figures = run(args)
        Path(args.out, "saturation.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "requests"}, indent=1))
    print(report_text(figures))
    if args.report:
        write_report(figures)


if __name__ == "__main__":
    main()
