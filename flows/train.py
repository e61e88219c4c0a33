"""The training flow: epochs x batches of steps, each step the stages ``STEP`` lists, then its checkpoint.

``STEP`` is the step as data, read top to bottom: each stage, the function that computes it, its typed output
(the tables it writes, which the ``StepState`` holds for the later stages), its failure rule, its progress bar's
items, whether the config runs it, and for rollout to group advantage the per-group form the pipeline chains
(``pipeline: true``). ``Trainer.run_step`` walks it; the checkpoint (``tasks.checkpoint``) closes the step.

The flow is its run's only DuckDB writer (the run lock, ``clgrpo.run_lock``). Each stage's output is written in
one transaction keyed by (run_id, step, stage); a stage already in the store is read back instead of
recomputed, so rerunning a run id after a crash continues where it stopped (no duplicate rollouts, no operation
applied twice). Within a stage, every model call and finished item is appended to the step's work journal as it
completes (``clgrpo.journal``), so a UI "Retry" or a rerun of a failed or killed stage redoes only its failed
items, and every request sent is accounted in ``llm_calls``. A stage whose failed items exceed
``tolerance.max_failed_fraction`` is not stored as done (``tasks.integrity``). A run id is bound to its config:
a changed config under the same id is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    acreate_progress_artifact,
    aupdate_progress_artifact,
)

from clgrpo import progress, stopping
from clgrpo.adapters import resolve_policy_adapter
from clgrpo.errors import error_line
from clgrpo.journal import RunJournal, recording
from clgrpo.library import ExperienceLibrary, NearDuplicates
from clgrpo.llm import LLMCallError
from clgrpo.llm.local import release_engines
from clgrpo.retrieval import route_library
from clgrpo.run_lock import RunLock
from clgrpo.runtime import tune_gc
from clgrpo.stale_runs import mark_stale_runs_crashed
from clgrpo.state import remember_db
from clgrpo.store import Store
from clgrpo.usefulness import step_stats
from clgrpo.words import counted
from domains.guard import LessonGuard
from flows.evaluate import EVAL_TABLES, Validator, publish_run_report
from schemas.config import RunConfig
from schemas.records import (
    AdapterVersion,
    ExperienceStat,
    GateDecision,
    GroupAdvantage,
    LessonTrial,
    LibraryVersion,
    Operation,
    OpStatus,
    Problem,
    Proposal,
    Reward,
    Rollout,
    Summary,
)
from schemas.stages import Stage
from tasks.apply_operations import apply_operations_task, apply_plan, near_duplicates_for
from tasks.checkpoint import StepCheckpoint, StepReport, checkpoint_step, export_dir, export_library, step_report
from tasks.common import artifact_key, chunks
from tasks.consolidate import consolidate_task, consolidation_calls
from tasks.group_advantage import group_advantage_task
from tasks.integrity import (
    GATE_FAILURES,
    PROPOSAL_FAILURES,
    ROLLOUT_FAILURES,
    SUMMARY_FAILURES,
    TRIAL_FAILURES,
    VALIDATION_FAILURES,
    VERIFY_FAILURES,
    BudgetExhaustedError,
    FailedItems,
    FailureRule,
    StageFailedError,
    stage_failed_message,
)
from tasks.library_gate import GATE_OFF, describe_split, library_gate_task, split_for_gate
from tasks.limits import Limited, limit_plan, limit_proposals, plan_bound, rejected_results
from tasks.load_dataset import load_dataset_task
from tasks.numeric_update import numeric_inputs, numeric_update_task
from tasks.outputs import (
    Adapters,
    Applied,
    Gate,
    GroupProposals,
    Out,
    Plans,
    Rollouts,
    StageOutput,
    Summaries,
    Trials,
    Verified,
)
from tasks.pipeline import (
    GroupStage,
    PipelineBatch,
    pipeline_task,
    propose_group,
    rollout_group,
    summarize_group,
    verify_group,
)
from tasks.preflight import check_run
from tasks.rollout import rollout_task
from tasks.shorten import shorten_plan_task
from tasks.summarize import summarize_task
from tasks.validate_lessons import Rejected, StepDraws, plan_after, validate_lessons_task
from tasks.verify import verify_task, warm_verifier

Outputs = dict[str, list[Any]]


@dataclass
class TrainResult:
    run_id: str
    db_path: str
    final_version: int
    library_size: int
    export_dir: str
    steps: list[StepReport] = field(default_factory=list)
    stopped: str | None = None  # why the run stopped before its last step (a budget), else None
    gate: list[str] = field(default_factory=list)  # what the library gate did, line by line (``gate_lines``)


@dataclass(frozen=True)
class PlannedStep:
    step: int
    epoch: int
    problems: list[Problem]


def plan_steps(
    problems: list[Problem], *, epochs: int, batch_size: int, seed: int, max_steps: int | None = None
) -> list[PlannedStep]:
    """Epoch 0 keeps the dataset's (already seeded) order; later epochs reshuffle with a derived seed.
    ``max_steps`` cuts the plan after that many steps."""
    steps, number = [], 0
    for epoch in range(epochs):
        order = list(problems)
        if epoch > 0:
            random.Random(seed * 1009 + epoch).shuffle(order)
        for start in range(0, len(order), batch_size):
            number += 1
            steps.append(PlannedStep(number, epoch, order[start : start + batch_size]))
    return steps[:max_steps]


# --- one step, as data ---------------------------------------------------------------------------------------
@dataclass
class StepState:
    """What one step knows, filled stage by stage: each stage's typed output (``tasks.outputs``), computed or read
    back from the store, is held by its type (``get``); later stages read it from here."""

    cfg: RunConfig
    step: int
    problems: list[Problem]
    library: ExperienceLibrary  # before the step
    version: LibraryVersion  # what each prompt shows (``clgrpo.retrieval``)
    sampling: RunConfig  # what rollouts sample with: the config, or with hybrid learning the latest adapter
    pipelined: PipelineBatch | None = None  # rollout .. group advantage, computed group by group, to store
    outputs: dict[type[StageOutput], StageOutput] = field(default_factory=dict)
    applied: LibraryVersion | None = None  # the library after apply_operations, saved before its rows

    def get(self, kind: type[Out]) -> Out:
        """The output of the stage that produces ``kind`` (empty when that stage did not run this step)."""
        found = self.outputs.get(kind)
        return found if isinstance(found, kind) else kind()

    @property
    def rollouts(self) -> list[Rollout]:
        return self.get(Rollouts).rollouts

    @property
    def rewards(self) -> list[Reward]:
        return self.get(Verified).rewards

    @property
    def advantages(self) -> list[GroupAdvantage]:
        """The numeric advantage of every group: verify's second table."""
        return self.get(Verified).group_advantages

    @property
    def adapters(self) -> list[AdapterVersion]:
        return self.get(Adapters).adapters

    @property
    def summaries(self) -> list[Summary]:
        return self.get(Summaries).summaries

    @property
    def proposals(self) -> list[Proposal]:
        """The semantic group advantage."""
        return self.get(GroupProposals).proposals

    @property
    def plans(self) -> list[Proposal]:
        """The consolidation's."""
        return self.get(Plans).proposals

    @property
    def trials(self) -> list[LessonTrial]:
        return self.get(Trials).lesson_trials

    @property
    def gates(self) -> list[GateDecision]:
        """The library gate's decision (one, when it runs)."""
        return self.get(Gate).library_gates

    @property
    def rollout_chunks(self) -> list[list[Problem]]:
        return chunks(self.problems, self.cfg.grpo.rollout_chunk_size)

    @property
    def selected_ids(self) -> list[str]:
        """The groups with a learning signal, in group order."""
        return [a.problem_id for a in self.advantages if a.selected]

    def rollouts_of(self, ids: list[str]) -> list[Rollout]:
        wanted = set(ids)
        return [r for r in self.rollouts if r.problem_id in wanted]

    def summaries_of(self, ids: list[str]) -> list[Summary]:
        wanted = set(ids)
        return [x for x in self.summaries if x.problem_id in wanted]

    def chunk_inputs(self, ids: list[str]) -> dict[str, Any]:
        """The problems, rollouts, rewards and advantages of the groups ``ids``, for a learner task."""
        wanted = set(ids)
        return dict(
            problems=[p for p in self.problems if p.problem_id in wanted],
            rollouts=[r for r in self.rollouts if r.problem_id in wanted],
            rewards=[r for r in self.rewards if r.problem_id in wanted],
            advantages=[a for a in self.advantages if a.problem_id in wanted],
        )

    @cached_property  # read after group_advantage filled ``proposals`` (consolidate, validate, apply)
    def limited(self) -> tuple[list[Proposal], list[tuple[Operation, str]]]:
        """The group proposals within ``learning.max_ops_per_group``, and the operations over it."""
        return limit_proposals(self.proposals, self.cfg.learning)

    @cached_property  # read after consolidate filled ``plans``
    def plan(self) -> Limited:
        """The consolidation's final plan within its bound and ``learning.max_ops_per_step``."""
        bound = plan_bound(self.limited[0], len(self.library))
        return limit_plan(self.get(Plans).operations, bound=bound, cfg=self.cfg.learning)

    @property
    def validated(self) -> tuple[list[Operation], list[tuple[Operation, str]]]:
        """The plan after lesson validation (off: the plan as it is), and what it rejected with the reasons."""
        if not self.cfg.learning.lesson_validation.enabled:
            return self.plan.operations, []
        return plan_after(self.trials)

    @property
    def adopted(self) -> tuple[list[Operation], list[tuple[Operation, str]]]:
        """What apply_operations applies: the validated plan, or nothing when the library gate rejected the step
        (its operations then rejected with the gate's numbers); and every rejection with its reason."""
        operations, rejected = self.validated
        if self.gates and self.gates[0].verdict == "rejected":
            return [], rejected + [(op, self.gates[0].reason) for op in operations]
        return operations, rejected


async def compute_rollout(t: Trainer, s: StepState) -> Rollouts:
    """G samples per problem, in chunks (``tasks.rollout``; ``rollout.placement: pool``: on the GPU pool)."""
    run_chunk = rollout_task
    if s.cfg.rollout.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
        from flows.rollout_gpu import rollout_on_pool

        run_chunk = partial(rollout_on_pool, db_id=t.store.db_id)
    parts = await asyncio.gather(
        *[run_chunk(s.sampling, s.step, i, c, s.version) for i, c in enumerate(s.rollout_chunks)]
    )
    return Rollouts.joined(parts)


async def compute_verify(t: Trainer, s: StepState) -> Verified:
    """Rewards, and from them the numeric group advantage of every group, (r - mean) / std over its graded
    samples (``tasks.verify``: ``numeric_group_advantages``): verify's two tables."""
    parts = await asyncio.gather(
        *[
            verify_task(s.cfg, s.step, i, c, s.rollouts_of([p.problem_id for p in c]))
            for i, c in enumerate(s.rollout_chunks)
        ]
    )
    return Verified.joined(parts)  # an LLM judge's calls come from the work journal


async def compute_numeric_update(t: Trainer, s: StepState) -> Adapters:
    """Hybrid learning's numeric GRPO step on the step's stored completions (``tasks.numeric_update``): in this
    process, or as a child run on the cuda pool (``hybrid.placement: pool``)."""
    inputs = numeric_inputs(s.cfg, s.problems, s.rollouts, s.advantages, s.version)
    run = numeric_update_task
    if s.cfg.hybrid.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
        from flows.numeric_gpu import numeric_update_on_pool

        run = partial(numeric_update_on_pool, db_id=t.store.db_id)
    parent = t.parent_adapter(s.step)
    record = await run(s.cfg, s.step, inputs.items, inputs.skipped, parent, s.version.version, str(export_dir(s.cfg)))
    return Adapters([record])


async def compute_summarize(t: Trainer, s: StepState) -> Summaries:
    """A summary of each usable rollout of the selected groups (``tasks.summarize``)."""
    parts = await asyncio.gather(
        *[
            summarize_task(s.cfg, s.step, i, library=s.version, **s.chunk_inputs(ids))
            for i, ids in enumerate(chunks(s.selected_ids, s.cfg.learning.summarize_chunk_size))
        ]
    )
    return Summaries.joined(parts)


async def compute_group_advantage(t: Trainer, s: StepState) -> GroupProposals:
    """The learner's proposal for each selected group (``tasks.group_advantage``)."""
    parts = await asyncio.gather(
        *[
            group_advantage_task(
                s.cfg,
                s.step,
                i,
                library=s.version,
                summaries=s.summaries_of(ids),
                **s.chunk_inputs(ids),
            )
            for i, ids in enumerate(chunks(s.selected_ids, s.cfg.learning.summarize_chunk_size))
        ]
    )
    return GroupProposals.joined(parts)


async def compute_consolidate(t: Trainer, s: StepState) -> Plans:
    """One plan from the group proposals (``tasks.consolidate``)."""
    plans = await consolidate_task(s.cfg, s.step, s.limited[0], s.version)
    if plans.failed:
        t.log.warning("step %d: consolidation reply unusable after repair; no operations this step", s.step)
    return plans


async def compute_validate_lessons(t: Trainer, s: StepState) -> Trials:
    """Candidate lessons tried on their problems (``tasks.validate_lessons``)."""
    plan, shorten_calls = await shorten_plan_task(s.cfg, s.step, s.plan.operations)  # too long: shortened once
    near, _ = await t.plan_context(s, plan)  # a candidate is tried as it would be applied
    drawn = StepDraws(
        s.rollouts if s.sampling.policy == s.cfg.policy else [],  # rollouts of another adapter are not the baseline
        s.rewards,
        t.store.records("trial_samples", t.run_id),
    )
    trials = await validate_lessons_task(
        s.cfg,
        s.step,
        s.version,
        plan,
        s.problems,
        s.advantages,
        t.learn_problems,
        near,
        t.ledger(s.step),
        drawn,
    )
    return replace(trials, llm_calls=shorten_calls + trials.llm_calls)


async def compute_library_gate(t: Trainer, s: StepState) -> Gate:
    """The library before vs after the validated plan on the problems set aside (``tasks.library_gate``);
    nothing when none could be set aside (``enabled: auto`` on a small training set: the run says so)."""
    if not t.gate_problems:
        return Gate()
    operations, _ = s.validated
    before = ExperienceLibrary.from_version(s.version)
    near, usefulness = await t.plan_context(s, operations)
    after, _ = apply_plan(s.cfg, s.step, before, operations, s.problems, near, usefulness)
    return await library_gate_task(
        s.cfg, s.step, s.version, after.to_version(), t.gate_problems, t.store.records("gate_samples", t.run_id)
    )


def log_library_gate(t: Trainer, s: StepState) -> None:
    if s.gates:
        t.log.info("step %d %s", s.step, s.gates[0].reason)


async def compute_apply_operations(t: Trainer, s: StepState) -> Applied:
    """The validated plan applied to the library (``tasks.apply_operations``) unless the library gate rejected
    the step; what is over a learning limit, failed its trial or was not adopted is stored as rejected."""
    operations, failed_trials = s.adopted
    near, usefulness = await t.plan_context(s, operations)
    applied = apply_operations_task(s.cfg, s.step, s.version, operations, s.problems, near, usefulness)
    s.applied = applied.library
    if over_limits := s.limited[1] + s.plan.over:
        t.log.warning(
            "step %d: %d operations over the learning limits rejected (first: %s)",
            s.step,
            len(over_limits),
            over_limits[0][1],
        )
    return replace(
        applied, operations=applied.operations + rejected_results(over_limits + failed_trials, len(applied.operations))
    )


def save_applied_library(t: Trainer, s: StepState) -> None:
    assert s.applied is not None  # compute_apply_operations set it
    t.store.save_library(t.run_id, ExperienceLibrary.from_version(s.applied))


def log_numeric_update(t: Trainer, s: StepState) -> None:
    record = s.adapters[0]
    t.log.info(
        "step %d numeric_update: %d completions (%d skipped), loss %s -> %s, mean log-prob change "
        "%s (positive advantage) / %s (negative), %.1fs on %s; adapter %s",
        s.step,
        record.rows_used,
        record.rows_skipped,
        _num(record.loss_before),
        _num(record.loss_after),
        _num(record.logprob_change_pos),
        _num(record.logprob_change_neg),
        record.seconds,
        record.device,
        record.path,
    )


def log_learning_signal(t: Trainer, s: StepState) -> None:
    """How many groups can teach anything (rewards that differ): said loudly when none can."""
    mixed, total = len(s.selected_ids), len(s.advantages)
    share = f"{mixed / total:.0%}" if total else "-"
    if mixed:
        t.log.info(
            "step %d: %d of %d groups have mixed rewards (%s): only they teach anything", s.step, mixed, total, share
        )
        return
    t.log.warning(
        "step %d: no group has mixed rewards (0 of %d): nothing to learn from this step; every attempt of a problem "
        "was graded alike. Harder or easier problems, more samples (grpo.group_size) or another "
        "grpo.rollout_temperature give the learner something to compare",
        s.step,
        total,
    )


def log_lesson_validation(t: Trainer, s: StepState) -> None:
    t.log.info(
        "step %d lesson validation: %s kept, %d rejected (clgrpo library ops %s:%d lists each with its numbers)%s",
        s.step,
        counted(sum(x.verdict == "kept" for x in s.trials), "candidate lesson"),
        sum(x.verdict == "rejected" for x in s.trials),
        t.run_id,
        s.step,
        "".join(f"; {x.reason}" for x in s.trials if x.verdict == "kept"),
    )


def _always(cfg: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class StepStage:
    """One stage of a step: ``compute`` runs only when the stage is neither stored (then its tables are read back)
    nor computed by the pipeline; ``output``: its typed output, whose fields are the tables it writes in one
    transaction and which the step state holds for the later stages; ``failures``: its failure rule (with the
    tolerance it may leave), None when its items cannot fail; ``expect``: the items and unit of its progress bar;
    ``when``: whether the config runs it; ``before_write`` and ``after``: what happens just before its rows are
    written, and once it is stored or read back; ``group``: its per-group form, for the stages the pipeline runs
    group by group (``tasks.pipeline``, with ``pipeline: true``), chained in ``STEP``'s order. ``stage`` is its
    name in the store (a ``Stage``, or any name for a stage added from outside)."""

    stage: str
    compute: Callable[[Trainer, StepState], Awaitable[StageOutput]]
    output: type[StageOutput]
    failures: FailureRule | None = None
    expect: Callable[[StepState], tuple[int, str]] | None = None
    when: Callable[[RunConfig], bool] = _always
    before_write: Callable[[Trainer, StepState], None] | None = None
    after: Callable[[Trainer, StepState], None] | None = None
    group: GroupStage | None = None


def _summaries_expected(s: StepState) -> tuple[int, str]:
    selected = set(s.selected_ids)
    n = sum(r.error is None and r.problem_id in selected for r in s.rollouts) if s.cfg.learning.summarize else 0
    return n, "summaries"


# The training step, top to bottom (then the checkpoint, ``tasks.checkpoint``: a step is done when it is stored).
STEP: tuple[StepStage, ...] = (
    StepStage(
        Stage.ROLLOUT,
        compute_rollout,
        Rollouts,
        ROLLOUT_FAILURES,
        expect=lambda s: (len(s.problems) * s.cfg.grpo.group_size, "samples"),
        group=rollout_group,
    ),
    StepStage(
        Stage.VERIFY,
        compute_verify,
        Verified,
        VERIFY_FAILURES,
        expect=lambda s: (len(s.rollouts), "samples"),
        after=log_learning_signal,
        group=verify_group,
    ),
    StepStage(
        Stage.NUMERIC_UPDATE,
        compute_numeric_update,
        Adapters,
        when=lambda cfg: cfg.hybrid.enabled,
        after=log_numeric_update,
    ),
    StepStage(
        Stage.SUMMARIZE,
        compute_summarize,
        Summaries,
        SUMMARY_FAILURES,
        expect=_summaries_expected,
        group=summarize_group,
    ),
    StepStage(
        Stage.GROUP_ADVANTAGE,
        compute_group_advantage,
        GroupProposals,
        PROPOSAL_FAILURES,
        expect=lambda s: (len(s.selected_ids), "groups"),
        group=propose_group,
    ),
    StepStage(
        Stage.CONSOLIDATE,
        compute_consolidate,
        Plans,
        expect=lambda s: (
            consolidation_calls(sum(bool(p.operations) for p in s.limited[0]), s.cfg.learning),
            "learner calls",
        ),
    ),
    StepStage(
        Stage.VALIDATE_LESSONS,
        compute_validate_lessons,
        Trials,
        TRIAL_FAILURES,
        when=lambda cfg: cfg.learning.lesson_validation.enabled,
        expect=lambda s: (0, "attempts"),  # the stage announces them once it knows its candidates
        after=log_lesson_validation,
    ),
    StepStage(
        Stage.LIBRARY_GATE,
        compute_library_gate,
        Gate,
        GATE_FAILURES,
        when=lambda cfg: cfg.learning.library_gate.enabled is not False,
        expect=lambda s: (0, "attempts"),  # announced once the stage knows whether the plan changes anything
        after=log_library_gate,
    ),
    StepStage(
        Stage.APPLY_OPERATIONS,
        compute_apply_operations,
        Applied,
        before_write=save_applied_library,
    ),
)
# the stages the pipeline runs group by group (``tasks.pipeline``): those with a per-group form
PIPELINED: tuple[str, ...] = tuple(spec.stage for spec in STEP if spec.group is not None)
STEP_STAGES: dict[str, StepStage] = {spec.stage: spec for spec in STEP}


class Trainer:
    def __init__(self, config: RunConfig, store: Store) -> None:
        self.cfg = config
        self.store = store
        self.run_id = config.require_run_id()  # train() sets one before the Trainer exists
        self.log = get_run_logger()
        self.journal = RunJournal.open(store.path, store.db_id, self.run_id)
        self.gate_problems: list[Problem] = []  # the library gate's own problems (learning.library_gate)
        self.gate_note = ""  # what the gate does in this run, in one line (set_aside)
        self.learn_problems: list[Problem] = []  # the rest: what steps and lesson trials draw from

    # --- the stage protocol: read back when done, else compute and write atomically -------------------
    async def stage(
        self,
        step: int,
        name: str,
        compute: Callable[[], Awaitable[Outputs]],
        tables: Sequence[str],
        before_write: Callable[[], None] | None = None,
        expect: Callable[[], tuple[int, str]] | None = None,
        computed: Outputs | None = None,
        failures: FailureRule | None = None,
        journals_items: bool = True,
    ) -> Outputs:
        """``expect``: (items, unit) the computation will report as it goes (the terminal's progress bar);
        ``computed``: the outputs when the pipeline computed them already (then they are only checked and written).
        The computation's calls (and, with ``journals_items``, its finished items) go to the step's work journal as
        they happen; the stage is stored only if its failed items (``failures``) are within their tolerance (else
        ``StageFailedError``)."""
        if self.store.stage_done(self.run_id, step, name):
            self.log.info("step %d %s: already stored, reading it back", step, name)
            return {t: self.store.records(t, self.run_id, step, name) for t in tables}
        stopping.note_stage(f"step {step} {name}" if step else name)
        if computed is None:
            computed = await self.compute_fresh(step, name, compute, expect, journals_items)
        outputs = dict(computed)
        if "llm_calls" in outputs:
            outputs["llm_calls"] = self.journal.step(step).all_calls(name, outputs["llm_calls"])
        if failures is not None:
            self.check_failures(step, failures.count(name, outputs))
        if before_write:
            before_write()
        self.store.write_stage(self.run_id, step, name, outputs)
        self.log.info("step %d %s: stored %s", step, name, describe_rows(outputs))
        return outputs

    async def compute_fresh(
        self,
        step: int,
        name: str,
        compute: Callable[[], Awaitable[Outputs]],
        expect: Callable[[], tuple[int, str]] | None,
        journals_items: bool,
    ) -> Outputs:
        """A stage's computation, within the budget, recorded in the step's work journal, with its progress bar."""
        self.check_budget(step, name)
        if expect:
            progress.start(step, name, *expect())
        try:
            with recording(self.journal.step(step), stage=name, items=journals_items):
                return await compute()
        except LLMCallError as exc:  # a stage that needs every call (consolidation) lost one
            self.keep_calls(step, name)
            raise StageFailedError(
                f"step {step} {name}: a learner call failed after its retries: {exc}. "
                f"Fix the cause, then Retry the flow run (Prefect UI) or rerun with "
                f"--run-id {self.run_id}: finished items are not redone."
            ) from exc
        finally:
            progress.finish(name)

    def check_failures(self, step: int, items: FailedItems) -> None:
        """The integrity rule: over tolerance, keep the calls and fail; under it, warn (and count)."""
        if items.failed == 0:
            return
        tolerance = self.cfg.tolerance.of(items.tolerance_setting)
        if items.fraction > tolerance:
            self.keep_calls(step, items.stage)
            raise StageFailedError(stage_failed_message(items, step, tolerance, self.run_id))
        self.log.warning(
            "step %d %s: %s, within the tolerance of %.0f%%; stored with their causes (first: %s)",
            step,
            items.stage,
            items.describe(),
            100 * tolerance,
            items.first_cause,
        )

    def keep_calls(self, step: int, name: str) -> None:
        """Store what an unfinished stage paid for (its calls so far), without marking it done."""
        calls = self.journal.step(step).calls(name)
        if calls:
            self.store.write_unfinished(self.run_id, step, name, {"llm_calls": calls})

    def keep_unrecorded_calls(self) -> None:
        """Calls of stage attempts that failed or were killed, from every journal on disk, into llm_calls."""
        for step in self.journal.steps_on_disk():
            journal = self.journal.step(step)
            if journal.unreadable_lines:
                self.log.warning(
                    "work journal %s: %d unreadable line(s) skipped (their work is redone; a request "
                    "they recorded is not counted)",
                    journal.path,
                    journal.unreadable_lines,
                )
            for name in journal.stages_with_calls():
                if not self.store.stage_done(self.run_id, step, name):
                    self.keep_calls(step, name)

    # --- setup ----------------------------------------------------------------------------------------
    async def problems(self) -> list[Problem]:
        async def compute() -> Outputs:
            return {"problems": load_dataset_task(self.cfg, _source_digest(self.cfg))}

        return (await self.stage(0, Stage.LOAD_DATASET, compute, ["problems"]))["problems"]

    def initial_library(self) -> ExperienceLibrary:
        if self.store.library_versions(self.run_id):
            return self.store.load_library(self.run_id, 0)
        library = ExperienceLibrary()
        if self.cfg.initial_library:
            library = ExperienceLibrary.load(self.cfg.initial_library)
            self.audit_initial_library(library)
        self.store.save_library(self.run_id, library)
        return library

    def audit_initial_library(self, library: ExperienceLibrary) -> None:
        """The starting library is the user's own, so it is kept, but lessons the guard would refuse are named."""
        guard = LessonGuard(self.cfg.learning.guard)
        flagged = [(e.id, reason) for e in library if (reason := guard.check(e.text)) is not None]
        if flagged:
            self.log.warning(
                "initial library %s: %d lesson(s) the lesson guard would refuse (kept, they are yours): %s",
                self.cfg.initial_library,
                len(flagged),
                "; ".join(f"{i}: {r}" for i, r in flagged[:10]),
            )

    async def plan_context(
        self, s: StepState, operations: list[Operation]
    ) -> tuple[NearDuplicates | None, dict[str, ExperienceStat] | None]:
        """What applying a plan needs beside it: the near-duplicate control, and (with a token budget) each live
        lesson's usefulness, which the budget evicts by. The library gate and apply_operations use the same."""
        near = await near_duplicates_for(s.cfg, self.store, ExperienceLibrary.from_version(s.version), operations)
        usefulness = (
            {x.exp_id: x for x in self.experience_stats(s.step, [e.id for e in s.library])}
            if s.cfg.library.max_tokens is not None
            else None
        )
        return near, usefulness

    def ledger(self, step: int) -> list[Rejected]:
        """The lessons earlier steps rejected by measurement (a trial, the library gate): not tried again."""
        return [
            Rejected(at, r.operation.text, r.reason)
            for at, r in self.store.operation_results(self.run_id)
            if at < step
            and r.status == OpStatus.REJECTED
            and r.operation.text
            and r.reason.startswith(("lesson validation:", "library gate:"))
        ]

    def set_aside(self, problems: list[Problem]) -> list[Problem]:
        """With the library gate: the training problems it keeps for itself are never trained on; the rest. What
        the gate does in this run is said once (``gate_note``), and again at the end of the run."""
        settings = self.cfg.learning.library_gate
        if settings.enabled is False:
            self.gate_note = GATE_OFF  # the user's own choice: stated, in the log and at the end of the run
            self.log.info("%s", self.gate_note)
            return problems
        learn, self.gate_problems = split_for_gate(problems, settings, self.cfg.seed)
        if (not self.gate_problems or not learn) and settings.enabled is True:
            raise StageFailedError(
                f"learning.library_gate: {len(problems)} training problems leave none to set aside or none to "
                f"learn from (share {settings.share:g}, min_problems {settings.min_problems}); use more problems"
            )
        self.gate_note, complete = describe_split(settings, learn, self.gate_problems)
        (self.log.info if complete else self.log.warning)("%s", self.gate_note)
        return learn

    # --- one step: the stages of STEP in order ------------------------------------------------------------
    async def run_step(self, planned: PlannedStep, library: ExperienceLibrary) -> ExperienceLibrary:
        step, problems = planned.step, planned.problems
        version = (await route_library(self.cfg, self.store, library, problems)).to_version()
        state = StepState(self.cfg, step, problems, library, version, sampling=self.sampling_config(step))
        state.pipelined = await self.pipeline(state)
        for spec in STEP:
            if spec.when(self.cfg):
                await self.run_stage(spec, state)
        return self.store.load_library(self.run_id, step)

    async def run_stage(self, spec: StepStage, state: StepState) -> None:
        """One stage of the step through the stage protocol; its typed output joins ``state`` for the next."""

        async def compute() -> Outputs:
            return (await spec.compute(self, state)).rows()

        computed = state.pipelined.output(spec.output) if state.pipelined else None
        rows = await self.stage(
            state.step,
            spec.stage,
            compute,
            spec.output.tables(),
            before_write=partial(spec.before_write, self, state) if spec.before_write else None,
            expect=partial(spec.expect, state) if spec.expect else None,
            computed=computed.rows() if computed is not None else None,
            failures=spec.failures,
        )
        state.outputs[spec.output] = spec.output.from_rows(rows)
        if spec.after:
            spec.after(self, state)

    async def numeric_update(
        self,
        step: int,
        problems: list[Problem],
        rollouts: list[Rollout],
        advantages: list[GroupAdvantage],
        version: LibraryVersion,
    ) -> AdapterVersion:
        """The step's numeric_update stage alone, on stored completions (the stage as the step runs it)."""
        library = ExperienceLibrary.from_version(version)
        state = StepState(self.cfg, step, problems, library, version, self.cfg)
        state.outputs = {Rollouts: Rollouts(rollouts), Verified: Verified(group_advantages=advantages)}
        await self.run_stage(STEP_STAGES[Stage.NUMERIC_UPDATE], state)
        return state.adapters[0]

    def sampling_config(self, step: int) -> RunConfig:
        """What the step's rollouts sample with: with ``hybrid.rollout_adapter``, the policy carrying the
        latest adapter (the learner keeps its own settings); engines of older adapters are released."""
        cfg = self.cfg
        if not (cfg.hybrid.enabled and cfg.hybrid.rollout_adapter):
            return cfg
        adapter = self.parent_adapter(step)
        # local engine keys end with their adapter (clgrpo.llm.transformers_backend, vllm_backend)
        release_engines(lambda key: isinstance(key, tuple) and key[-1] not in (None, cfg.policy.adapter, adapter))
        if adapter == cfg.policy.adapter:
            return cfg
        self.log.info("step %d: rollouts sample with the adapter %s", step, adapter)
        return cfg.model_copy(
            update={"policy": cfg.policy.model_copy(update={"adapter": adapter}), "learner": cfg.learner_model}
        )

    def parent_adapter(self, step: int) -> str | None:
        """What the step's adapter continues from: the latest earlier step's, else ``policy.adapter``."""
        earlier = self.store.query(
            "SELECT path FROM adapters WHERE run_id = ? AND step < ? ORDER BY step DESC LIMIT 1", [self.run_id, step]
        )
        return str(earlier["path"][0]) if len(earlier) else self.cfg.policy.adapter

    async def pipeline(self, state: StepState) -> PipelineBatch | None:
        """Run rollout -> verify -> summarize -> group advantage group by group (no batch-wide barrier); the four
        stages' outputs, for ``run_stage`` to write in order, one transaction each. Off, with rollouts on the GPU
        pool, or when any of the four is already stored (resume): None, and the step goes stage by stage."""
        step = state.step
        if (
            not self.cfg.pipeline
            or self.cfg.rollout.placement == "pool"
            or any(self.store.stage_done(self.run_id, step, n) for n in PIPELINED)
        ):
            return None
        self.check_budget(step, Stage.ROLLOUT)
        stopping.note_stage(f"step {step} rollout (pipelined with verify, summarize, group_advantage)")
        samples = len(state.problems) * self.cfg.grpo.group_size
        for name, total, unit in (
            (Stage.ROLLOUT, samples, "samples"),
            (Stage.VERIFY, samples, "samples"),
            (Stage.SUMMARIZE, 0, "summaries"),
            (Stage.GROUP_ADVANTAGE, 0, "groups"),
        ):
            progress.start(step, name, total, unit)
        chain = [(spec.group, spec.output) for spec in STEP if spec.group is not None and spec.when(self.cfg)]
        try:
            with recording(self.journal.step(step)):
                parts = await asyncio.gather(
                    *[
                        pipeline_task(state.sampling, step, i, c, state.version, chain)
                        for i, c in enumerate(state.rollout_chunks)
                    ]
                )
        finally:
            for pipelined in PIPELINED:
                progress.finish(pipelined)
        return PipelineBatch.merge(parts)

    # --- the budget -------------------------------------------------------------------------------------
    def check_budget(self, step: int, name: str) -> None:
        """Before a stage: stop if the recorded calls of this run reached ``budget.max_tokens`` or ``max_usd``."""
        budget = self.cfg.budget
        if budget.max_tokens is None and budget.max_usd is None:
            return
        spent = self.store.query(
            "SELECT coalesce(sum(tokens_in + tokens_out), 0) AS tokens, "
            "coalesce(sum(cost_usd), 0) AS usd FROM llm_calls WHERE run_id = ?",
            [self.run_id],
        )
        tokens, usd = int(spent["tokens"][0]), float(spent["usd"][0])
        reached = []
        if budget.max_tokens is not None and tokens >= budget.max_tokens:
            reached.append(f"{tokens} tokens >= budget.max_tokens={budget.max_tokens}")
        if budget.max_usd is not None and usd >= budget.max_usd:
            reached.append(f"${usd:.4f} >= budget.max_usd={budget.max_usd:g}")
        if reached:
            raise BudgetExhaustedError(
                f"budget reached before step {step} {name}: {'; '.join(reached)}. Everything so far is stored; "
                f"resume with a larger budget: clgrpo train --run-id {self.run_id} --set budget.max_usd=... "
                f"(or budget.max_tokens=...)"
            )

    async def stop_for_budget(self, message: str, reports: list[StepReport]) -> TrainResult:
        """The run stops at a stage boundary: the latest library version is exported (the checkpoint)."""
        self.log.warning("%s", message)
        library = self.store.load_library(self.run_id)
        export_library(library, export_dir(self.cfg))
        return self.result(library, reports, stopped=message)

    def result(self, library: ExperienceLibrary, reports: list[StepReport], stopped: str | None = None) -> TrainResult:
        """What the run returns; what the library gate did is logged too."""
        gate = gate_lines(self.gate_note, self.store.records("library_gates", self.run_id), library)
        for line in gate[1:]:
            self.log.info("%s", line)
        return TrainResult(
            self.run_id, str(self.store.path), library.version, len(library), str(export_dir(self.cfg)), reports,
            stopped=stopped, gate=gate,
        )  # fmt: skip

    # --- reporting ------------------------------------------------------------------------------------
    def report(self, planned: PlannedStep, library: ExperienceLibrary) -> StepReport:
        def read(table: str, stage: str | None = None) -> list[Any]:
            return self.store.records(table, self.run_id, planned.step, stage)

        return step_report(
            run_id=self.run_id,
            step=planned.step,
            epoch=planned.epoch,
            rollouts=read("rollouts"),
            rewards=read("rewards"),
            advantages=read("group_advantages"),
            summaries=read("summaries"),
            proposals=read("proposals", Stage.GROUP_ADVANTAGE),
            consolidation_plans=read("proposals", Stage.CONSOLIDATE),
            results=read("operations"),
            library_size=len(library),
            calls=[c for c in read("llm_calls") if c.stage != Stage.VALIDATE],
        )

    async def checkpoint(self, planned: PlannedStep, library: ExperienceLibrary, reports: list[StepReport]) -> None:
        """The step's last stage (``tasks.checkpoint``), on what the store holds of the step."""
        step = planned.step
        stored = StepCheckpoint(
            self.cfg,
            step,
            planned.epoch,
            library,
            previous=self.store.load_library(self.run_id, step - 1),
            stats=self.experience_stats(step, [e.id for e in library]),
            operations=self.store.records("operations", self.run_id, step),
            summaries=self.store.records("summaries", self.run_id, step),
            reports=reports,
        )
        await checkpoint_step(
            stored,
            write=partial(self.store.write_stage, self.run_id, step, Stage.CHECKPOINT),
            quality_history=lambda: self.store.records("library_quality", self.run_id),
            log=self.log,
        )

    def experience_stats(self, step: int, live_ids: list[str]) -> list[ExperienceStat]:
        """Usefulness and confidence of the lessons ``live_ids`` with the citations of ``step`` counted
        (``clgrpo.usefulness``)."""
        shown = self.store.load_library(self.run_id, step - 1) if step > 0 else ExperienceLibrary()
        return step_stats(
            self.store.records("experience_stats", self.run_id, step - 1),
            live_ids,
            [e.id for e in shown],
            self.store.records("summaries", self.run_id, step),
            self.store.records("rewards", self.run_id, step),
            self.store.records("group_advantages", self.run_id, step),
        )

    async def validate(self, validator: Validator, step: int, library: ExperienceLibrary) -> None:
        """Held-out evaluation of the library after ``step`` (0: the baseline), stage-keyed like the rest."""
        outputs = await self.stage(
            step,
            Stage.VALIDATE,
            lambda: validator.compute(step, library),
            EVAL_TABLES,
            failures=VALIDATION_FAILURES,
            journals_items=False,  # its calls only: held-out samples are redone whole
        )
        await validator.publish(step, outputs)

    # --- the run --------------------------------------------------------------------------------------
    async def run(self) -> TrainResult:
        """Register (or resume) the run, train, and record its status: running, then completed or failed."""
        created = self.store.register_run(self.cfg)
        self.log.info("%s run %r (db %s)", "starting" if created else "resuming", self.run_id, self.store.path)
        self.store.set_run_status(self.run_id, "running")
        self.keep_unrecorded_calls()  # of an attempt that was killed
        warm_verifier(self.cfg.domain)  # started by the flow already; a no-op then
        try:
            result = await self.steps()
        except BaseException as exc:
            self.keep_unrecorded_calls()
            if stopping.is_stop(exc):  # a signal or a cancel from the UI: resumable, not a failure
                self.store.set_run_status(self.run_id, "cancelled", stopping.describe())
                self.log.warning(
                    "run %s %s: finished work is stored; the same run id resumes it", self.run_id, stopping.describe()
                )
            else:
                self.store.set_run_status(self.run_id, "failed", error_line(exc))
            raise
        finally:
            self.journal.close()
        if result.stopped:
            self.store.set_run_status(self.run_id, "budget_exhausted", result.stopped)
            return result
        self.store.set_run_status(self.run_id, "completed")
        self.journal.discard()  # everything is in DuckDB now
        return result

    async def steps(self) -> TrainResult:
        problems = self.learn_problems = self.set_aside(await self.problems())
        library = self.initial_library()
        grpo = self.cfg.grpo
        planned_steps = plan_steps(
            problems, epochs=grpo.epochs, batch_size=grpo.batch_size, seed=self.cfg.seed, max_steps=grpo.max_steps
        )
        steps_artifact = await acreate_progress_artifact(
            0.0, key=artifact_key(self.run_id, "progress"), description=f"{len(planned_steps)} steps"
        )
        reports: list[StepReport] = []
        validator = Validator(self.cfg, problems, self.store) if self.cfg.validation else None
        if validator:
            await self.validate(validator, 0, library)
        self.journal.discard_step(0)
        for planned in planned_steps:
            done = self.store.stage_done(self.run_id, planned.step, Stage.CHECKPOINT)
            if done:
                library = self.store.load_library(self.run_id, planned.step)
            else:
                try:
                    library = await self.run_step(planned, library)
                except BudgetExhaustedError as exc:
                    return await self.stop_for_budget(str(exc), reports)
            reports.append(self.report(planned, library))
            if not done:
                await self.checkpoint(planned, library, reports)
            if validator and validator.due(planned.step, len(planned_steps)):
                await self.validate(validator, planned.step, library)
            self.journal.discard_step(planned.step)  # the step is stored: its journal is no longer needed
            await aupdate_progress_artifact(
                steps_artifact,
                100.0 * planned.step / len(planned_steps),
                description=f"step {planned.step}/{len(planned_steps)}",
            )
        await publish_run_report(self.store, self.cfg)
        return self.result(library, reports)


def gate_lines(note: str, decisions: list[GateDecision], library: ExperienceLibrary) -> list[str]:
    """What the library gate did in a run: its note (on, off and why), then, when it measured steps, how many it
    adopted, and when it adopted none, that the run ends with the library it started with."""
    lines = [note] if note else []
    measured = [d for d in decisions if d.verdict != "unchanged"]
    if not measured:
        return lines
    adopted = sum(d.verdict == "adopted" for d in measured)
    lines.append(f"library gate: {adopted} of {counted(len(measured), 'step')} with changes adopted")
    if adopted == 0:
        lines.append(
            f"library gate: no step measured better, so the run ends with the library it started with "
            f"({counted(len(library), 'experience')}), not a worse one"
        )
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def describe_rows(outputs: Outputs) -> str:
    """``{"rollouts": [32 items], "llm_calls": [8 items]}`` -> "32 rollouts, 8 llm calls"."""
    parts = [f"{len(rows)} {table.replace('_', ' ')}" for table, rows in outputs.items()]
    return ", ".join(parts) if parts else "the stage marker"


def _source_digest(cfg: RunConfig) -> str:
    """Content hash of a local dataset file, so a changed file never hits a stale cached load."""
    if cfg.dataset.path and Path(cfg.dataset.path).is_file():
        return hashlib.sha256(Path(cfg.dataset.path).read_bytes()).hexdigest()[:24]
    return cfg.dataset.hf_name or ""


def with_run_id(config: RunConfig) -> RunConfig:
    """The config with its run id: the configured one, else one derived from this flow run (so a Retry of the
    flow run resumes the same run id)."""
    if config.run_id:
        return config
    from prefect.runtime import flow_run

    return config.model_copy(update={"run_id": f"train-{str(flow_run.id)[:8]}"})


def _flow_run_name() -> str:
    """``train-<run id>``; a generated run id is already ``train-<flow run id prefix>``."""
    from prefect.runtime import flow_run

    config = flow_run.parameters["config"]
    config = config if isinstance(config, RunConfig) else RunConfig.model_validate(config)
    return f"train-{config.run_id}" if config.run_id else str(with_run_id(config).run_id)


@flow(
    name="train",
    flow_run_name=_flow_run_name,
    persist_result=True,
    log_prints=True,
    on_crashed=[stopping.cancelled_not_crashed],
)
async def train(config: RunConfig, preflight: bool = True) -> TrainResult:
    """Learn an experience library for a frozen policy (Training-Free GRPO). ``preflight``: check the dataset,
    API keys, endpoints and models before the first stage (the CLI has already done it when False)."""
    config = with_run_id(config)
    tune_gc()
    return await stopping.flow_body(partial(_train, config, preflight))


async def _train(config: RunConfig, preflight: bool) -> TrainResult:
    warm_verifier(config.domain)  # first: it starts while the checks, the store and the first rollouts wait
    if preflight:
        await check_run(config)
    remember_db(config.db_path)  # a deployment run's database is found by later commands as a CLI run's is
    # the run lock: no other live process runs this run id on this database (the store holds the file only
    # while it works, so other runs and readers share it)
    with RunLock(config.db_path, "train", config.require_run_id()), Store(config.db_path) as store:
        await mark_stale_runs_crashed(db_path=config.db_path, run_id=config.run_id)
        config = resolve_policy_adapter(config, store)  # RUN:STEP -> the stored adapter's folder, checked
        return await Trainer(config, store).run()
