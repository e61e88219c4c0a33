"""The ``clgrpo`` command line: train, library show|diff|export, runs list."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from clgrpo.config import ConfigError, load_config
from clgrpo.library import ExperienceLibrary, LibraryFormatError, diff
from clgrpo.store import Store, StoreError

DEFAULT_DB = "runs/clgrpo.duckdb"


def _prefect_defaults() -> None:
    """Sensible settings for local use; anything the user set wins."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def parse_library_ref(ref: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN:latest`` -> latest version; ``RUN:3`` -> version 3."""
    run_id, _, version = ref.partition(":")
    if version in ("", "latest"):
        return run_id, None
    if not version.isdigit():
        raise SystemExit(f"error: library reference {ref!r}: the version must be a number or 'latest'")
    return run_id, int(version)


def _open(db: str) -> Store:
    return Store(db, read_only=True)


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.run_id:
        overrides.append(f"run_id={args.run_id}")
    if args.db:
        overrides.append(f"db_path={args.db}")
    config = load_config(args.config, overrides)
    _prefect_defaults()
    from flows.train import train

    result = asyncio.run(train(config))
    print(f"\nrun {result.run_id}: {len(result.steps)} steps, library version {result.final_version} "
          f"with {result.library_size} experiences")
    print(f"{'step':>4} {'epoch':>5} {'acc':>6} {'groups':>9} {'props ok/bad':>12} {'ops +/-':>8} {'lib':>4} "
          f"{'tok in':>8} {'tok out':>8} {'cost $':>8}")
    for r in result.steps:
        print(f"{r.step:>4} {r.epoch + 1:>5} {r.accuracy:>6.3f} {r.groups_selected:>4}/{r.groups_total:<4} "
              f"{r.proposals_parsed:>6}/{r.proposals_failed:<5} {r.operations_applied:>3}/{r.operations_rejected:<4} "
              f"{r.library_size:>4} {r.tokens_in:>8} {r.tokens_out:>8} {r.cost_usd:>8.4f}")
    print(f"DuckDB: {result.db_path}\nlibrary files: {result.export_dir}")
    return 0


def cmd_library_show(args: argparse.Namespace) -> int:
    run_id, version = parse_library_ref(args.ref)
    with _open(args.db) as store:
        library = store.load_library(run_id, version)
    print(f"# run {run_id}, version {library.version} (step {library.step}), {len(library)} experiences")
    for e in library:
        lineage = f" (from {', '.join(e.parent_ids)})" if e.parent_ids else ""
        print(f"[{e.id}] {e.text}  <step {e.created_step}/{e.updated_step}{lineage}>")
    return 0


def cmd_library_diff(args: argparse.Namespace) -> int:
    with _open(args.db) as store:
        old = store.load_library(*parse_library_ref(args.old))
        new = store.load_library(*parse_library_ref(args.new))
    print(diff(old, new).to_markdown())
    return 0


def cmd_library_export(args: argparse.Namespace) -> int:
    run_id, version = parse_library_ref(args.ref)
    with _open(args.db) as store:
        library = store.load_library(run_id, version)
    if args.out:
        library.dump(args.out, fmt=args.format)
        print(f"wrote {len(library)} experiences to {args.out} ({args.format} format)")
    else:
        sys.stdout.write(library.dumps(args.format) + ("\n" if args.format != "text" else ""))
    return 0


def cmd_runs_list(args: argparse.Namespace) -> int:
    with _open(args.db) as store:
        runs = store.runs()
    if runs.empty:
        print(f"no runs in {args.db}")
        return 0
    print(runs.to_string(index=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clgrpo", description="Continuous Learning GRPO: learn an experience library")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run the training flow")
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set grpo.group_size=8 (repeatable)")
    train.add_argument("--run-id", help="shortcut for --set run_id=...")
    train.add_argument("--db", help="shortcut for --set db_path=...")
    train.set_defaults(func=cmd_train)

    library = sub.add_parser("library", help="inspect and export learned libraries").add_subparsers(
        dest="library_command", required=True)
    show = library.add_parser("show", help="print a library version")
    show.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    diff_p = library.add_parser("diff", help="what changed between two versions")
    diff_p.add_argument("old", help="RUN_ID:VERSION")
    diff_p.add_argument("new", help="RUN_ID:VERSION (or RUN_ID:latest)")
    export = library.add_parser("export", help="write a library version to a file or stdout")
    export.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    export.add_argument("--format", choices=["reference", "seed", "text"], default="reference")
    export.add_argument("--out", help="output file (default: stdout)")
    for p, func in ((show, cmd_library_show), (diff_p, cmd_library_diff), (export, cmd_library_export)):
        p.add_argument("--db", default=DEFAULT_DB, help=f"DuckDB file (default {DEFAULT_DB})")
        p.set_defaults(func=func)

    runs = sub.add_parser("runs", help="list runs").add_subparsers(dest="runs_command", required=True)
    runs_list = runs.add_parser("list", help="runs stored in a DuckDB file")
    runs_list.add_argument("--db", default=DEFAULT_DB)
    runs_list.set_defaults(func=cmd_runs_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, StoreError, LibraryFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
