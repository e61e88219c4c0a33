"""``clgrpo refresh run|history``: the experience refresh (learn from new problems, promote if better) and the
decisions of past refreshes."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from application.commands.common import (
    Command,
    CommandGroup,
    add_overrides,
    prefect_defaults,
    read_store,
    resume_command,
    session,
)
from clgrpo.inputs.config import ConfigError, load_config
from clgrpo.process import stopping
from clgrpo.refresh.promotion import failing_summary
from clgrpo.storage.run_lock import refuse_if_running
from clgrpo.storage.state import remember_db, resolve_db
from schemas.refresh_config import RefreshConfig

if TYPE_CHECKING:
    from schemas.records import RefreshDecision


def print_decision(d: RefreshDecision, failing_tags: str = "") -> None:
    """``failing_tags``: the tags that failed the promotion gate, in one line
    (``clgrpo.refresh.promotion.failing_summary``)."""
    gain = "" if d.diff is None else f", gain {d.diff:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}]"
    failing = f", failing tags: {failing_tags}" if failing_tags else ""
    print(f"{d.refresh_date}  {d.refresh_id}: {d.status} ({d.n_new_problems} new problems{gain}{failing})")
    print(f"    started from {d.baseline_ref}" + (f", candidate {d.candidate_ref}" if d.candidate_ref else ""))
    for reason in d.reasons:
        print(f"    - {reason}")


def cmd_refresh_run(args: argparse.Namespace) -> int:
    from datetime import datetime

    from tasks.preflight import check_refresh

    config = load_config(args.config, list(args.overrides), model=RefreshConfig)
    try:
        as_of = datetime.fromisoformat(args.as_of) if args.as_of else None
    except ValueError as exc:
        raise ConfigError(f"--as-of {args.as_of!r}: use an ISO date-time such as 2026-11-23T02:00") from exc
    check_refresh(config)
    refuse_if_running(config.training.db_path, "refresh", config.name)  # the flow takes the lock itself
    remember_db(config.training.db_path)
    stopping.set_resume_hint(resume_command(None))
    prefect_defaults()
    from flows.refresh import refresh, work_dir

    with session(config.training.db_path, f"refresh-{config.name}"):
        decision = stopping.run_command(refresh(config, as_of=as_of))
    print_decision(decision)
    if decision.promoted:
        print(f"promoted library: {work_dir(config) / 'promoted.json'} (also .seed.json and .txt)")
    if decision.status == "awaiting_review":
        print(f"next: clgrpo review {decision.refresh_id} --db {config.training.db_path}")
    return 0


def cmd_refresh_history(args: argparse.Namespace) -> int:
    from clgrpo.refresh import adopt
    from clgrpo.refresh.review import describe_decision, is_open, stored_decisions
    from schemas.records import utcnow

    db = resolve_db(args.db, refresh=args.name)
    with read_store(db) as store:
        decisions = store.refresh_decisions(args.name)
        gates = store.refresh_gates(args.name)
        reviews = {d.refresh_id: stored_decisions(store, d.refresh_id) or [] for d in decisions}
        waiting = [r for r in store.review_requests(args.name) if is_open(store, r)]
        adoptions = store.library_adoptions(args.name)
    if not decisions and not waiting:
        print(f"no refreshes named {args.name!r} in {db}")
    for d in decisions:
        print_decision(d, failing_summary(gates.get(d.refresh_id, [])))
        for row in reviews[d.refresh_id]:
            print(f"      review {describe_decision(row)}")
    now = utcnow()
    for r in waiting:
        head = f"{r.pending.refresh_date}  {r.refresh_id}:"
        if r.deadline <= now:
            print(
                f"{head} review of {len(r.changes)} change(s) timed out unanswered at {r.deadline:%Y-%m-%d %H:%M %Z} "
                f"(recorded by the next refresh of {args.name!r}, a Retry of its run or clgrpo review {r.refresh_id})"
            )
            continue
        print(
            f"{head} awaiting review of {len(r.changes)} change(s) until {r.deadline:%Y-%m-%d %H:%M %Z}: "
            f"clgrpo review {r.refresh_id}"
        )
    if adoptions:
        print("served library (promoted.json):")
        for a in adoptions:
            print(f"  {adopt.describe_adoption(a)}")
    return 0


def run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--config", required=True, help="YAML refresh config (see configs/refresh.yaml)")
    add_overrides(run, "steps=2")
    run.add_argument("--as-of", help="the cutoff instant (ISO; without a zone: in the config's timezone)")


def history_arguments(history: argparse.ArgumentParser) -> None:
    history.add_argument("--name", default="nightly", help="the refresh name (default nightly)")
    history.add_argument(
        "--db", help="DuckDB file (default: the most recent database that holds the refresh, else the most recent one)"
    )


REFRESH = CommandGroup(
    "refresh",
    "the experience refresh: learn from new problems, promote if better",
    (
        Command(
            "run",
            "run the refresh for a date (default: now) once; a decided date is reported, not run again",
            cmd_refresh_run,
            run_arguments,
        ),
        Command(
            "history", "the decisions of past refreshes, with their reasons", cmd_refresh_history, history_arguments
        ),
    ),
)
