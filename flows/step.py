"""One training step as data: ``STEP``, the state a step fills stage by stage, and the stages' functions.

``STEP`` is read top to bottom: each stage, the function that computes it, its typed output (``tasks.outputs``:
the tables it writes, which the ``StepState`` holds for the later stages), its failure rule, its progress bar's
items, whether the config runs it, and for rollout to group advantage the per-group form the pipeline chains
(``pipeline: true``). The training flow (``flows.train``) walks it through the stage protocol: a stage already
stored is read back instead of computed. A stage function gets the step's context (``StepContext``: the store to
read, the ledger of lessons rejected before, the problems set aside, the plan's context) and the state, never the
flow itself; what the step learns is decided by one pure function of its outputs (``tasks.plan``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

from clgrpo.experience.library import ExperienceLibrary, NearDuplicates
from clgrpo.experience.usefulness import step_stats
from clgrpo.process.words import counted
from clgrpo.storage.journal import StepJournal, recording
from clgrpo.storage.store import Store
from domains import domain_for
from schemas.config import RunConfig
from schemas.records import (
    ExperienceStat,
    GateSample,
    GroupAdvantage,
    LibraryVersion,
    LLMCall,
    Operation,
    OpStatus,
    Problem,
    Reward,
    Rollout,
    Summary,
    TrialSample,
)
from schemas.stages import Stage
from tasks.apply_operations import apply_operations_task, apply_plan, near_duplicates_for
from tasks.checkpoint import export_dir
from tasks.checks_budget import ChecksBudget, GrowingAllowance, added_prompt, tokens
from tasks.common import chunks
from tasks.consolidate import consolidate_task, consolidation_calls
from tasks.group_advantage import group_advantage_task
from tasks.integrity import (
    GATE_FAILURES,
    PROPOSAL_FAILURES,
    RATIONALE_FAILURES,
    ROLLOUT_FAILURES,
    SUMMARY_FAILURES,
    TRIAL_FAILURES,
    VERIFY_FAILURES,
    FailureRule,
)
from tasks.library_gate import gate_before_task, library_gate_task, samples_to_draw
from tasks.limits import rejected_results
from tasks.measure import Measured
from tasks.numeric_update import numeric_inputs, numeric_update_task
from tasks.outputs import (
    Adapters,
    Applied,
    Gate,
    GroupProposals,
    Out,
    Plans,
    Rationales,
    Rollouts,
    StageOutput,
    Summaries,
    Trials,
    Verified,
)
from tasks.pipeline import GroupStage, PipelineBatch, propose_group, rollout_group, summarize_group, verify_group
from tasks.plan import StepPlan, step_plan
from tasks.rationalize import rationalize_task, unsolved
from tasks.rollout import rollout_task
from tasks.shorten import shorten_plan_task
from tasks.summarize import summarize_task
from tasks.validate_lessons import Rejected, StepDraws, validate_lessons_task
from tasks.verify import verify_task

PlanContext = tuple[NearDuplicates | None, dict[str, ExperienceStat] | None]


@dataclass
class StepState:
    """What one step knows, filled stage by stage: each stage's typed output (``tasks.outputs``), computed or read
    back from the store, is held by its type (``get``); later stages read it from here."""

    cfg: RunConfig
    step: int
    problems: list[Problem]
    library: ExperienceLibrary  # before the step
    version: LibraryVersion  # what each prompt shows (``clgrpo.experience.retrieval``)
    sampling: RunConfig  # what rollouts sample with: the config, or with hybrid learning the latest adapter
    pipelined: PipelineBatch | None = None  # rollout .. group advantage, computed group by group, to store
    outputs: dict[type[StageOutput], StageOutput] = field(default_factory=dict)

    def get(self, kind: type[Out]) -> Out:
        """The output of the stage that produces ``kind`` (empty when that stage did not run this step)."""
        found = self.outputs.get(kind)
        return found if isinstance(found, kind) else kind()

    @property
    def plan(self) -> StepPlan:
        """What the step learns so far, from its outputs (``tasks.plan``: the limits, the trials, the gate)."""
        return step_plan(
            GroupProposals.joined([self.get(GroupProposals), GroupProposals(self.get(Rationales).proposals)]),
            self.get(Plans),
            self.get(Trials),
            self.get(Gate),
            len(self.library),
            self.cfg.learning,
        )

    @property
    def rollout_chunks(self) -> list[list[Problem]]:
        return chunks(self.problems, self.cfg.grpo.rollout_chunk_size)

    @property
    def selected_ids(self) -> list[str]:
        """The groups with a learning signal, in group order."""
        return [a.problem_id for a in self.get(Verified).group_advantages if a.selected]

    def rollouts_of(self, ids: list[str]) -> list[Rollout]:
        wanted = set(ids)
        return [r for r in self.get(Rollouts).rollouts if r.problem_id in wanted]

    def summaries_of(self, ids: list[str]) -> list[Summary]:
        wanted = set(ids)
        return [x for x in self.get(Summaries).summaries if x.problem_id in wanted]

    def chunk_inputs(self, ids: list[str]) -> dict[str, Any]:
        """The problems, rollouts, rewards and advantages of the groups ``ids``, for a learner task."""
        wanted, verified = set(ids), self.get(Verified)
        return dict(
            problems=[p for p in self.problems if p.problem_id in wanted],
            rollouts=self.rollouts_of(ids),
            rewards=[r for r in verified.rewards if r.problem_id in wanted],
            advantages=[a for a in verified.group_advantages if a.problem_id in wanted],
        )


# the stages whose calls are the step's own work, what its checks are measured against
OWN_STAGES = {
    s.value
    for s in (Stage.ROLLOUT, Stage.VERIFY, Stage.SUMMARIZE, Stage.GROUP_ADVANTAGE, Stage.RATIONALIZE, Stage.CONSOLIDATE)
}


@dataclass
class StepContext:
    """What a step's stages need from the run beside the state: the store (read, and the embeddings' cache), the
    log, the problems the library gate set aside and the rest (``pool``: what lesson trials draw from). The ledger
    of lessons rejected before and the plan's usefulness are read once per step, when first needed."""

    cfg: RunConfig
    run_id: str
    step: int
    store: Store
    log: logging.Logger | logging.LoggerAdapter[Any]
    aside: list[Problem] = field(default_factory=list)
    pool: list[Problem] = field(default_factory=list)
    gate_before: EarlyDraw | None = None  # the gate's first look at the library before, drawn beside the step
    _usefulness: dict[str, ExperienceStat] | None = field(default=None, init=False, repr=False)

    @cached_property
    def ledger(self) -> list[Rejected]:
        """The lessons earlier steps rejected by measurement (a trial, the library gate): not tried again."""
        return [
            Rejected(at, r.operation.text, r.reason)
            for at, r in self.store.operation_results(self.run_id)
            if at < self.step
            and r.status == OpStatus.REJECTED
            and r.operation.text
            and r.reason.startswith(("lesson validation:", "library gate:"))
        ]

    async def plan_context(self, s: StepState, operations: list[Operation]) -> PlanContext:
        """What applying ``operations`` needs beside them: the near-duplicate control (embeddings of the library and
        of the operations' texts, cached in the store) and, with a token budget (``library.max_tokens``), each live
        lesson's usefulness, which the budget evicts by (read once per step: every stage that applies a plan comes
        after the step's rewards and summaries are stored). Lesson validation, the library gate and
        apply_operations use the same, so a plan is tried, measured and applied alike."""
        near = await near_duplicates_for(s.cfg, self.store, ExperienceLibrary.from_version(s.version), operations)
        if s.cfg.library.max_tokens is not None and self._usefulness is None:
            stats = experience_stats(self.store, self.run_id, s.step, [e.id for e in s.library])
            self._usefulness = {x.exp_id: x for x in stats}
        return near, self._usefulness

    def parent_adapter(self) -> str | None:
        return parent_adapter(self.store, self.cfg, self.run_id, self.step)

    def checks_budget(
        self, s: StepState, early: Measured | None = None, plan: Sequence[Operation] = ()
    ) -> ChecksBudget:
        """What the step's checks may spend (``tasks.checks_budget``), from its own calls as stored, with the
        gate's samples reserved where the gate runs (the trials leave them; the gate may spend them). ``early``:
        the gate's samples drawn beside the step (spent; no longer reserved); ``plan``: the candidates, which the
        library after shows in its samples' prompts."""
        calls = self.store.records(LLMCall, self.run_id, self.step)
        own = [c for c in calls if c.stage in OWN_STAGES]
        rollout_tokens = tokens([c for c in own if c.stage == Stage.ROLLOUT.value])
        gate = after = 0
        if self.aside and s.cfg.learning.library_gate.enabled is not False:
            earlier = [*self.store.records(GateSample, self.run_id), *(early.samples if early else [])]
            before = ExperienceLibrary.from_version(s.version)
            gate = samples_to_draw(s.cfg, before, self.aside, earlier, domain_for(s.cfg))
            after = len(self.aside) * s.cfg.learning.library_gate.samples
        rollouts = len(s.get(Rollouts).rollouts)
        early_cost = tokens(early.calls) if early else 0
        drawn = sum(sample.drawn for sample in early.samples) if early else 0
        budget = ChecksBudget.of(
            s.cfg.learning.checks_budget,
            tokens(own),
            rollout_tokens,
            rollouts,
            gate,
            early_cost / drawn if drawn else 0,
            after,
            added_prompt(plan, s.cfg.library.examples_shown),
        )
        return budget.after(early_cost)

    def checks_spent(self) -> int:
        """What the step's lesson trials spent (with their shortening and clustering calls), as stored."""
        return tokens(self.store.records(LLMCall, self.run_id, self.step, Stage.VALIDATE_LESSONS.value))


def experience_stats(store: Store, run_id: str, step: int, live_ids: list[str]) -> list[ExperienceStat]:
    """Usefulness and confidence of the lessons ``live_ids`` with the citations of ``step`` counted
    (``clgrpo.experience.usefulness``)."""
    shown = store.load_library(run_id, step - 1) if step > 0 else ExperienceLibrary()
    return step_stats(
        store.records(ExperienceStat, run_id, step - 1),
        live_ids,
        [e.id for e in shown],
        store.records(Summary, run_id, step),
        store.records(Reward, run_id, step),
        store.records(GroupAdvantage, run_id, step),
    )


def parent_adapter(store: Store, cfg: RunConfig, run_id: str, step: int) -> str | None:
    """What the step's adapter continues from: the latest earlier step's, else ``policy.adapter``."""
    earlier = store.adapter_before(run_id, step)
    return earlier if earlier is not None else cfg.policy.adapter


FOLLOW_S = 0.2  # how often an early draw's allowance follows the step's own tokens


@dataclass
class EarlyDraw:
    """The library gate's first look at the library a step starts from, drawn beside the step's rollouts
    (``draw_gate_before``), each request once ``allowance`` (the checks budget on the step's own tokens so far;
    None: no budget) has room for the most it can cost."""

    task: asyncio.Task[Measured]
    allowance: GrowingAllowance | None

    async def result(self) -> Measured:
        """What it drew; what it has not sent by now is not sent (the gate draws it under its own allowance)."""
        if self.allowance is not None:
            await self.allowance.close()
        return await self.task

    async def spent(self) -> Measured:
        """What it drew, for the trials' budget (a draw that failed: nothing; the gate raises its error)."""
        if self.allowance is not None:
            await self.allowance.close()
        await asyncio.wait([self.task])
        failed = self.task.cancelled() or self.task.exception() is not None
        return Measured([]) if failed else self.task.result()

    async def settle(self) -> None:
        """Cancelled if the step ended before its checks (it stopped or failed): its calls are in the journal
        (kept as the gate's unfinished calls); its error, if any, is the gate's, which did not run."""
        self.task.cancel()  # nothing if it is done
        await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.exception()  # retrieved


def draw_gate_before(c: StepContext, s: StepState, journal: StepJournal) -> EarlyDraw | None:
    """Start the library gate's first look at the library the step starts from (``tasks.library_gate``'s
    ``draw_before``): it depends on nothing the step computes, so it is drawn beside the rollouts, off the step's
    critical path, within the checks budget of the step's tokens so far. None where the step runs no gate or has
    stored it already."""
    gate, ratio = s.cfg.learning.library_gate, s.cfg.learning.checks_budget
    if not c.aside or gate.enabled is False or c.store.stage_done(c.run_id, s.step, Stage.LIBRARY_GATE):
        return None
    earlier = c.store.records(GateSample, c.run_id)
    allowance = None if ratio is None else GrowingAllowance()
    with recording(journal, stage=Stage.LIBRARY_GATE, items=False):  # its calls are the gate's
        draw = gate_before_task(s.cfg, s.step, s.version, c.aside, earlier, allowance)
        task = asyncio.create_task(_following(draw, allowance, journal, ratio or 0.0))
    return EarlyDraw(task, allowance)


async def _following(
    draw: Awaitable[Measured], allowance: GrowingAllowance | None, journal: StepJournal, ratio: float
) -> Measured:
    """``draw``, its allowance raised to ``ratio`` x the step's own tokens as they come in."""

    async def follow(allowance: GrowingAllowance) -> None:
        while True:
            own = [call for call in journal.calls() if call.stage in OWN_STAGES]
            await allowance.grow(int(ratio * tokens(own)))
            await asyncio.sleep(FOLLOW_S)

    follower = asyncio.create_task(follow(allowance)) if allowance is not None else None
    try:
        return await draw
    finally:
        if follower is not None:
            follower.cancel()


# --- the stages ------------------------------------------------------------------------------------------------
async def compute_rollout(c: StepContext, s: StepState) -> Rollouts:
    """G samples per problem, in chunks (``tasks.rollout``; ``rollout.placement: pool``: on the GPU pool)."""
    run_chunk = rollout_task
    if s.cfg.rollout.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
        from flows.rollout_gpu import rollout_on_pool

        run_chunk = partial(rollout_on_pool, db_id=c.store.db_id)
    parts = await asyncio.gather(
        *[run_chunk(s.sampling, s.step, i, chunk, s.version) for i, chunk in enumerate(s.rollout_chunks)]
    )
    return Rollouts.joined(parts)


async def compute_verify(c: StepContext, s: StepState) -> Verified:
    """Rewards, and from them the numeric group advantage of every group, (r - mean) / std over its graded
    samples (``tasks.verify``: ``numeric_group_advantages``): verify's two tables."""
    parts = await asyncio.gather(
        *[
            verify_task(s.cfg, s.step, i, chunk, s.rollouts_of([p.problem_id for p in chunk]))
            for i, chunk in enumerate(s.rollout_chunks)
        ]
    )
    return Verified.joined(parts)  # an LLM judge's calls come from the work journal


async def compute_numeric_update(c: StepContext, s: StepState) -> Adapters:
    """Hybrid learning's numeric GRPO step on the step's stored completions (``tasks.numeric_update``): in this
    process, or as a child run on the cuda pool (``hybrid.placement: pool``)."""
    advantages = s.get(Verified).group_advantages
    inputs = numeric_inputs(s.cfg, s.problems, s.get(Rollouts).rollouts, advantages, s.version)
    run = numeric_update_task
    if s.cfg.hybrid.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
        from flows.numeric_gpu import numeric_update_on_pool

        run = partial(numeric_update_on_pool, db_id=c.store.db_id)
    parent = c.parent_adapter()
    record = await run(s.cfg, s.step, inputs.items, inputs.skipped, parent, s.version.version, str(export_dir(s.cfg)))
    return Adapters([record])


async def compute_summarize(c: StepContext, s: StepState) -> Summaries:
    """A summary of each usable rollout of the selected groups (``tasks.summarize``)."""
    parts = await asyncio.gather(
        *[
            summarize_task(s.cfg, s.step, i, library=s.version, **s.chunk_inputs(ids))
            for i, ids in enumerate(chunks(s.selected_ids, s.cfg.learning.summarize_chunk_size))
        ]
    )
    return Summaries.joined(parts)


async def compute_group_advantage(c: StepContext, s: StepState) -> GroupProposals:
    """The learner's proposal for each selected group (``tasks.group_advantage``)."""
    parts = await asyncio.gather(
        *[
            group_advantage_task(
                s.cfg, s.step, i, library=s.version, summaries=s.summaries_of(ids), **s.chunk_inputs(ids)
            )
            for i, ids in enumerate(chunks(s.selected_ids, s.cfg.learning.summarize_chunk_size))
        ]
    )
    return GroupProposals.joined(parts)


def _unsolved(s: StepState) -> list[Problem]:
    verified = s.get(Verified)
    return unsolved(s.problems, verified.rewards, verified.group_advantages, s.step, s.cfg.learning.rationalize_max)


async def compute_rationalize(c: StepContext, s: StepState) -> Rationales:
    """Worked examples written with the reference in view for groups no attempt solved (``tasks.rationalize``); the
    log says how many such groups ``learning.rationalize_max`` leaves for a later step."""
    chosen, verified = _unsolved(s), s.get(Verified)
    every = unsolved(s.problems, verified.rewards, verified.group_advantages, s.step, len(s.problems))
    if len(every) > len(chosen):
        c.log.info(
            "step %d rationalize: %d of %d groups with no right attempt asked for a solution "
            "(learning.rationalize_max=%d); the other %d are not this step",
            s.step, len(chosen), len(every), s.cfg.learning.rationalize_max, len(every) - len(chosen),
        )  # fmt: skip
    return await rationalize_task(s.cfg, s.step, chosen)


async def compute_consolidate(c: StepContext, s: StepState) -> Plans:
    """One plan from the group proposals within their limit (``tasks.consolidate``)."""
    plans = await consolidate_task(s.cfg, s.step, s.plan.proposals, s.version)
    if plans.failed:
        c.log.warning("step %d: consolidation reply unusable after repair; no operations this step", s.step)
    return plans


async def compute_validate_lessons(c: StepContext, s: StepState) -> Trials:
    """Candidate lessons tried on their problems (``tasks.validate_lessons``); with a library gate, worked
    examples are the gate's to try."""
    plan, shorten_calls = await shorten_plan_task(s.cfg, s.step, s.plan.planned)  # too long: shortened once
    near, _ = await c.plan_context(s, plan)  # a candidate is tried as it would be applied
    drawn = StepDraws(
        s.get(Rollouts).rollouts if s.sampling.policy == s.cfg.policy else [],  # another adapter's: no baseline
        s.get(Verified).rewards,
        c.store.records(TrialSample, c.run_id),
    )
    advantages = s.get(Verified).group_advantages
    early = await c.gate_before.spent() if c.gate_before is not None else None  # the gate's, drawn beside
    budget = c.checks_budget(s, early, plan).after(tokens(shorten_calls))
    trials = await validate_lessons_task(
        s.cfg, s.step, s.version, plan, s.problems, advantages, c.pool, near, c.ledger, drawn, budget, bool(c.aside)
    )
    return replace(trials, llm_calls=shorten_calls + trials.llm_calls)


async def compute_library_gate(c: StepContext, s: StepState) -> Gate:
    """The library before vs after the validated plan on the problems set aside (``tasks.library_gate``);
    nothing when none could be set aside (``enabled: auto`` on a small training set: the run says so)."""
    if not c.aside:
        return Gate()
    operations = s.plan.validated
    before = ExperienceLibrary.from_version(s.version)
    near, usefulness = await c.plan_context(s, operations)
    after, _ = apply_plan(s.cfg, s.step, before, operations, s.problems, near, usefulness)
    earlier = c.store.records(GateSample, c.run_id)
    budget = c.checks_budget(s).for_gate(c.checks_spent())  # what the trials left (never its reserve)
    drawn = await c.gate_before.result() if c.gate_before is not None else None
    return await library_gate_task(s.cfg, s.step, s.version, after.to_version(), c.aside, earlier, budget, drawn)


async def compute_apply_operations(c: StepContext, s: StepState) -> Applied:
    """The validated plan applied to the library (``tasks.apply_operations``) unless the library gate rejected
    the step; what is over a learning limit, failed its trial or was not adopted is stored as rejected."""
    plan = s.plan
    near, usefulness = await c.plan_context(s, plan.adopted)
    applied = apply_operations_task(s.cfg, s.step, s.version, plan.adopted, s.problems, near, usefulness)
    if plan.over_limits:
        c.log.warning(
            "step %d: %d operations over the learning limits rejected (first: %s)",
            s.step,
            len(plan.over_limits),
            plan.over_limits[0][1],
        )
    rejected = rejected_results(plan.rejected, len(applied.operations))
    return replace(applied, operations=applied.operations + rejected)


def save_applied_library(c: StepContext, s: StepState, applied: Applied) -> None:
    assert applied.library is not None  # compute_apply_operations returns it
    c.store.save_library(c.run_id, ExperienceLibrary.from_version(applied.library))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def log_numeric_update(c: StepContext, s: StepState) -> None:
    record = s.get(Adapters).adapters[0]
    c.log.info(
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


def log_learning_signal(c: StepContext, s: StepState) -> None:
    """How many groups can teach anything (rewards that differ): said loudly when none can."""
    mixed, total = len(s.selected_ids), len(s.get(Verified).group_advantages)
    share = f"{mixed / total:.0%}" if total else "-"
    if mixed:
        c.log.info(
            "step %d: %d of %d groups have mixed rewards (%s): only they teach anything", s.step, mixed, total, share
        )
        return
    c.log.warning(
        "step %d: no group has mixed rewards (0 of %d): nothing to learn from this step; every attempt of a problem "
        "was graded alike. Harder or easier problems, more samples (grpo.group_size) or another "
        "grpo.rollout_temperature give the learner something to compare",
        s.step,
        total,
    )


def log_lesson_validation(c: StepContext, s: StepState) -> None:
    trials = s.get(Trials).lesson_trials
    c.log.info(
        "step %d lesson validation: %s kept, %d rejected%s (clgrpo library ops %s:%d lists each with its numbers)%s",
        s.step,
        counted(sum(x.verdict == "kept" for x in trials), "candidate lesson"),
        sum(x.verdict == "rejected" for x in trials),
        f", {untested} go on untested" if (untested := sum(x.verdict == "untested" for x in trials)) else "",
        c.run_id,
        s.step,
        "".join(f"; {x.reason}" for x in trials if x.verdict == "kept"),
    )


def log_library_gate(c: StepContext, s: StepState) -> None:
    if gates := s.get(Gate).library_gates:
        c.log.info("step %d %s", s.step, gates[0].reason)


# --- the step, as data -----------------------------------------------------------------------------------------
def _always(cfg: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class StepStage:
    """One stage of a step: ``compute`` runs only when the stage is neither stored (then its tables are read back)
    nor computed by the pipeline; ``output``: its typed output, whose fields are the tables it writes in one
    transaction and which the step state holds for the later stages; ``failures``: its failure rule (with the
    tolerance it may leave), None when its items cannot fail; ``expect``: the items and unit of its progress bar;
    ``when``: whether the config runs it; ``before_write`` (with the output about to be stored) and ``after``:
    what happens just before its rows are written, and once it is stored or read back; ``group``: its per-group
    form, for the stages the pipeline runs group by group (``tasks.pipeline``, with ``pipeline: true``), chained
    in ``STEP``'s order. ``stage`` is its name in the store (a ``Stage``, or any name for a stage added from
    outside)."""

    stage: str
    compute: Callable[[StepContext, StepState], Awaitable[StageOutput]]
    output: type[StageOutput]
    failures: FailureRule | None = None
    expect: Callable[[StepState], tuple[int, str]] | None = None
    when: Callable[[RunConfig], bool] = _always
    before_write: Callable[[StepContext, StepState, Any], None] | None = None
    after: Callable[[StepContext, StepState], None] | None = None
    group: GroupStage | None = None


def _summaries_expected(s: StepState) -> tuple[int, str]:
    selected = set(s.selected_ids)
    rollouts = s.get(Rollouts).rollouts
    n = sum(r.error is None and r.problem_id in selected for r in rollouts) if s.cfg.learning.summarize else 0
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
        expect=lambda s: (len(s.get(Rollouts).rollouts), "samples"),
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
        Stage.RATIONALIZE,
        compute_rationalize,
        Rationales,
        RATIONALE_FAILURES,
        when=lambda cfg: cfg.learning.examples == "rationalize",
        expect=lambda s: (len(_unsolved(s)), "groups"),
    ),
    StepStage(
        Stage.CONSOLIDATE,
        compute_consolidate,
        Plans,
        expect=lambda s: (
            consolidation_calls(sum(bool(p.operations) for p in s.plan.proposals), s.cfg.learning),
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


def pipelined(stages: tuple[StepStage, ...]) -> tuple[str, ...]:
    """The stages the pipeline runs group by group (``tasks.pipeline``): those with a per-group form."""
    return tuple(spec.stage for spec in stages if spec.group is not None)
