"""``clgrpo library show|diff|export|ops|rollback``: a run's learned libraries, and the library a refresh serves."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from application.commands.common import DB_HELP, Command, CommandGroup, db_of, read_store
from clgrpo.experience.library import describe_operation, diff, item_text
from clgrpo.storage.connection import StoreError
from clgrpo.storage.state import resolve_db
from clgrpo.storage.store import Store, parse_library_ref
from schemas.records import ExperienceStat, LibraryQuality


def cmd_library_show(args: argparse.Namespace) -> int:
    from clgrpo.experience.quality import describe_quality
    from clgrpo.experience.usefulness import NOT_MEASURED, describe_stat, measured

    run_id, version = parse_library_ref(args.ref)
    with read_store(db_of(args, args.ref)) as store:
        library = store.load_library(run_id, version)
        summarized = measured(store.run_config(run_id)) if store.is_run(run_id) else True
        stats = {s.exp_id: s for s in store.records(ExperienceStat, run_id, library.step)} if summarized else {}
        quality = [q for q in store.records(LibraryQuality, run_id, library.step) if q.version == library.version]
    kinds = f" ({len(library.lessons)} lessons, {len(library.examples)} worked examples)" if library.examples else ""
    print(
        f"# run {run_id}, version {library.version} (step {library.step}), {len(library)} experiences{kinds}, "
        f"{library.prompt_tokens()} tokens (estimated)"
    )
    if quality:
        print(f"# {describe_quality(quality[0], usefulness=summarized)}")
    if not summarized:
        print(f"# {NOT_MEASURED}")
    for e in library:
        lineage = f" (from {', '.join(e.parent_ids)})" if e.parent_ids else ""
        domain = f" domain {e.domain_tag}" if e.domain_tag else ""
        print(f"[{e.id}] {item_text(e, solution=False)}  <step {e.created_step}/{e.updated_step}{lineage}{domain}>")
        if e.example is not None:
            print(textwrap.indent(e.text, "      | "))
        if e.id in stats:
            print(f"      {describe_stat(stats[e.id])}")
    return 0


def cmd_library_diff(args: argparse.Namespace) -> int:
    with read_store(db_of(args, args.old)) as store:
        old = store.load_library(*parse_library_ref(args.old))
        new = store.load_library(*parse_library_ref(args.new))
    print(diff(old, new).to_markdown())
    return 0


def cmd_library_export(args: argparse.Namespace) -> int:
    run_id, version = parse_library_ref(args.ref)
    with read_store(db_of(args, args.ref)) as store:
        library = store.load_library(run_id, version)
    if args.out:
        library.dump(args.out, fmt=args.format)
        print(f"wrote {len(library)} experiences to {args.out} ({args.format} format)")
    else:
        sys.stdout.write(library.dumps(args.format) + ("\n" if args.format != "text" else ""))
    return 0


def cmd_library_ops(args: argparse.Namespace) -> int:
    run_id, step = parse_library_ref(args.ref)
    with read_store(db_of(args, args.ref)) as store:
        if not store.is_run(run_id):
            raise StoreError(f"{store.path}: no run {run_id!r}")
        results = store.operation_results(run_id, step)
        steps = store.steps_done(run_id)
    where = f"step {step}" if step is not None else f"{steps} step(s) done"
    print(
        f"# run {run_id}, {where}: {len(results)} operation(s), "
        f"{sum(r.status.value == 'applied' for _, r in results)} applied, "
        f"{sum(r.status.value == 'rejected' for _, r in results)} rejected"
    )
    for op_step, r in results:
        if not args.rejected or r.status.value == "rejected":
            print(describe_operation(op_step, r))
    return 0


def cmd_library_rollback(args: argparse.Namespace) -> int:
    import getpass

    from clgrpo.refresh import adopt
    from clgrpo.storage.run_lock import RunLock

    db = resolve_db(args.db, refresh=args.name)
    with RunLock(db, "refresh", args.name), Store(db) as store:
        done = adopt.rollback(store, args.name, args.actor or getpass.getuser(), args.to, args.reason or "")
    print(f"{args.name}: now serving version {done.version} ({done.library_ref}), was version {done.from_version}")
    print(f"served file: {Path(done.folder) / 'promoted.json'}")
    return 0


def _show_arguments(show: argparse.ArgumentParser) -> None:
    show.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    show.add_argument("--db", help=DB_HELP)


def diff_arguments(diff_p: argparse.ArgumentParser) -> None:
    diff_p.add_argument("old", help="RUN_ID:VERSION")
    diff_p.add_argument("new", help="RUN_ID:VERSION (or RUN_ID:latest)")
    diff_p.add_argument("--db", help=DB_HELP)


def export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    export.add_argument("--format", choices=["reference", "seed", "text"], default="reference")
    export.add_argument("--out", help="output file (default: stdout)")
    export.add_argument("--db", help=DB_HELP)


def ops_arguments(ops: argparse.ArgumentParser) -> None:
    ops.add_argument("ref", help="RUN_ID (every step) or RUN_ID:STEP")
    ops.add_argument("--rejected", action="store_true", help="only the rejected operations")
    ops.add_argument("--db", help=DB_HELP)


def rollback_arguments(rollback: argparse.ArgumentParser) -> None:
    rollback.add_argument("name", metavar="REFRESH_NAME", help="the refresh name (config name, e.g. nightly)")
    rollback.add_argument(
        "--to",
        type=int,
        metavar="VERSION",
        help="the promoted version to serve (default: the one before the version in place; see clgrpo refresh history)",
    )
    rollback.add_argument("--actor", help="who rolls back (default: the login name)")
    rollback.add_argument("--reason", help="why (stored with the rollback)")
    rollback.add_argument("--db", help="DuckDB file (default: the most recent database that holds the refresh)")


LIBRARY = CommandGroup(
    "library",
    "inspect and export learned libraries",
    (
        Command("show", "print a library version", cmd_library_show, _show_arguments),
        Command("diff", "what changed between two versions", cmd_library_diff, diff_arguments),
        Command("export", "write a library version to a file or stdout", cmd_library_export, export_arguments),
        Command(
            "ops",
            "the operations of a run or step: applied or rejected, with the reason",
            cmd_library_ops,
            ops_arguments,
        ),
        Command(
            "rollback",
            "serve an earlier promoted version of a refresh's library again "
            "(its promoted.json, replaced atomically; recorded)",
            cmd_library_rollback,
            rollback_arguments,
        ),
    ),
)
