"""A problem's samples in one request (``n`` = G) against one request per sample, on the demo's engine.

llama-server evaluates the prompt of a request with ``n`` choices once and copies it to the other slots; sent as
G separate requests at once, the same prompt is evaluated in G slots (its prompt cache only helps a slot that
already holds the prefix). On 2 cores a prompt token costs about what a generated one does, so this is engine
time. Measured here on the demo's own requests: its rollouts (10 training problems x G=4, the prompt the rollout
stage builds) and its held-out evaluation without a library (20 problems x k=2), through the project's LLM client
with ``supports_n`` off and on, the same seeds (sample i: seed + i either way), 8 requests in flight, 8 slots.
Each run gets a freshly started server, so no run finds another's prompts cached; the two modes alternate.
Reported per mode: wall time, prompt tokens the server evaluated (its log) and tokens generated.

    python benchmarks/shared_prompts.py [--reps 2] [--report]     # ~10 min on 2 cores, models cached
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported

from report_block import write_block  # noqa: E402

from clgrpo.app.demo import POLICY_SLOTS, DemoOptions  # noqa: E402
from clgrpo.app.llama_server import LlamaServer, ensure_engine  # noqa: E402
from clgrpo.llm import LLMClient  # noqa: E402
from clgrpo.models import QWEN_05B, fetch_model  # noqa: E402
from domains.math import MathDomain  # noqa: E402
from domains.math.synthetic import generate_family  # noqa: E402
from schemas.config import ModelConfig  # noqa: E402
from schemas.records import Problem  # noqa: E402

RUNS = ROOT / "benchmarks" / "shared_prompts_runs"
BEGIN, END = "<!-- shared-prompts:begin -->", "<!-- shared-prompts:end -->"
PROMPT_EVAL = re.compile(r"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens")


def workloads(opts: DemoOptions) -> list[tuple[str, list[Problem], int]]:
    """The demo's rollouts and its no-library evaluation: (name, problems, samples per problem)."""
    train = generate_family(opts.family, opts.problems, opts.seed, ids=f"{opts.family}-train{opts.seed}")
    heldout = generate_family(
        opts.family, opts.heldout, opts.seed + 1000, exclude={r["problem"] for r in train}, ids="heldout"
    )
    as_problems = [Problem(problem_id=r["id"], problem=r["problem"], answer=str(r["answer"])) for r in train]
    held = [Problem(problem_id=r["id"], problem=r["problem"], answer=str(r["answer"])) for r in heldout]
    return [("rollout", as_problems, opts.group_size), ("evaluation", held, opts.k)]


async def send(url: str, together: bool, problems: list[Problem], n: int, seed: int) -> dict[str, float]:
    cfg = ModelConfig(
        backend="openai",
        model=QWEN_05B.fetch_key,
        base_url=url,
        api_key_env=None,
        temperature=0.7,
        max_tokens=DemoOptions.rollout_tokens,
        timeout_s=1800,
        supports_n=together,
    )
    client, domain = LLMClient(cfg, concurrency=POLICY_SLOTS), MathDomain()
    started = time.monotonic()
    done = await asyncio.gather(
        *[
            client.sample(domain.rollout_messages(p, ""), n, stage="rollout", seed=seed + 100 * i)
            for i, p in enumerate(problems)
        ]
    )
    wall = time.monotonic() - started
    await client.aclose()
    calls = [c for s in done for c in s.calls]
    failed = sum(len(s.failed) for s in done)
    return {"wall_s": wall, "requests": len(calls), "generated": sum(c.tokens_out for c in calls), "failed": failed}


def one_run(engine: Any, gguf: Path, together: bool, opts: DemoOptions, log_dir: Path) -> dict[str, Any]:
    log = log_dir / f"server-{'n' if together else 'single'}-{time.monotonic_ns()}.log"
    with LlamaServer(gguf, QWEN_05B.fetch_key, slots=POLICY_SLOTS, engine=engine, log_path=log) as server:
        figures = {
            name: asyncio.run(send(server.base_url, together, problems, n, opts.seed))
            for name, problems, n in workloads(opts)
        }
    evaluated = [int(m[1]) for m in PROMPT_EVAL.finditer(log.read_text())]
    return {"together": together, "stages": figures, "prompt_tokens_evaluated": sum(evaluated)}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for together in (False, True):
        mine = [r for r in runs if r["together"] is together]
        out["n=G" if together else "single"] = {
            "wall_s": statistics.mean(sum(s["wall_s"] for s in r["stages"].values()) for r in mine),
            "prompt_tokens_evaluated": statistics.mean(r["prompt_tokens_evaluated"] for r in mine),
            "generated": statistics.mean(sum(s["generated"] for s in r["stages"].values()) for r in mine),
            "requests": statistics.mean(sum(s["requests"] for s in r["stages"].values()) for r in mine),
            "runs": len(mine),
        }
    return out


def report_block(runs: list[dict[str, Any]], cpu: str, when: str) -> str:
    rows = []
    for r in runs:
        for name, s in r["stages"].items():
            rows.append(
                f"| {'n=G' if r['together'] else 'single'} | {name} | {s['requests']} | {s['wall_s']:.1f} | "
                f"{s['generated']} | {s['failed']} |"
            )
    means = summary(runs)
    lines = [
        BEGIN,
        f"`python benchmarks/shared_prompts.py --report` on {cpu}, {when}: the demo's rollouts (10 problems x G=4) "
        f"and no-library evaluation (20 x k=2) on a fresh llama-server each run ({POLICY_SLOTS} slots, "
        "Qwen2.5-Coder-0.5B, 8 requests in flight), one request per sample against one per problem with `n`.",
        "",
        "| mode | workload | requests | wall s | tokens generated | failed |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "| mode (mean of runs) | wall s | prompt tokens evaluated by the server | tokens generated |",
        "|---|---|---|---|",
        *[
            f"| {mode} | {m['wall_s']:.1f} | {m['prompt_tokens_evaluated']:.0f} | {m['generated']:.0f} |"
            for mode, m in means.items()
        ],
        "",
        f"Raw figures: benchmarks/shared_prompts_runs/{when}.json.",
        END,
    ]
    return "\n".join(lines)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "this CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="runs per mode, alternating (default 2)")
    ap.add_argument("--report", action="store_true", help="write the figures into benchmarks/REPORT.md")
    ap.add_argument("--cache-dir", default=None, help="models and engine cache (default ~/.cache/clgrpo)")
    args = ap.parse_args()
    opts = DemoOptions()
    engine = ensure_engine(args.cache_dir)
    gguf = fetch_model(QWEN_05B, args.cache_dir, convert=False).gguf
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for rep in range(args.reps):
            for together in (False, True) if rep % 2 == 0 else (True, False):
                runs.append(one_run(engine, gguf, together, opts, Path(logs)))
                print(json.dumps(runs[-1]), flush=True)
    when = time.strftime("%Y-%m-%d-%H%M")
    RUNS.mkdir(exist_ok=True)
    (RUNS / f"{when}.json").write_text(
        json.dumps({"cpu": cpu_name(), "runs": runs, "summary": summary(runs)}, indent=1)
    )
    print(json.dumps(summary(runs), indent=1))
    if args.report:
        write_block(
            report_block(runs, cpu_name(), when), BEGIN, END, "Shared prompts: a problem's samples in one request"
        )


if __name__ == "__main__":
    main()
