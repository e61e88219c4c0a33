"""``clgrpo report``: a run's learning report (plots, per-step table, library and its diff)."""

from __future__ import annotations

import argparse
from pathlib import Path

from application.commands.common import DB_HELP, Command, db_of, read_store
from clgrpo.storage.connection import StoreError


def cmd_report(args: argparse.Namespace) -> int:
    from clgrpo.reports.report import write_report

    db = db_of(args, args.run_id)
    out = Path(args.out) if args.out else Path(db).resolve().parent / args.run_id
    with read_store(db) as store:
        if not store.is_run(args.run_id):
            raise StoreError(f"{db}: no run {args.run_id!r} (clgrpo runs list shows the runs)")
        path = write_report(store, args.run_id, out, args.format)
    print(f"wrote {path} (plots in {path.parent / 'plots'})")
    return 0


def _arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("run_id")
    report.add_argument("--db", help=DB_HELP)
    report.add_argument("--out", help="output folder (default: runs/<run_id>/ next to the DuckDB file)")
    report.add_argument("--format", choices=["html", "md"], default="html")


REPORT = Command("report", "write a run's learning report (plots, steps, library, diff)", cmd_report, _arguments)
