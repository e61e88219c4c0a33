"""``clgrpo runs list|show|delete``: the runs of a database, one run's state, and removing a run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from application.commands.common import DB_HELP, Command, CommandGroup, db_of, read_store
from clgrpo.inputs.config import ConfigError
from clgrpo.process.words import counted
from clgrpo.storage.connection import StoreError
from clgrpo.storage.run_lock import holder, refuse_if_running
from clgrpo.storage.store import Store


def cmd_runs_list(args: argparse.Namespace) -> int:
    db = db_of(args)
    if not args.db and not Path(db).exists():  # a fresh install: no run has made its database yet
        print(f"no runs yet ({db} does not exist: `clgrpo train` or `clgrpo demo` creates it)")
        return 0
    with read_store(db) as store:
        runs = store.runs()
    if runs.empty:
        print(f"no runs in {db}")
        return 0
    print(f"runs in {db}:")
    runs["status"] = [live_status(db, run_id, status) for run_id, status in zip(runs["run_id"], runs["status"])]
    runs["updated_at"] = runs["updated_at"].dt.strftime("%Y-%m-%d %H:%M:%S")
    columns = ["run_id", "status", "steps_done", "library_version", "library_size", "updated_at", "error"]
    view = runs[columns].astype(object).where(runs[columns].notna(), "-")
    print(view.to_string(index=False, max_colwidth=60))
    return 0


def live_status(db: str, run_id: str, status: str, *, since: bool = False) -> str:
    """``running (pid N)`` while a live process holds the run's lock (``since``: and when it took it); a run
    stored as running whose lock is free was killed or crashed: ``interrupted``; else the stored status."""
    found = holder(db, "train", run_id)
    if found is not None:
        return f"running (pid {found.pid or '?'}{f', since {found.started}' if since else ''})"
    return "interrupted" if status == "running" else status


def cmd_runs_show(args: argparse.Namespace) -> int:
    db = db_of(args, args.run_id)
    with read_store(db) as store:
        run = store.run_summary(args.run_id)
        fingerprints = store.system_fingerprints(args.run_id) if run is not None else []
        identity = store.run_identity(args.run_id) if run is not None else None
    if run is None:
        raise StoreError(f"{db}: no run {args.run_id!r} (clgrpo runs list shows the runs)")
    library = (
        "none saved"
        if run["library_version"] is None
        else f"version {int(run['library_version'])}, {int(run['library_size'])} experiences"
    )
    stage = (
        "none stored yet"
        if run["last_stage"] is None
        else f"step {run['last_step']} {run['last_stage']} (stored {run['last_completed_at']:%Y-%m-%d %H:%M:%S})"
    )
    print(f"run {args.run_id} in {db}")
    print(f"  status:      {live_status(db, args.run_id, run['status'], since=True)}")
    print(f"  steps done:  {run['steps_done']}")
    print(f"  last stage:  {stage}")
    print(f"  library:     {library}")
    if identity is not None:
        print(f"  model:       {identity.label}")
    if line := fingerprint_line(fingerprints):
        print(f"  provider:    {line}")
    if run["error"] is not None:
        print(f"  error:       {run['error']}")
    print(f"  updated at:  {run['updated_at']:%Y-%m-%d %H:%M:%S}")
    return 0


def fingerprint_line(stretches: list[tuple[str, int, int, int]]) -> str:
    """What the provider's ``system_fingerprint`` did during a run: one value, or when it changed."""
    if not stretches:
        return ""
    if len({s[0] for s in stretches}) == 1:
        return f"system_fingerprint {stretches[0][0]} on every policy call that reported one"
    parts = [
        f"{fingerprint} (step{'s' if first != last else ''} {first}{f'-{last}' if first != last else ''}, "
        f"{counted(calls, 'call')})"
        for fingerprint, first, last, calls in stretches
    ]
    return (
        f"system_fingerprint changed during the run ({len(stretches) - 1} time"
        f"{'s' if len(stretches) > 2 else ''}): {' -> '.join(parts)}; the provider's backend changed under the same "
        "model name, so steps on either side drew from different configurations"
    )


def cmd_runs_delete(args: argparse.Namespace) -> int:
    db = db_of(args, args.run_id)
    refuse_if_running(db, "train", args.run_id)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"runs delete {args.run_id}: pass --yes to delete without a question")
        answer = input(f"delete every row of run {args.run_id!r} from {db}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    with Store(db) as store:
        if not store.is_run(args.run_id) and not store.library_versions(args.run_id):
            raise StoreError(f"{db}: no run {args.run_id!r}")
        removed = store.delete_run(args.run_id)
    files = delete_run_files(db, args.run_id)
    print(f"deleted run {args.run_id} from {db}: " + ", ".join(f"{n} {t}" for t, n in removed.items()))
    if files:
        print("and its work files: " + ", ".join(files))
    return 0


def delete_run_files(db: str, run_id: str) -> list[str]:
    """A run's work kept outside DuckDB: its work journals and the default rollout hand-off folder (the
    exported library files stay: they are the product)."""
    import shutil

    from clgrpo.storage.journal import discard_run, run_journals

    base = Path(db).expanduser().resolve().parent
    found = [str(p) for p in run_journals(db, run_id)]
    discard_run(db, run_id)
    handoff = base / run_id / "handoff" / run_id
    if handoff.is_dir():
        shutil.rmtree(handoff, ignore_errors=True)
        found.append(str(handoff))
    return found


def list_arguments(runs_list: argparse.ArgumentParser) -> None:
    runs_list.add_argument("--db", help="DuckDB file (default: the most recent database)")


def _show_arguments(runs_show: argparse.ArgumentParser) -> None:
    runs_show.add_argument("run_id")
    runs_show.add_argument("--db", help=DB_HELP)


def delete_arguments(runs_delete: argparse.ArgumentParser) -> None:
    runs_delete.add_argument("run_id")
    runs_delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    runs_delete.add_argument("--db", help=DB_HELP)


RUNS = CommandGroup(
    "runs",
    "list, show or delete runs",
    (
        Command(
            "list", "runs in a DuckDB file: status, steps done, library, last update", cmd_runs_list, list_arguments
        ),
        Command(
            "show",
            "one run: status (and pid while it trains), steps done, last stored stage, library, error",
            cmd_runs_show,
            _show_arguments,
        ),
        Command("delete", "remove every row of a run, in one transaction", cmd_runs_delete, delete_arguments),
    ),
)
