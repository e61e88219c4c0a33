"""``clgrpo train``: a training run, then its per-step table and where its results are."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from application.commands.common import (
    Command,
    add_overrides,
    default_run_id,
    prefect_defaults,
    read_store,
    resume_command,
    rollout_mode_line,
    session,
)
from clgrpo.inputs.config import load_config
from clgrpo.process import stopping
from clgrpo.storage.run_lock import refuse_if_running
from clgrpo.storage.state import remember_db
from schemas.config import RunConfig

if TYPE_CHECKING:
    from flows.train import TrainResult


def report_hint(run_id: str, db_path: str) -> str:
    return f"next: clgrpo report {run_id}   (plots, per-step table, library and its diff; --db {db_path})"


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    # quoted: a run id or path is a string even where YAML would read another type ("off", "2026", "null")
    if args.run_id:
        overrides.append(f"run_id={json.dumps(args.run_id)}")
    if args.db:
        overrides.append(f"db_path={json.dumps(args.db)}")
    if args.mode:
        overrides.append(f"rollout.mode={args.mode}")
    if args.plots:
        overrides.append("plots=true")
    config = load_config(args.config, overrides)
    if config.run_id is None:
        config = config.model_copy(update={"run_id": default_run_id(Path(args.config).stem)})
    run_id = config.require_run_id()
    from tasks.preflight import check_run

    refuse_if_running(config.db_path, "train", run_id)  # the flow takes the run lock itself
    config = stopping.run_command(check_run(config))  # seconds, before Prefect starts: user errors end here
    identity_line = check_identity(config, args.accept_model_change)  # a changed model: refused here
    remember_db(config.db_path)
    stopping.set_resume_hint(resume_command(run_id))
    prefect_defaults()
    from flows.train import train

    with session(config.db_path, run_id) as terminal:
        print(f"run {run_id} (resume it with --run-id {run_id}); log: {terminal.log_path}")
        if identity_line:
            print(identity_line)
        if line := rollout_mode_line(config):
            print(line)
        result = stopping.run_command(train(config, preflight=False, accept_model_change=args.accept_model_change))
    print_steps(result)
    for line in result.gate:
        print(line)
    print(f"DuckDB: {result.db_path}\nlibrary files: {result.export_dir}\n{report_hint(result.run_id, result.db_path)}")
    if result.stopped:
        print(f"stopped early: {result.stopped}")
        return 3
    return 0


def check_identity(config: RunConfig, accept_change: bool) -> str | None:
    """A resumed run against the model it was trained with (``clgrpo.storage.store.identity_change``): another one is
    refused in one line before Prefect starts, unless accepted; the line to print, if any (the flow binds it)."""
    from clgrpo.storage.store import identity_change

    path, run_id = Path(config.db_path).expanduser(), config.require_run_id()
    if not path.is_file():
        return None
    with read_store(str(path)) as store:
        if not store.is_run(run_id):
            return None
        bound = store.run_identity(run_id)
    return identity_change(run_id, bound, config.policy.identity(), accept_change=accept_change)


def print_steps(result: TrainResult) -> None:
    print(
        f"\nrun {result.run_id}: {len(result.steps)} steps, library version {result.final_version} "
        f"with {result.library_size} experiences"
    )
    print(
        f"{'step':>4} {'epoch':>5} {'acc':>6} {'groups sel/all':>14} {'proposals ok/bad':>16} "
        f"{'ops applied/rejected':>20} {'lib':>4} {'requests':>8} {'failed':>6} {'tok in':>8} {'tok out':>8} "
        f"{'cost $':>8}"
    )
    for r in result.steps:
        print(
            f"{r.step:>4} {r.epoch + 1:>5} {r.accuracy:>6.3f} {r.groups_selected:>7}/{r.groups_total:<6} "
            f"{r.proposals_parsed:>8}/{r.proposals_failed:<7} {r.operations_applied:>10}/{r.operations_rejected:<9} "
            f"{r.library_size:>4} {r.llm_requests:>8} {failed_items(r):>6} {r.tokens_in:>8} {r.tokens_out:>8} "
            f"{r.cost_usd:>8.4f}"
        )
    for r in result.steps:
        if r.near_duplicates:
            print(
                f"step {r.step}: {r.near_duplicates} near-duplicate adds/modifies ({r.duplicate_ratio:.0%} of them) "
                f"rejected or merged (reasons: clgrpo library ops {result.run_id}:{r.step})"
            )
        if r.tool_calls:
            print(
                f"step {r.step} (agent): {r.tool_calls} tool calls, {r.tool_errors} returned an error "
                f"(shown to the model), {r.model_turns} model turns"
            )
    if any(failed_items(r) for r in result.steps):
        print(
            "failed: samples, verifications, summaries and learner calls that failed after their retries "
            "(stored with their causes; see the log's WARNING lines and `clgrpo report`)"
        )


def failed_items(r: Any) -> int:
    return r.rollouts_failed + r.verify_failed + r.summaries_failed + r.proposals_call_failed


def _arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    add_overrides(train, "grpo.group_size=8")
    train.add_argument("--run-id", help="name the run, or resume one (default: <config name>-<date>-<time>)")
    train.add_argument("--db", help="shortcut for --set db_path=...")
    train.add_argument(
        "--mode",
        choices=["direct", "agent"],
        help="rollouts: direct answers or an agent with the domain's tools (shortcut for "
        "--set rollout.mode=...; default: the config's)",
    )
    train.add_argument(
        "--plots",
        action="store_true",
        help="draw the run's plots at the end (shortcut for --set plots=true; `clgrpo report` draws them any time)",
    )
    train.add_argument(
        "--accept-model-change",
        action="store_true",
        help="resume a run although its policy model changed since it started (another identity: what the "
        "endpoint states of the weights, or policy.revision); the run says so. Without it such a resume is refused",
    )


TRAIN = Command("train", "run the training flow", cmd_train, _arguments)
