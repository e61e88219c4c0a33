"""``clgrpo eval``: Mean@k / Pass@k of libraries on a dataset, with confidence intervals and paired comparisons."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from application.commands.common import (
    Command,
    db_of,
    default_run_id,
    prefect_defaults,
    read_store,
    resume_command,
    rollout_mode_line,
    session,
)
from clgrpo.inputs.config import ConfigError, load_config
from clgrpo.process import stopping
from clgrpo.process.words import counted
from clgrpo.storage.state import remember_db
from clgrpo.storage.store import parse_library_ref
from schemas.config import DatasetConfig, EvalConfig, RunConfig

if TYPE_CHECKING:
    from flows.evaluate import EvalOutcome


def _eval_model_config(args: argparse.Namespace, refs: list[str]) -> RunConfig:
    """The policy (and domain) to evaluate with: ``--config``, else the stored config of the first run whose
    library is evaluated; the database is ``--db``, else the most recent database holding that run (a demo's
    run is found in the demo's database), else the config's ``db_path`` (with ``--config``)."""
    from clgrpo.llm.adapters import split_condition
    from clgrpo.storage.state import database_holding

    refs = [split_condition(r)[1] for r in refs]  # adapter:RUN:STEP / both:RUN:STEP: that run's policy
    run_refs = [r for r in refs if r.lower() != "none" and not Path(r).is_file()]
    if args.config:
        config = load_config(args.config, args.overrides)
        holder = database_holding(parse_library_ref(run_refs[0])[0]) if run_refs and not args.db else None
        return config.model_copy(update={"db_path": args.db or holder or config.db_path})
    if not run_refs:
        raise ConfigError("no model settings: pass --config FILE (a run config whose policy is evaluated)")
    db = db_of(args, run_refs[0])
    with read_store(db) as store:
        config = store.run_config(parse_library_ref(run_refs[0])[0])
    return config.model_copy(update={"db_path": db})


def _check_runs_in(db: str, refs: list[str]) -> None:
    """Every run an evaluation reads a library of is in ``db``: checked before anything is written there (a
    wrong database is one line, not an empty file left behind)."""
    from clgrpo.llm.adapters import split_condition
    from clgrpo.storage.state import holds

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
    prefect_defaults()
    from flows.evaluate import evaluate

    with session(config.db_path, args.eval_id or default_run_id("eval")):
        outcome = stopping.run_command(
            evaluate(config, evaluation, refs, eval_id=args.eval_id, train_dataset=train_dataset, fresh=args.fresh)
        )
    print_evaluation(outcome)
    if line := rollout_mode_line(config):
        print(line)
    return 0


def _arguments(ev: argparse.ArgumentParser) -> None:
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


EVAL = Command("eval", "Mean@k / Pass@k of libraries on a dataset, with confidence intervals", cmd_eval, _arguments)
