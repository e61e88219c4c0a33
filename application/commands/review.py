"""``clgrpo review``: answer a refresh's review (approve, edit or reject each change), then resume its suspended
flow run, or, for a refresh run from the terminal, apply the answers and promote."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal

from application.commands.common import Command, prefect_defaults, read_store, session
from application.commands.refresh import print_decision
from clgrpo.inputs.config import ConfigError
from clgrpo.process import stopping
from clgrpo.storage.connection import StoreError
from clgrpo.storage.state import resolve_db
from clgrpo.storage.store import Store
from schemas.records import RefreshInput
from schemas.refresh_config import RefreshConfig


def _reviewer(args: argparse.Namespace) -> str:
    import getpass

    return args.reviewer or os.environ.get("CLGRPO_REVIEWER") or getpass.getuser()


def print_change(c: Any) -> None:
    print(f"{c.change_id}: {c.op} {c.exp_id}")
    if c.before is not None:
        print(f"    before: {c.before}")
    if c.proposed is not None:
        print(f"    {'after' if c.before else 'new'}:    {c.proposed}")
    if c.source_groups:
        print(f"    from problems: {', '.join(c.source_groups)}")
    for line in [*c.origin, *c.evidence]:
        print(f"    {line}")


def _ask_terminal(changes: list, reviewer: str, check: Any) -> dict[str, Any]:
    """One answer per change from the terminal: approve, edit (then the new text, asked again while the lesson
    guard refuses it) or reject, and a reason."""
    from clgrpo.refresh.review import field_name

    if not sys.stdin.isatty():  # the changes still listed: what a --decisions file answers, by change id
        for c in changes:
            print_change(c)
        raise ConfigError("no terminal to answer on: use --decisions FILE.json, --approve-all or --reject-all")
    answers: dict[str, Any] = {"reviewer": reviewer}
    for c in changes:
        print_change(c)
        choice, text = "", ""
        while choice not in {"a", "e", "r"}:
            choice = input("  [a]pprove, [e]dit or [r]eject? ").strip().lower()[:1]
            if choice == "e":
                text = " ".join(input("  new text: ").split())
                refusal = "the edited text is empty" if not text else check(text, c.source_groups)
                if refusal:
                    print(f"  refused by the lesson guard: {refusal}; answer again")
                    choice = ""
        reason = input("  reason (optional): ").strip()
        decision = {"a": "approve", "e": "edit", "r": "reject"}[choice]
        answers[field_name(c)] = {"decision": decision, "text": text, "reason": reason}
    return answers


def review_answers(args: argparse.Namespace, changes: list, check: Any) -> dict[str, Any]:
    """Form data from --decisions FILE, --approve-all / --reject-all, or the terminal."""
    import json

    from clgrpo.refresh.review import uniform_answers

    if args.decisions:
        try:
            data = json.loads(Path(args.decisions).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--decisions {args.decisions}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"--decisions {args.decisions}: expected an object of change ids to answers")
        return {"reviewer": _reviewer(args), **data}
    if args.approve_all or args.reject_all:
        choice: Literal["approve", "reject"] = "approve" if args.approve_all else "reject"
        return uniform_answers(changes, choice, _reviewer(args), args.reason or f"{choice} all")
    return _ask_terminal(changes, _reviewer(args), check)


def _find_request(store: Store, key: str) -> Any:
    from clgrpo.refresh.review import stored_request

    found = stored_request(store, key)
    if found is None:
        refresh_id = store.review_of_flow_run(key)
        found = stored_request(store, refresh_id) if refresh_id is not None else None
    if found is None:
        raise StoreError(f"{store.path}: no review requested by refresh or flow run {key!r}")
    return found


def _resume(request: Any, form: dict[str, Any]) -> str:
    """Resume the suspended flow run with the answers; a message, or raises ReviewError when it cannot."""
    from uuid import UUID

    from prefect.exceptions import FlowPauseTimeout, NotPausedError
    from prefect.flow_runs import resume_flow_run

    from clgrpo.refresh.review import ReviewError

    try:
        resume_flow_run(UUID(request.flow_run_id), run_input=form)
    except (FlowPauseTimeout, NotPausedError, RuntimeError) as exc:
        raise ReviewError(f"flow run {request.flow_run_id} cannot be resumed: {exc}") from exc
    return (
        f"resumed flow run {request.flow_run_id}: a worker applies the review and promotes "
        f"(clgrpo refresh history --name {request.name})"
    )


def cmd_review(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from clgrpo.refresh.review import (
        ReviewError,
        answers_from,
        conclude,
        decide_all,
        field_name,
        is_open,
        timed_out,
        timeout_reason,
    )
    from clgrpo.storage.run_lock import RunLock

    db = resolve_db(args.db, args.refresh)
    with read_store(db) as store:
        request = _find_request(store, args.refresh)
        inputs = store.records(RefreshInput, request.refresh_id)
        if not is_open(store, request):
            decided = [d for d in store.refresh_decisions(request.name) if d.refresh_id == request.refresh_id]
            raise ReviewError(
                f"refresh {request.refresh_id} is already decided ({decided[0].status if decided else '?'}): "
                "nothing to answer"
            )
    config = RefreshConfig.model_validate_json(request.config_json)
    from flows.refresh import work_dir
    from flows.refresh_review import lesson_guard

    if datetime.now(timezone.utc) >= request.deadline:  # too late: the timeout is recorded, the answers are not
        release = config.release_timed_out
        with RunLock(db, "refresh", request.name), Store(db) as store:
            decision = conclude(
                store, request, timed_out(request.changes, timeout_reason(request, release)), work_dir(config),
                released=release,
            )  # fmt: skip
        raise ReviewError(
            f"the review of refresh {request.refresh_id} closed at {request.deadline:%Y-%m-%d %H:%M %Z}: no "
            f"answer was applied; recorded as {decision.status} (review timed out)"
        )
    print(
        f"refresh {request.refresh_id}: {len(request.changes)} change(s), answer before "
        f"{request.deadline:%Y-%m-%d %H:%M %Z}"
    )
    if args.decisions or args.approve_all or args.reject_all:
        for c in request.changes:
            print_change(c)
    check = lesson_guard(config, inputs).check
    answers, reviewer = answers_from(review_answers(args, request.changes, check), request.changes)
    refused = [d for d in decide_all(request.changes, answers, reviewer, check) if d.decision == "refused_edit"]
    if refused:  # a file's edit the guard refuses: nothing is applied, the file is to be fixed
        raise ReviewError(
            "; ".join(f"change {d.change_id}: {d.reason}" for d in refused) + ": fix the edit and answer again"
        )
    form = {"reviewer": reviewer, **{field_name(c): answers[c.change_id].model_dump() for c in request.changes}}
    if request.flow_run_id:  # the server of PREFECT_API_URL (the one the deployment runs on)
        print(_resume(request, form))
        return 0
    prefect_defaults()
    from flows.refresh import apply_review

    with RunLock(db, "refresh", request.name), session(db, f"review-{request.refresh_id}"):
        decision = stopping.run_command(apply_review(config, request.refresh_id, form))
    print_decision(decision)
    return 0


def _arguments(review: argparse.ArgumentParser) -> None:
    review.add_argument("refresh", metavar="REFRESH_ID_OR_FLOW_RUN", help="e.g. nightly-2026-11-22, or the flow run id")
    answer = review.add_mutually_exclusive_group()
    answer.add_argument("--approve-all", action="store_true", help="approve every change")
    answer.add_argument("--reject-all", action="store_true", help="reject every change")
    answer.add_argument(
        "--decisions",
        metavar="FILE.json",
        help='answers as JSON: {"c1": {"decision": "approve", "reason": "..."}, "c2": {"decision": '
        '"edit", "text": "..."}, ..., "reviewer": "ana"}',
    )
    review.add_argument("--reviewer", help="your name (default: $CLGRPO_REVIEWER, else the login name)")
    review.add_argument("--reason", help="the reason stored with --approve-all / --reject-all")
    review.add_argument("--db", help="DuckDB file (default: the most recent database that holds the refresh)")


REVIEW = Command(
    "review",
    "answer a refresh's review (approve, edit or reject each change) and "
    "resume its suspended flow run (or, for a terminal refresh, promote)",
    cmd_review,
    _arguments,
)
