"""A problem's samples in one request (``n`` = G) against one request per sample, on the demo's engine.

llama-server answers a request with ``n`` choices from ``n`` slots that start together from one prompt; sent as
G separate requests, the samples take slots one by one as they free up, and each slot finds the prompt's shared
prefix in its cache or evaluates it. Which keeps the engine busier is measured here on the demo's own requests:
its rollouts (10 training problems x G=4, the prompt the rollout stage builds) and its held-out evaluation (20
problems x k=2), the bodies the project's client sends (``OpenAIBackend.body``), 8 requests in flight, 8 slots,
every sample generating exactly ``--tokens`` tokens (llama-server's ``ignore_eos``), so both modes do the same
work and only the engine's schedule differs. Each run gets a freshly started server (no run finds another's
prompts cached); the modes alternate. Reported per mode and workload: wall time, tokens/s, and the server's busy
slots (its /slots endpoint, polled every 0.25 s).

    python benchmarks/shared_prompts.py [--reps 2] [--tokens 120] [--report]    # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported

from report_block import write_block  # noqa: E402

from application.demo import POLICY_SLOTS, DemoOptions  # noqa: E402
from application.llama_server import LlamaServer, cpu_model_name, ensure_engine  # noqa: E402
from clgrpo.llm.backends import CHAT_PATH, GenRequest, OpenAIBackend  # noqa: E402
from clgrpo.llm.transport import make_transport  # noqa: E402
from clgrpo.models.weights import QWEN_05B, fetch_model  # noqa: E402
from domains.math import MathDomain  # noqa: E402
from domains.math.synthetic import generate_family  # noqa: E402
from schemas.config import ModelConfig  # noqa: E402
from schemas.records import Problem  # noqa: E402

RUNS = ROOT / "benchmarks" / "shared_prompts_runs"
BEGIN, END = "<!-- shared-prompts:begin -->", "<!-- shared-prompts:end -->"  # the summary, in benchmarks/REPORT.md
# every run, beside the runs' JSON files
RUNS_REPORT = RUNS / "REPORT.md"
RUNS_BEGIN, RUNS_END = "<!-- shared-prompts-runs:begin -->", "<!-- shared-prompts-runs:end -->"


def workloads(opts: DemoOptions) -> list[tuple[str, list[Problem], int]]:
    """The demo's rollouts and its no-library evaluation: (name, problems, samples per problem)."""
    train = generate_family(opts.family, opts.problems, opts.seed, ids=f"{opts.family}-train{opts.seed}")
    heldout = generate_family(
        opts.family, opts.heldout, opts.seed + 1000, exclude={r["problem"] for r in train}, ids="heldout"
    )
    as_problems = [Problem(problem_id=r["id"], problem=r["problem"], answer=str(r["answer"])) for r in train]
    held = [Problem(problem_id=r["id"], problem=r["problem"], answer=str(r["answer"])) for r in heldout]
    return [("rollout", as_problems, opts.group_size), ("evaluation", held, opts.k)]


async def send(url: str, together: bool, problems: list[Problem], n: int, seed: int, tokens: int) -> dict[str, Any]:
    """The requests as the project's client builds them (``OpenAIBackend.body``), each sample generating exactly
    ``tokens`` tokens (llama-server's ``ignore_eos``), so both modes do the same work: one request per problem
    with ``n`` (seed s: sample i is s + i) or one per sample (seed s + i), ``POLICY_SLOTS`` in flight."""
    cfg = ModelConfig(backend="openai", model=QWEN_05B.fetch_key, base_url=url, api_key_env=None, timeout_s=1800)
    backend, domain = OpenAIBackend(cfg), MathDomain()
    bodies = []
    for i, p in enumerate(problems):
        messages, first = domain.rollout_messages(p, ""), seed + 100 * i
        asks = (
            [GenRequest(messages, n, max_tokens=tokens, seed=first)]
            if together
            else [GenRequest(messages, 1, max_tokens=tokens, seed=first + j) for j in range(n)]
        )
        bodies += [{**backend.body(a), "ignore_eos": True} for a in asks]
    transport, gate = make_transport(backend.base_url, "not-needed", 1800), asyncio.Semaphore(POLICY_SLOTS)

    async def post(body: dict[str, Any]) -> int:
        async with gate:
            status, _, data = await transport.post(CHAT_PATH, body)
        reply = json.loads(data)
        if status != 200 or len(reply["choices"]) != body["n"]:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        return body["n"] * tokens

    started, busy = time.monotonic(), []
    poller = asyncio.create_task(poll_busy_slots(url, busy))
    generated = await asyncio.gather(*[post(b) for b in bodies])
    wall = time.monotonic() - started
    if poller.done():
        poller.result()  # the poller failed (no /slots?): say so rather than report a partial figure
    poller.cancel()
    await transport.aclose()
    return {
        "wall_s": wall,
        "requests": len(bodies),
        "generated": sum(generated),
        "tokens_per_s": sum(generated) / wall,
        "busy_slots_mean": statistics.mean(busy) if busy else None,
    }


async def poll_busy_slots(url: str, busy: list[int]) -> None:
    """How many of the server's slots are processing, every 0.25 s (llama-server's GET /slots)."""
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url.removesuffix("/v1") + "/slots") as response:
                busy.append(sum(1 for slot in await response.json() if slot.get("is_processing")))
            await asyncio.sleep(0.25)


def one_run(engine: Any, gguf: Path, together: bool, opts: DemoOptions, log_dir: Path, tokens: int) -> dict[str, Any]:
    log = log_dir / f"server-{'n' if together else 'single'}-{time.monotonic_ns()}.log"
    with LlamaServer(gguf, QWEN_05B.fetch_key, slots=POLICY_SLOTS, engine=engine, log_path=log) as server:
        figures = {
            name: asyncio.run(send(server.base_url, together, problems, n, opts.seed, tokens))
            for name, problems, n in workloads(opts)
        }
    return {"together": together, "tokens_per_sample": tokens, "stages": figures}


def mode(run: dict[str, Any]) -> str:
    return "n per request" if run["together"] else "one per sample"


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode and workload, the mean over runs of wall time, tokens/s and busy slots."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for name, figures in run["stages"].items():
            groups.setdefault(f"{mode(run)} / {name}", []).append(figures)
    return {
        key: {
            "runs": len(mine),
            "wall_s": statistics.mean(m["wall_s"] for m in mine),
            "tokens_per_s": statistics.mean(m["tokens_per_s"] for m in mine),
            "busy_slots_mean": statistics.mean(m["busy_slots_mean"] or 0.0 for m in mine),
        }
        for key, mine in groups.items()
    }


# two-sided 95% quantiles of Student's t by degrees of freedom (beyond the table: the normal's 1.96)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload, n-per-request minus one-per-sample wall time over the pairs of runs (runs 2r and 2r+1 of
    one invocation, which alternate the order): each difference, their mean and its 95% t-interval."""
    out = {}
    for name in runs[0]["stages"]:
        diffs = []
        for first, second in zip(runs[::2], runs[1::2]):
            together, single = (first, second) if first["together"] else (second, first)
            diffs.append(together["stages"][name]["wall_s"] - single["stages"][name]["wall_s"])
        mean = statistics.mean(diffs)
        half = T_975.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
        out[name] = {
            "differences_s": diffs,
            "mean_s": mean,
            "ci95_s": None if half is None else [mean - half, mean + half],
        }
    return out


def setup_line(runs: list[dict[str, Any]], cpu: str) -> str:
    return (
        f"`python benchmarks/shared_prompts.py --report` on {cpu}: the demo's rollouts (10 problems x G=4) "
        f"and evaluation (20 x k=2), {runs[0]['tokens_per_sample']} tokens generated per sample, a fresh "
        f"llama-server per run ({POLICY_SLOTS} slots, Qwen2.5-Coder-0.5B, 8 requests in flight)"
    )


def report_block(runs: list[dict[str, Any]], cpu: str, sources: list[str]) -> str:
    """benchmarks/REPORT.md's block: the means of the runs and the paired differences (every run: runs_block)."""
    lines = [
        BEGIN,
        setup_line(runs, cpu) + "; means over the runs:",
        "",
        "| mode / workload (mean of runs) | runs | wall s | generated tokens/s | busy slots |",
        "|---|---|---|---|---|",
        *[
            f"| {key} | {m['runs']:.0f} | {m['wall_s']:.1f} | {m['tokens_per_s']:.1f} | {m['busy_slots_mean']:.1f} |"
            for key, m in sorted(summary(runs).items())
        ],
        "",
        "| workload | n per request minus one per sample, each pair (s) | mean s | 95% CI s |",
        "|---|---|---|---|",
        *[
            f"| {name} | {', '.join(f'{d:+.1f}' for d in p['differences_s'])} | {p['mean_s']:+.1f} | "
            + ("-" if p["ci95_s"] is None else f"[{p['ci95_s'][0]:+.1f}, {p['ci95_s'][1]:+.1f}]")
            + " |"
            for name, p in paired(runs).items()
        ],
        "",
        "Raw figures (benchmarks/shared_prompts_runs/): " + ", ".join(sources) + "; every run in order: "
        "[shared_prompts_runs/REPORT.md](shared_prompts_runs/REPORT.md).",
        END,
    ]
    return "\n".join(lines)


def runs_block(runs: list[dict[str, Any]], cpu: str, sources: list[str]) -> str:
    """The companion file's block (shared_prompts_runs/REPORT.md): every run, in the order run."""
    rows = [
        f"| {mode(r)} | {name} | {s['requests']} | {s['wall_s']:.1f} | {s['tokens_per_s']:.1f} | "
        f"{s['busy_slots_mean']:.1f} |"
        for r in runs
        for name, s in r["stages"].items()
    ]
    lines = [
        RUNS_BEGIN,
        setup_line(runs, cpu) + "; runs in order (raw figures: " + ", ".join(sources) + "):",
        "",
        "| mode | workload | requests | wall s | generated tokens/s | busy slots (mean of 8) |",
        "|---|---|---|---|---|---|",
        *rows,
        RUNS_END,
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="runs per mode, alternating (default 2)")
    ap.add_argument("--tokens", type=int, default=120, help="tokens each sample generates (default 120)")
    ap.add_argument(
        "--report", action="store_true", help="write the figures into benchmarks/REPORT.md and shared_prompts_runs/"
    )
    ap.add_argument("--cache-dir", default=None, help="models and engine cache (default ~/.cache/clgrpo)")
    ap.add_argument("--from-json", nargs="+", metavar="FILE", help="report stored runs (shared_prompts_runs/*.json)")
    args = ap.parse_args()
    if args.from_json:  # the report of stored runs, in the order given
        stored = [json.loads(Path(f).read_text()) for f in args.from_json]
        runs, cpu, sources = (
            [r for f in stored for r in f["runs"]],
            stored[0]["cpu"],
            [Path(f).name for f in args.from_json],
        )
    else:
        runs, cpu = measure(args), (cpu_model_name() or "this CPU")
        sources = [time.strftime("%Y-%m-%d-%H%M") + ".json"]
        RUNS.mkdir(exist_ok=True)
        (RUNS / sources[0]).write_text(json.dumps({"cpu": cpu, "runs": runs, "summary": summary(runs)}, indent=1))
    print(json.dumps(summary(runs), indent=1))
    if args.report:
        heading = "Shared prompts: a problem's samples in one request"
        write_block(report_block(runs, cpu, sources), BEGIN, END, heading)
        heading = "Shared prompts: every run"
        write_block(runs_block(runs, cpu, sources), RUNS_BEGIN, RUNS_END, heading, RUNS_REPORT)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--reps`` runs of each mode, alternating which goes first."""
    opts = DemoOptions()
    engine = ensure_engine(args.cache_dir)
    gguf = fetch_model(QWEN_05B, args.cache_dir, convert=False).gguf
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for rep in range(args.reps):
            for together in (False, True) if rep % 2 == 0 else (True, False):
                runs.append(one_run(engine, gguf, together, opts, Path(logs), args.tokens))
                print(json.dumps(runs[-1]), flush=True)
    return runs


if __name__ == "__main__":
    main()
