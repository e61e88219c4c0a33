"""The evaluation flow: Mean@k / Pass@k of one or more libraries on a dataset, with confidence intervals.

Each condition (a stored library version ``RUN_ID:VERSION`` / ``RUN_ID:latest``, a library file, or ``none``;
with hybrid learning also ``adapter:RUN_ID:STEP`` (the step's LoRA adapter, no library) and ``both:RUN_ID:STEP``
(the step's library and adapter), ``STEP`` also ``latest``) samples k rollouts per problem at the evaluation
temperature (its own setting, never the training one) with the library placed in the prompt exactly as in
training. All conditions get the same problems and the same per-(problem, sample) seeds, so the difference of
each condition to the first one is a paired comparison. Conditions are evaluated one after the other (one
library prefix at a time for the server's prefix cache), each in batch-sized task runs.

Before sampling, the leakage guard compares the evaluation problems with the training problems (``--train-dataset``
or the training set of a run whose library is evaluated); matches are logged with their ids, and
``refuse_on_leakage`` stops the run. Results go to DuckDB through the store in one stage write:
``(eval_id, 0, "evaluate")`` for a standalone evaluation, ``(run_id, step, "validate")`` for the held-out
validation inside a training run (``Validator``). A stored evaluation is read back, not recomputed.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_image_artifact, acreate_markdown_artifact, acreate_table_artifact

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.experience.retrieval import prompt_routing, route_library
from clgrpo.inputs.leakage import LeakageReport, check_leakage
from clgrpo.llm.adapters import (
    adapter_hash,
    adapter_step,
    check_adapter,
    resolve_adapter,
    resolve_policy_adapter,
    split_condition,
    with_adapter,
)
from clgrpo.process import progress, stopping
from clgrpo.process.errors import EvaluationError
from clgrpo.process.runtime import tune_gc
from clgrpo.reports import plots
from clgrpo.reports.report import (
    collect_run,
    evaluation_markdown,
    evaluation_table,
    markdown_table,
    run_plots,
    step_table,
    write_plots,
)
from clgrpo.storage.connection import StoreError
from clgrpo.storage.journal import RunJournal, StageItems
from clgrpo.storage.run_lock import RunLock
from clgrpo.storage.state import remember_db
from clgrpo.storage.store import Store, parse_library_ref
from domains import domain_for
from flows.stages import StageRunner
from schemas.config import DatasetConfig, EvalConfig, ModelConfig, RunConfig
from schemas.config_migrations import not_fingerprinted, result_settings
from schemas.records import EvalComparison, EvalSample, EvalSummary, LLMCall, Problem, Sample, text_hash
from schemas.stages import Stage
from tasks.checkpoint import export_dir
from tasks.common import artifact_key, chunks
from tasks.evaluate import compare_by_tag, evaluate_task, summarize_condition
from tasks.load_dataset import log_oversize
from tasks.measure import Sampling, draw_keys, identity_of, model_payload, reusable, sample_seeds
from tasks.outputs import Evaluated
from tasks.preflight import check_policy
from tasks.verify import warm_verifier

NO_LIBRARY = "none"
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Condition:
    label: str  # unique within an evaluation
    ref: str  # as resolved: "none", a file path, RUN_ID:VERSION, adapter:RUN_ID:STEP or both:RUN_ID:STEP
    library: ExperienceLibrary
    adapter: str | None = None  # a LoRA adapter folder on the policy (adapter / both conditions)


@dataclass
class EvalOutcome:
    eval_id: str
    db_path: str
    summaries: list[EvalSummary]
    comparisons: list[EvalComparison] = field(default_factory=list)
    leakage: str = ""
    reused: bool = False  # read back from DuckDB instead of sampled
    drawn: str = ""  # read back: when its samples were drawn and by which model (``drawn_line``)

    @property
    def overall(self) -> list[EvalComparison]:
        """The comparisons over all problems (``comparisons`` also holds one per task tag)."""
        return [c for c in self.comparisons if c.tag is None]


# --- inputs -------------------------------------------------------------------------------------------
def resolve_library(store: Store, ref: str) -> Condition:
    """``none``, a library file, or ``RUN_ID[:VERSION|:latest]`` stored in DuckDB."""
    if ref.strip().lower() == NO_LIBRARY:
        return Condition(NO_LIBRARY, NO_LIBRARY, ExperienceLibrary())
    path = Path(ref)
    if path.is_file():
        return Condition(path.name, str(path), ExperienceLibrary.load(path))
    run_id, version = parse_library_ref(ref)
    if not store.library_versions(run_id):
        raise StoreError(f"library reference {ref!r}: no such file, and {store.path} has no library for run {run_id!r}")
    library = store.load_library(run_id, version)
    resolved = f"{run_id}:{library.version}"
    return Condition(resolved, resolved, library)


def resolve_condition(store: Store, ref: str, policy: ModelConfig | None = None) -> Condition:
    """A library reference, or ``adapter:RUN:STEP`` / ``both:RUN:STEP`` (the adapter checked against
    ``policy``'s base model when given)."""
    kind, rest = split_condition(ref)
    if kind is None:
        return resolve_library(store, ref)
    folder = resolve_adapter(rest, store)
    if policy is not None:
        if policy.backend == "openai":
            raise EvaluationError(
                f"condition {ref!r}: an adapter needs a local policy (backend transformers or "
                f"vllm), not the endpoint of {policy.model!r}"
            )
        if policy.backend == "transformers":
            check_adapter(folder, policy)
    step = adapter_step(folder)
    run_id = rest.partition(":")[0]
    label = f"{kind}:{run_id}:{step}" if step is not None and ":" in rest else f"{kind}:{Path(folder).name}"
    library = ExperienceLibrary()
    if kind == "both":
        if step is None or not store.library_versions(run_id):
            raise EvaluationError(
                f"condition {ref!r}: both needs a stored run's adapter (RUN_ID:STEP), whose "
                f"library of the same step is evaluated with it"
            )
        library = store.load_library(run_id, step)
    return Condition(label, label, library, folder)


def resolve_conditions(store: Store, refs: list[str], policy: ModelConfig | None = None) -> list[Condition]:
    if not refs:
        raise EvaluationError("nothing to evaluate: give at least one library reference (or 'none')")
    conditions, seen = [], set()
    for ref in refs:
        c = resolve_condition(store, ref, policy)
        label, n = c.label, 1
        while label in seen:  # the same library twice (e.g. none vs none): still two conditions
            n += 1
            label = f"{c.label}#{n}"
        seen.add(label)
        conditions.append(Condition(label, c.ref, c.library, c.adapter))
    return conditions


def dataset_label(cfg: DatasetConfig) -> str:
    return cfg.path or f"{cfg.hf_name}:{cfg.hf_split}"


def load_domain_problems(config: RunConfig, dataset: DatasetConfig) -> list[Problem]:
    problems, report = domain_for(config).load_dataset(dataset)
    if report.n_duplicates_dropped:
        get_run_logger().warning(
            "%s: dropped %d duplicate problem(s): %s",
            report.source,
            report.n_duplicates_dropped,
            ", ".join(report.dropped_ids[:20]),
        )
    log_oversize(report)
    return problems


def guard_leakage(train: list[Problem], problems: list[Problem], evaluation: EvalConfig) -> LeakageReport:
    """Log the overlap of the evaluation set with the training set (ids); refuse it when configured."""
    report = check_leakage(train, problems, threshold=evaluation.leakage_threshold, refuse=evaluation.refuse_on_leakage)
    log = get_run_logger()
    (log.warning if report else log.info)(report.message())
    return report


LATER_PROBLEM_FIELDS = ("domain_tag", "tag", "answer_source")  # fingerprinted only when set
LATER_DATASET_FIELDS = ("answer_source_field", "answers_optional")  # fingerprinted only when not the default


def _problem_payload(problem: Problem) -> dict:
    """A problem as fingerprinted: fields added later count only when set (older evaluations keep theirs)."""
    return problem.model_dump(exclude={name for name in LATER_PROBLEM_FIELDS if getattr(problem, name) is None})


def eval_fingerprint(
    config: RunConfig,
    evaluation: EvalConfig,
    conditions: list[Condition],
    problems: list[Problem],
    *,
    legacy: bool = False,
    template: bool = True,
) -> str:
    """What shapes the results: policy (its identity too, where its endpoint states one or ``revision`` is set),
    domain, the rollout prompt's template, sampling and CI settings, the libraries and the problems. Read back,
    never written: ``legacy``, as stored before the transport fields were left out; ``template`` False, as stored
    before the template counted."""
    payload: dict[str, Any] = {
        "policy": model_payload(config.policy, None if legacy else not_fingerprinted(ModelConfig, kept_by_runs=True)),
        "domain": config.domain,
        # the tag column counts through the problems' tags (below)
        "evaluation": evaluation.model_dump(
            mode="json",
            exclude={
                "chunk_size": True,
                "leakage_threshold": True,
                "refuse_on_leakage": True,
                "every_n_steps": True,
                "dataset": {"tag_field"},
            },
        ),
        "conditions": [
            [c.label, c.library.content_hash(), *([adapter_hash(c.adapter)] if c.adapter else [])] for c in conditions
        ],
        "problems": text_hash(json.dumps([_problem_payload(p) for p in problems], sort_keys=True)),
    }
    dataset = payload["evaluation"].get("dataset")
    for key in LATER_DATASET_FIELDS:
        if isinstance(dataset, dict) and dataset.get(key) == DatasetConfig.model_fields[key].default:
            del dataset[key]
    if (agent := result_settings(config.rollout).get("agent")) is not None:  # direct evaluations keep theirs
        payload["agent"] = agent
    if (routing := prompt_routing(config)) is not None:  # whole-library prompts keep their fingerprint
        payload["routing"] = routing
    if template:
        payload["template"] = template_fingerprint(config)
    if (identity := identity_of(config.policy)) is not None:  # a model known by its name only keeps its fingerprint
        payload["identity"] = identity
    return text_hash(json.dumps(payload, sort_keys=True))


_PROBE = Problem(problem_id="probe", problem="What is 1 + 1?", answer="2")


def template_fingerprint(config: RunConfig) -> str:
    """The rollout prompt's template, as it renders a fixed problem with a fixed lesson: another template (a
    changed prompt module, another domain) is another evaluation."""
    library = ExperienceLibrary.from_mapping({"G0": "Check the answer before writing it down."})
    return text_hash(
        json.dumps(
            domain_for(config).rollout_messages(_PROBE, library.prompt_text_for(_PROBE.problem_id)), sort_keys=True
        )
    )


# --- the evaluation itself (shared by the flow and the training validation) -----------------------------------
@dataclass(frozen=True)
class Reads:
    """What an evaluation reads instead of drawing, known before it samples: ``read`` of ``total`` samples (stored
    by any earlier measurement of the database, drawn by an identical condition of this evaluation, or journaled
    by a stopped run of it), and those stored (``stored``: which model drew them, and when)."""

    total: int
    read: int
    stored: list[Sample] = field(default_factory=list)

    @property
    def to_draw(self) -> int:
        return self.total - self.read


async def evaluate_conditions(
    config: RunConfig,
    evaluation: EvalConfig,
    problems: list[Problem],
    conditions: list[Condition],
    *,
    key: str,
    eval_id: str,
    fingerprint: str,
    leaked_ids: list[str],
    store: Store | None = None,
    resume: bool = False,
    fresh: bool = False,
    planned: Callable[[Reads], None] | None = None,
) -> Evaluated:
    """Sample and grade every condition, summarize each, compare each to the first: the stage's output. Each
    problem's prompt shows the experiences routed to it as in training (``clgrpo.experience.retrieval``; embeddings
    cached in ``store`` when given). ``resume``: graded samples go to the active work journal and are read back from
    it (keyed by ``fingerprint``). ``fresh``: nothing stored in ``store`` is read (every sample drawn anew; an
    identical condition still reads this evaluation's). ``planned`` hears, before any sample is drawn, how many
    will be read and how many drawn (those read are counted on the progress bar then, not as they are read)."""
    samples: dict[str, list[EvalSample]] = {}
    calls: list[LLMCall] = []
    routed = [await route_library(config, store, c.library, problems) for c in conditions]
    policies = [with_adapter(config, c.adapter) if c.adapter else config for c in conditions]
    keys = [_keys(policy, evaluation, library, problems) for policy, library in zip(policies, routed)]
    wanted = [k for condition_keys in keys for k in condition_keys.values()]
    stored = {} if fresh or store is None else store.reusable_samples(wanted)
    reads = _reads(keys, stored, fingerprint if resume else None)
    if planned is not None:
        planned(reads)
    drawn: dict[str, Sample] = {}  # this evaluation's samples by draw key: a condition identical to another reads them
    for condition, library, policy, condition_keys in zip(conditions, routed, policies, keys):
        known = _known_samples(condition_keys, stored, drawn)
        batches = await asyncio.gather(
            *[
                evaluate_task(
                    policy,
                    evaluation,
                    key,
                    condition.label,
                    i,
                    chunk,
                    library.to_version(),
                    fingerprint if resume else "",
                    {k: s for p in chunk for k, s in known.get(p.problem_id, {}).items()},
                    count_read=planned is None,
                )
                for i, chunk in enumerate(chunks(problems, evaluation.chunk_size))
            ]
        )
        batch = Evaluated.joined(batches)
        samples[condition.label] = batch.eval_results
        drawn |= reusable(batch.eval_results)
        calls += batch.llm_calls
    problem_ids = [p.problem_id for p in problems]
    summaries = [
        summarize_condition(
            samples[c.label],
            problem_ids,
            evaluation,
            eval_id=eval_id,
            condition=c.label,
            library_ref=c.ref,
            library=c.library,
            dataset=dataset_label(evaluation.dataset),
            fingerprint=fingerprint,
            leaked_ids=leaked_ids,
        )
        for c in conditions
    ]
    baseline = conditions[0].label
    comparisons = [
        cmp
        for c in conditions[1:]  # overall, then per task tag
        for cmp in compare_by_tag(
            (baseline, samples[baseline]), (c.label, samples[c.label]), problems, evaluation, eval_id=eval_id
        )
    ]
    return Evaluated(summaries, [s for c in conditions for s in samples[c.label]], comparisons, calls)


def _keys(
    config: RunConfig, evaluation: EvalConfig, library: ExperienceLibrary, problems: list[Problem]
) -> dict[tuple[str, int], str]:
    """The draw key of each (problem, sample index) of a condition."""
    sampling = Sampling.of(config, evaluation.temperature)
    seeds = sample_seeds(problems, evaluation.seed)
    return draw_keys(problems, library, evaluation.k, seeds, sampling, domain_for(config))


def _reads(keys: list[dict[tuple[str, int], str]], stored: dict[str, Sample], resume_key: str | None) -> Reads:
    """What the conditions (their draw keys, in order) will read: a stored sample, one an earlier condition of this
    evaluation draws, or one a stopped run of it journaled (``resume_key``: the evaluation's fingerprint)."""
    journal = StageItems(Stage.EVALUATE, Sample, always=True) if resume_key else None
    earlier: set[str] = set()
    read, total = 0, 0
    for condition_keys in keys:
        for key in condition_keys.values():
            total += 1
            journaled = journal is not None and journal.get(f"{resume_key}|{key}") is not None
            read += key in stored or key in earlier or journaled
        earlier |= set(condition_keys.values())
    shown = {k: stored[k] for condition_keys in keys for k in condition_keys.values() if k in stored}
    return Reads(total, read, list(shown.values()))


def _known_samples(
    keys: dict[tuple[str, int], str], stored: dict[str, Sample], drawn: dict[str, Sample]
) -> dict[str, dict[str, Sample]]:
    """Per problem id, the samples already drawn with this condition's draw keys: by this evaluation (an identical
    condition) or stored in the database by any earlier evaluation, trial or gate."""
    by_problem: dict[str, dict[str, Sample]] = {}
    for (pid, _), key in keys.items():
        if (found := drawn.get(key) or stored.get(key)) is not None:
            by_problem.setdefault(pid, {})[key] = found
    return by_problem


def drawn_line(samples: Sequence[Sample]) -> str:
    """When ``samples`` were drawn and by which model: ``160 drawn 2026-11-30 14:02-14:05 UTC by 'local' [...]``,
    one part per model identity (those stored before identities were recorded said as much)."""
    by_model: dict[str | None, list[Sample]] = {}
    for s in samples:
        by_model.setdefault(s.model_identity, []).append(s)
    parts = []
    for model, group in by_model.items():
        times = sorted(s.drawn_at for s in group if s.drawn_at is not None)
        when = f" {_span(times[0], times[-1])}" if times else ""
        who = f"by {model}" if model is not None else "before model identities were recorded"
        parts.append(f"{len(group)} drawn{when} {who}")
    return "; ".join(parts)


def _span(first: datetime, last: datetime) -> str:
    """``2026-11-30 14:02-14:05 UTC`` (to the minute; a span over midnight names both days)."""
    start, end = f"{first:%Y-%m-%d %H:%M}", f"{last:%Y-%m-%d %H:%M}"
    if start == end:
        return f"{start} UTC"
    return f"{start}-{end[11:] if start[:10] == end[:10] else end} UTC"


def _planner(journal: RunJournal, eval_id: str, fingerprint: str, fresh: bool) -> Callable[[Reads], None]:
    """What an evaluation says before it draws a sample: how many a stopped run of it journaled, how many it reads
    and how many it draws; its progress bar starts with those read."""
    log = get_run_logger()

    def planned(reads: Reads) -> None:
        if found := journal.step(0).items(Stage.EVALUATE, prefix=f"{fingerprint}|"):
            total = reads.total
            log.info("resuming evaluation %s: %d of %d samples stored, %d to go", eval_id, found, total, total - found)
        stored = f" ({drawn_line(reads.stored)})" if reads.stored else ""
        fresh_note = " (--fresh: nothing stored is read)" if fresh else ""
        log.info(
            "evaluation %s: %d samples, %d read%s, %d to draw%s",
            eval_id,
            reads.total,
            reads.read,
            stored,
            reads.to_draw,
            fresh_note,
        )
        progress.start(0, Stage.EVALUATE, reads.total, f"samples ({reads.read} read, {reads.to_draw} to draw)")
        progress.advance(Stage.EVALUATE, reads.read)

    return planned


# --- artifacts ----------------------------------------------------------------------------------------
async def publish_evaluation(
    key: str, summaries: list[EvalSummary], comparisons: list[EvalComparison], notes: list[str], description: str
) -> None:
    """Table + markdown artifacts of an evaluation, and its Mean@k plot (CI per condition) as an image."""
    headers, rows = evaluation_table(summaries)
    await acreate_table_artifact(
        [dict(zip(headers, row)) for row in rows], key=artifact_key(key, "evaluation"), description=description
    )
    await acreate_markdown_artifact(
        evaluation_markdown(summaries, comparisons, notes),
        key=artifact_key(key, "evaluation-report"),
        description=description,
    )
    points = [plots.ConditionPoint(s.condition, s.mean_at_k, s.mean_ci_low, s.mean_ci_high) for s in summaries]
    png = plots.conditions_plot(f"Mean@{summaries[0].k}", points)
    await acreate_image_artifact(
        plots.data_uri(png),
        key=artifact_key(key, "evaluation-plot"),
        description=f"{description}: Mean@k with {summaries[0].ci_level:.0%} CI",
    )


async def publish_run_report(store: Store, config: RunConfig) -> dict[str, Path]:
    """The step table as a markdown artifact; with ``config.plots`` also the run's plots (accuracy with CI,
    library size, tokens/cost per step) as PNGs next to the run's exported libraries and as image artifacts."""
    run_id = config.require_run_id()
    data = collect_run(store, run_id)
    await acreate_markdown_artifact(
        markdown_table(step_table(data)),
        key=artifact_key(run_id, "learning-curve"),
        description="Per step: accuracy and held-out Mean@k with CIs, library, cost",
    )
    if not config.plots:
        return {}
    images = run_plots(data)
    files = write_plots(images, export_dir(config) / "plots")
    for name, png in images.items():
        await acreate_image_artifact(
            plots.data_uri(png),
            key=artifact_key(run_id, f"plot-{name}"),
            description=f"{run_id}: {name.replace('_', ' ')} per step",
        )
    get_run_logger().info("plots written to %s", files["accuracy"].parent)
    return files


# --- validation during training --------------------------------------------------------------------------
class Validator:
    """Held-out evaluation inside a training run (``config.validation``): step 0 is the baseline before
    training, then every N steps and the last step. Rows are keyed by (run_id, step, "validate")."""

    def __init__(self, config: RunConfig, train_problems: list[Problem], store: Store | None = None) -> None:
        if config.validation is None:
            raise EvaluationError("validation is not configured")
        self.config, self.evaluation, self.store = config, config.validation, store
        self.problems = load_domain_problems(config, config.validation.dataset)
        self.leakage = guard_leakage(train_problems, self.problems, config.validation)

    def due(self, step: int, last_step: int) -> bool:
        return step == 0 or step % self.evaluation.every_n_steps == 0 or step == last_step

    async def compute(self, step: int, library: ExperienceLibrary) -> Evaluated:
        ref = f"{self.config.run_id}:{library.version}"
        fingerprint = text_hash(self.config.fingerprint() + library.content_hash())
        return await evaluate_conditions(
            self.config,
            self.evaluation,
            self.problems,
            [Condition(ref, ref, library)],
            key=f"{self.config.run_id}/{step}",
            eval_id=f"{self.config.run_id}-step{step}",
            fingerprint=fingerprint,
            leaked_ids=self.leakage.eval_ids,
            store=self.store,
        )

    async def publish(self, step: int, outputs: Evaluated) -> None:
        summary = outputs.evaluations[0]
        get_run_logger().info(
            "step %d validation: Mean@%d %.3f [%.3f, %.3f], Pass@%d %.3f [%.3f, %.3f] on %d held-out problems "
            "(library %d)",
            step,
            summary.k,
            summary.mean_at_k,
            summary.mean_ci_low,
            summary.mean_ci_high,
            summary.pass_k,
            summary.pass_at_k,
            summary.pass_ci_low,
            summary.pass_ci_high,
            summary.n_problems,
            summary.library_size,
        )
        notes = [self.leakage.message()] if self.leakage else []
        await publish_evaluation(
            f"{self.config.run_id}-validation", [summary], [], notes, f"Held-out validation after step {step}"
        )


# --- the standalone flow ----------------------------------------------------------------------------------
def example_problems(conditions: Sequence[Condition]) -> list[Problem]:
    """The problems the evaluated libraries' worked examples solve, as training problems for the leakage guard
    (an example whose problem is a near-duplicate of an evaluated one shows its answer): ids
    ``<condition>:<example id>``."""
    return [
        Problem(problem_id=f"{c.label}:{e.id}", problem=e.example.problem, answer=e.example.answer)
        for c in conditions
        for e in c.library.examples
        if e.example is not None
    ]


def _training_problems(
    store: Store, config: RunConfig, conditions: list[Condition], train_dataset: DatasetConfig | None
) -> list[Problem] | None:
    """The explicit training set, else the training set of the first evaluated run; None if neither."""
    if train_dataset is not None:
        return load_domain_problems(config, train_dataset)
    log = get_run_logger()
    for c in conditions:
        ref = split_condition(c.ref)[1]
        run_id = ref.partition(":")[0]
        if ref != NO_LIBRARY and not Path(ref).is_file() and store.is_run(run_id):
            try:
                return load_domain_problems(config, store.run_config(run_id).dataset)
            except (OSError, ValueError) as exc:
                log.warning(
                    "leakage guard: cannot load the training set of run %r (%s); pass --train-dataset", run_id, exc
                )
                return None
    log.info("leakage guard: no training set given (--train-dataset) and no stored run evaluated; skipped")
    return None


def _eval_id(store: Store, given: str | None, default: str, fresh: bool) -> str:
    """The evaluation's id: ``given``, else ``default`` or, where ``--fresh`` drew it again, its latest draw
    (``default-2``, ...). ``fresh``: the first of those not stored yet; a given id already stored is refused (a
    fresh evaluation is stored beside the earlier ones, never over them)."""
    if given is not None:
        if not _ID_RE.match(given) or store.is_run(given):
            raise EvaluationError(f"eval id {given!r}: use letters, digits, '_', '.', '-' and not a training run id")
        if fresh and store.stage_done(given, 0, Stage.EVALUATE):
            raise EvaluationError(
                f"eval id {given!r} is already stored: --fresh stores its evaluation beside it, never over it; "
                "leave --eval-id out (the next free id is taken) or name another"
            )
        return given
    stored = store.evaluation_draws(default)
    if not fresh:
        return stored[-1] if stored else default
    taken = set(stored)
    return next(name for n in range(1, len(taken) + 2) if (name := _nth(default, n)) not in taken)


def _nth(default: str, n: int) -> str:
    return default if n == 1 else f"{default}-{n}"


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    return f"evaluate-{flow_run.parameters.get('eval_id') or 'auto'}"


@flow(
    name="evaluate",
    flow_run_name=_flow_run_name,
    persist_result=True,
    log_prints=True,
    on_crashed=[stopping.cancelled_not_crashed],
)
async def evaluate(
    config: RunConfig,
    evaluation: EvalConfig,
    libraries: list[str],
    eval_id: str | None = None,
    train_dataset: DatasetConfig | None = None,
    fresh: bool = False,
) -> EvalOutcome:
    """Evaluate libraries on ``evaluation.dataset`` with the policy of ``config`` (DuckDB: ``config.db_path``).
    The first library is the baseline of the paired comparisons. An evaluation stored with the same inputs (the
    model's identity among them) is read back; ``fresh``: every sample is drawn anew instead, nothing stored is
    read, and the evaluation is stored beside the earlier ones (the default id gets ``-2``, ``-3``, ...; a later
    evaluation without ``fresh`` reads back the latest)."""
    tune_gc()
    return await stopping.flow_body(partial(_evaluate, config, evaluation, libraries, eval_id, train_dataset, fresh))


async def _evaluate(
    config: RunConfig,
    evaluation: EvalConfig,
    libraries: list[str],
    eval_id: str | None,
    train_dataset: DatasetConfig | None,
    fresh: bool = False,
) -> EvalOutcome:
    log = get_run_logger()
    stopping.note_stage("evaluation")
    warm_verifier(config.domain)  # starts while the endpoint is checked
    config = await check_policy(config)  # the endpoint answers and serves the model, before any sampling
    remember_db(config.db_path)  # later commands find a deployment run's database as a CLI run's
    with Store(config.db_path) as store:
        config = resolve_policy_adapter(config, store)  # policy.adapter RUN:STEP -> its folder, checked
        conditions = resolve_conditions(store, libraries, config.policy)
        problems = load_domain_problems(config, evaluation.dataset)
        train = _training_problems(store, config, conditions, train_dataset)
        if shown := example_problems(conditions):  # a worked example's problem counts as trained on
            train = [*(train or []), *shown]
        leakage = guard_leakage(train, problems, evaluation) if train is not None else None
        fingerprint = eval_fingerprint(config, evaluation, conditions, problems)
        eval_id = _eval_id(store, eval_id, f"eval-{fingerprint}", fresh)
        with RunLock(config.db_path, "eval", eval_id):  # one live process per evaluation id and database
            earlier = {
                eval_fingerprint(config, evaluation, conditions, problems, legacy=legacy, template=False)
                for legacy in (False, True)
            }
            reused = store.stage_done(eval_id, 0, Stage.EVALUATE)  # never with ``fresh`` (``_eval_id``)
            journal = RunJournal.open(store.path, store.db_id, eval_id)
            compute = partial(  # every graded sample journaled: a stopped evaluation resumes where it was
                evaluate_conditions,
                config,
                evaluation,
                problems,
                conditions,
                key=eval_id,
                eval_id=eval_id,
                fingerprint=fingerprint,
                leaked_ids=leakage.eval_ids if leakage else [],
                store=store,
                resume=True,
                fresh=fresh,
                planned=_planner(journal, eval_id, fingerprint, fresh),
            )
            try:  # the journal keeps its calls; the graded samples: see evaluate_library
                outputs = await StageRunner(store, eval_id, log, journal).run(
                    0, Stage.EVALUATE, Evaluated, compute, where=f"evaluation {eval_id}", journals_items=False
                )
            finally:
                journal.close()
            journal.discard()
            if any(s.fingerprint not in {fingerprint, *earlier} for s in outputs.evaluations):
                raise EvaluationError(
                    f"evaluation id {eval_id!r} already holds a different evaluation (other libraries, "
                    "dataset, model or settings) in this database: choose another eval id"
                )
    notes = [leakage.message()] if leakage is not None else []
    await publish_evaluation(
        eval_id,
        outputs.evaluations,
        outputs.eval_comparisons,
        notes,
        f"Evaluation {eval_id} on {dataset_label(evaluation.dataset)}",
    )
    return EvalOutcome(
        eval_id,
        config.db_path,
        outputs.evaluations,
        outputs.eval_comparisons,
        leakage.message() if leakage is not None else "leakage guard skipped (no training set)",
        reused,
        drawn_line(outputs.eval_results) if reused else "",
    )
