"""Hybrid learning on CPU: a few training steps of the embedded SmolLM2-135M-Instruct with the numeric step on,
then held-out accuracy of none / library / adapter / both.

Everything goes through the CLI as a user runs it (``clgrpo train``, ``clgrpo eval``) on seeded synthetic
problems (``domains/math/synthetic.py``; training and held-out sets share no text). Reported:

- per step, from the ``adapters`` table: completions used, GRPO loss before / after, and the mean change of the
  mean token log-prob of the positive- and negative-advantage completions it trained on (the direction check);
- memory and time of the numeric step per 100 completions, measured here in a fresh load (peak RSS over the
  RSS before the model loaded) on step 1's stored inputs;
- held-out Mean@k of the four conditions with 95% bootstrap CIs, and each minus ``none`` with paired CIs.
  No gain is demanded: a 135M model, a dozen problems and a few steps.

    python benchmarks/hybrid.py --report          # ~15-30 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported

from report_block import write_block  # noqa: E402

from clgrpo.storage.store import Store  # noqa: E402
from domains.math.synthetic import split_sets, write_rows  # noqa: E402
from schemas.config import RunConfig  # noqa: E402

REPORT_BEGIN, REPORT_END = "<!-- hybrid:begin -->", "<!-- hybrid:end -->"
RUN_ID = "hybrid-bench"
EVAL_ID = "hybrid-bench-eval"


def run_config(out: Path, train: Path, args: argparse.Namespace) -> dict:
    model = {
        "backend": "transformers",
        "model": "SmolLM2-135M-Instruct",
        "model_path": "embedded",
        "device": "auto",
        "api_key_env": None,
        "timeout_s": 1800,
        "max_retries": 1,
        "max_batch_rows": 32,
    }
    return {
        "run_id": RUN_ID,
        "db_path": str(out / "hybrid.duckdb"),
        "domain": "math",
        "dataset": {"path": str(train)},
        "policy": {**model, "temperature": 0.7, "max_tokens": args.max_tokens},
        "learner": {**model, "temperature": 0.3, "max_tokens": 200, "json_schema": True},
        "grpo": {
            "group_size": args.group_size,
            "epochs": 1,
            "batch_size": args.batch_size,
            "rollout_chunk_size": args.batch_size,
        },
        "learning": {"max_words": 24, "max_ops_per_group": 2, "summarize": False},
        "hybrid": {"enabled": True, "rank": 8, "alpha": 16, "lr": args.lr, "epochs": 2, "batch_rows": 8},
        "concurrency": 64,
        "pipeline": False,
    }


def clgrpo(*argv: str) -> float:
    """Run the CLI; its wall time in seconds (it must succeed)."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "application.cli", *argv],
        cwd=ROOT,
        text=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"clgrpo {' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.monotonic() - started


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def measure_numeric_step(config: RunConfig, out: Path) -> dict:
    """Step 1's numeric update again, from its stored inputs, in this process: time and peak memory."""
    from flows.train import plan_steps
    from tasks.numeric_update import numeric_inputs, train_step

    with Store(config.db_path, read_only=True) as store:
        problems = store.records("problems", RUN_ID, 0)
        rollouts = store.records("rollouts", RUN_ID, 1)
        advantages = store.records("group_advantages", RUN_ID, 1)
        library = store.load_library(RUN_ID, 0).to_version()
    first = plan_steps(problems, epochs=1, batch_size=config.grpo.batch_size, seed=config.seed)[0].problems
    inputs = numeric_inputs(config, first, rollouts, advantages, library)
    before = rss_mb()
    started = time.monotonic()
    record = train_step(config, 1, inputs.items, inputs.skipped, None, 0, out / "measured_adapter_step1")
    seconds = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = max(1, record.rows_used)
    return {
        "rows": record.rows_used,
        "seconds": seconds,
        "seconds_per_100": 100 * seconds / rows,
        "train_seconds_per_100": 100 * record.seconds / rows,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
        "extra_mb": peak - before,
        "device": record.device,
    }


def read_results(db: str) -> dict:
    with Store(db, read_only=True) as store:
        adapters = store.query(
            "SELECT step, rows_used, rows_skipped, loss_before, loss_after, logprob_change_pos, "
            "logprob_change_neg, seconds, device FROM adapters WHERE run_id = ? ORDER BY step",
            [RUN_ID],
        )
        rollouts = store.query(
            "SELECT step, count(*) AS n, avg(latency_s) AS latency FROM rollouts WHERE run_id = ? "
            "GROUP BY step ORDER BY step",
            [RUN_ID],
        )
        stages = store.query(
            "SELECT step, stage, completed_at FROM stage_runs WHERE run_id = ? ORDER BY completed_at", [RUN_ID]
        )
        evals = store.query(
            "SELECT condition, n_problems, k, mean_at_k, mean_ci_low, mean_ci_high FROM evaluations "
            "WHERE run_id = ? ORDER BY created_at",
            [EVAL_ID],
        )
        comparisons = store.query(
            "SELECT candidate, diff, ci_low, ci_high FROM eval_comparisons WHERE run_id = ? "
            "AND metric = 'mean_at_k' AND tag IS NULL",
            [EVAL_ID],
        )
    return {
        "adapters": adapters.to_dict(orient="records"),
        "rollouts": rollouts.to_dict(orient="records"),
        "stages": [(int(r.step), r.stage) for r in stages.itertuples()],
        "evaluations": evals.to_dict(orient="records"),
        "comparisons": comparisons.to_dict(orient="records"),
    }


def section(results: dict, settings: dict) -> str:
    lines = [
        f"Embedded SmolLM2-135M-Instruct (fp32, CPU, 2 shared cores), family `{settings['family']}`: "
        f"{settings['n_train']} training problems in steps of {settings['batch_size']} (G = "
        f"{settings['group_size']}), LoRA rank 8 / alpha 16, lr {settings['lr']}, 2 passes per step; held-out "
        f"{settings['n_heldout']} problems, k = {settings['k']}. Training run {results['train_seconds']:.0f} s, "
        f"evaluation {results['eval_seconds']:.0f} s.",
        "",
        "| step | completions used (skipped) | GRPO loss before -> after | mean log-prob change, A > 0 | "
        "A < 0 | numeric step s |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None or v != v else f"{v:+.4f}"  # noqa: E731 - NaN from DuckDB NULLs
    for a in results["adapters"]:
        lines.append(
            f"| {a['step']} | {a['rows_used']} ({a['rows_skipped']}) | {fmt(a['loss_before'])} -> "
            f"{fmt(a['loss_after'])} | {fmt(a['logprob_change_pos'])} | {fmt(a['logprob_change_neg'])} | "
            f"{a['seconds']:.1f} |"
        )
    m = results["measured"]
    lines += [
        "",
        f"Numeric step measured again on step 1's {m['rows']} stored completions in a fresh load "
        f"({m['device']}): {m['seconds']:.1f} s including the model load, {m['train_seconds_per_100']:.1f} s "
        f"of training per 100 completions; peak RSS {m['peak_rss_mb']:.0f} MB "
        f"({m['extra_mb']:.0f} MB over the {m['rss_before_mb']:.0f} MB before the load).",
        "",
        "| condition | Mean@k | 95% CI | minus none (paired 95% CI) |",
        "|---|---|---|---|",
    ]
    diffs = {c["candidate"]: c for c in results["comparisons"]}
    for e in results["evaluations"]:
        d = diffs.get(e["condition"])
        versus = f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else "(baseline)"
        lines.append(
            f"| {e['condition']} | {e['mean_at_k']:.3f} | [{e['mean_ci_low']:.3f}, {e['mean_ci_high']:.3f}] "
            f"| {versus} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-hybrid")
    ap.add_argument("--family", default="arithmetic")
    ap.add_argument("--n-train", type=int, default=12)
    ap.add_argument("--n-heldout", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--report", action="store_true", help="write the figures into benchmarks/REPORT.md")
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_rows, heldout_rows = split_sets(args.family, args.n_train, args.n_heldout, seed=0)
    train, heldout = write_rows(out / "train.jsonl", train_rows), write_rows(out / "heldout.jsonl", heldout_rows)
    config_path = out / "hybrid.yaml"
    config = run_config(out, train, args)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    train_seconds = clgrpo("train", "--config", str(config_path))
    eval_seconds = clgrpo(
        "eval",
        "--config",
        str(config_path),
        "--dataset",
        str(heldout),
        "--k",
        str(args.k),
        "--eval-id",
        EVAL_ID,
        "--library",
        "none",
        "--compare",
        f"{RUN_ID}:latest",
        "--compare",
        f"adapter:{RUN_ID}:latest",
        "--compare",
        f"both:{RUN_ID}:latest",
    )
    results = read_results(config["db_path"])
    results.update(
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        measured=measure_numeric_step(RunConfig.model_validate(config), out),
    )
    settings = {k: getattr(args, k) for k in ("family", "n_train", "n_heldout", "batch_size", "group_size", "k", "lr")}
    (out / "results.json").write_text(json.dumps({"settings": settings, **results}, indent=2, default=str))
    text = section(results, settings)
    print(text)
    if args.report:
        block = f"{REPORT_BEGIN}\n{text}\n{REPORT_END}"
        write_block(block, REPORT_BEGIN, REPORT_END, "Hybrid learning: a numeric LoRA step on the same trajectories")


if __name__ == "__main__":
    main()
