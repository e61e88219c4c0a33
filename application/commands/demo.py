"""``clgrpo demo``: the offline demo (``application.demo``), a real small model learning a lesson on this
machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from application.commands.common import Command, default_run_id, prefect_defaults, resume_command, session
from clgrpo.process import stopping
from clgrpo.storage.state import remember_db


def cmd_demo(args: argparse.Namespace) -> int:
    from application.demo import DemoOptions, run_demo, summary

    prefect_defaults()
    out = Path(args.out)
    opts = DemoOptions(
        problems=args.problems,
        heldout=args.heldout,
        k=args.k,
        group_size=args.group_size,
        steps=args.steps,
        candidates=args.candidates,
        family=args.family,
        out=out,
        run_id=args.run_id or default_run_id("demo"),
        cache_dir=args.cache_dir,
        seed=args.seed,
        engine=args.engine,
        learner=args.learner,
        verbose=args.verbose,
    )
    remember_db(out / "clgrpo.duckdb")
    stopping.set_resume_hint(resume_command(opts.run_id))
    with session(str(out / "clgrpo.duckdb"), opts.run_id or "demo", flow_lines=False):
        result = run_demo(opts)
    print(summary(result))
    return 0


def _arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--family", default="ranges", help="problem family (clgrpo data make --help; default ranges)")
    demo.add_argument("--problems", type=int, default=10, help="training problems (default 10)")
    demo.add_argument("--heldout", type=int, default=20, help="held-out problems, never trained on (default 20)")
    demo.add_argument("--k", type=int, default=2, help="samples per held-out problem and condition (default 2)")
    demo.add_argument("--group-size", type=int, default=4, help="rollouts per problem, G (default 4)")
    demo.add_argument("--steps", type=int, default=1, help="passes over the training problems (default 1)")
    demo.add_argument(
        "--candidates",
        type=int,
        default=1,
        help="lesson candidates per group, chosen among by lesson validation (default 1)",
    )
    demo.add_argument(
        "--engine",
        choices=["auto", "llama-server", "transformers"],
        default="auto",
        help="llama-server (built once from PyPI sources: cmake and a C++ compiler) or the in-process "
        "transformers backend (slower); auto: llama-server when it can be built",
    )
    demo.add_argument(
        "--learner",
        choices=["qwen2.5-coder-1.5b", "same"],
        default="qwen2.5-coder-1.5b",
        help="who writes the lessons: Qwen2.5-Coder-1.5B on a second llama-server (default; fetched "
        "once, 1.1 GB) or the 0.5B policy itself (same; always so with --engine transformers)",
    )
    demo.add_argument("--out", default="runs/demo", help="where the DuckDB file, datasets and library go")
    demo.add_argument("--run-id", help="resume or name a run (default: a fresh demo-<time> id)")
    demo.add_argument("--cache-dir", help="model cache directory (default $CLGRPO_CACHE or ~/.cache/clgrpo)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the generated training set (default 0)")
    demo.add_argument("--verbose", action="store_true", help="also show Prefect's own console logs")


DEMO = Command(
    "demo",
    "offline demo: a real small model (Qwen2.5-Coder-0.5B) learns a lesson, then a "
    "held-out check with and without it, with CIs; no API key",
    cmd_demo,
    _arguments,
)
