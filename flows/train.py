"""The training flow: epochs x batches of steps, each step the stages of its step table, then its checkpoint.

The step itself, as data, is ``flows/step.py``: ``STEP`` (the table a ``Trainer`` runs unless given another), the
state a step fills and the stages' functions. ``Trainer.run_step`` runs each stage through the stage protocol
(``flows.stages``); the checkpoint (``tasks.checkpoint``) closes the step. This module keeps the run's lifecycle: the
dataset, the starting library, the problems the library gate sets aside, the budget, the reports, held-out
validation and the run's status.

The flow is its run's only DuckDB writer (the run lock, ``clgrpo.storage.run_lock``). Each stage's typed output is
written in one transaction keyed by (run_id, step, stage); a stage already in the store is read back instead of
recomputed, so rerunning a run id after a crash continues where it stopped (no duplicate rollouts, no operation
applied twice). Within a stage, every model call and finished item is appended to the step's work journal as it
completes (``clgrpo.storage.journal``), so a UI "Retry" or a rerun of a failed or killed stage redoes only its failed
items, and every request sent is accounted in ``llm_calls``. A stage whose failed items exceed
``tolerance.max_failed_fraction`` is not stored as done (``tasks.integrity``). A run id is bound to its config:
a changed config under the same id is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_progress_artifact, aupdate_progress_artifact

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.experience.retrieval import route_library
from clgrpo.llm.adapters import resolve_policy_adapter
from clgrpo.llm.local import release_engines
from clgrpo.process import progress, stopping
from clgrpo.process.errors import error_line
from clgrpo.process.runtime import tune_gc
from clgrpo.storage.journal import RunJournal, recording
from clgrpo.storage.run_lock import RunLock
from clgrpo.storage.stale_runs import mark_stale_runs_crashed
from clgrpo.storage.state import remember_db
from clgrpo.storage.store import Store
from domains.guard import LessonGuard
from flows.evaluate import Validator, publish_run_report
from flows.stages import StageRunner
from flows.step import (
    STEP,
    StepContext,
    StepStage,
    StepState,
    draw_gate_before,
    experience_stats,
    parent_adapter,
    pipelined,
)
from schemas.config import RunConfig
from schemas.records import (
    AdapterVersion,
    GateDecision,
    GroupAdvantage,
    LibraryQuality,
    LibraryVersion,
    LLMCall,
    OperationResult,
    Problem,
    Proposal,
    Reward,
    Rollout,
    Summary,
)
from schemas.stages import Stage
from tasks.checkpoint import StepCheckpoint, StepReport, checkpoint_step, export_dir, export_library, step_report
from tasks.common import artifact_key
from tasks.integrity import VALIDATION_FAILURES, BudgetExhaustedError, StageFailedError
from tasks.library_gate import GATE_OFF, describe_split, gate_lines, split_for_gate
from tasks.load_dataset import load_dataset_task
from tasks.outputs import Adapters, Evaluated, Problems, Rollouts, Verified
from tasks.pipeline import PipelineBatch, pipeline_task
from tasks.preflight import check_run
from tasks.verify import warm_verifier

R = TypeVar("R")  # a stored record type


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


class Trainer:
    """A training run. ``stages``: its step, the stages in order (``flows.step.STEP``; a table with a stage added
    from outside, ``tests/test_toy_stage.py``)."""

    def __init__(
        self, config: RunConfig, store: Store, *, stages: Sequence[StepStage] = STEP, accept_model_change: bool = False
    ) -> None:
        self.cfg = config
        self.store = store
        self.stages = tuple(stages)
        self.accept_model_change = accept_model_change  # resume even if the policy's identity changed
        self.run_id = config.require_run_id()  # train() sets one before the Trainer exists
        self.log = get_run_logger()
        self.journal = RunJournal.open(store.path, store.db_id, self.run_id)
        self.gate_problems: list[Problem] = []  # the library gate's own problems (learning.library_gate)
        self.gate_note = ""  # what the gate does in this run, in one line (set_aside)
        self.learn_problems: list[Problem] = []  # the rest: what steps and lesson trials draw from

    @property
    def runner(self) -> StageRunner:
        """The stage protocol for this run (``flows.stages``), with its tolerance and its budget check."""
        return StageRunner(self.store, self.run_id, self.log, self.journal, self.cfg.tolerance, self.check_budget)

    # --- setup ----------------------------------------------------------------------------------------
    async def problems(self) -> list[Problem]:
        async def compute() -> Problems:
            return Problems(load_dataset_task(self.cfg, _source_digest(self.cfg)))

        return (await self.runner.run(0, Stage.LOAD_DATASET, Problems, compute)).problems

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

    # --- one step: the stages of its table in order -------------------------------------------------------
    async def run_step(self, planned: PlannedStep, library: ExperienceLibrary) -> ExperienceLibrary:
        step, problems = planned.step, planned.problems
        version = (await route_library(self.cfg, self.store, library, problems)).to_version()
        state = StepState(self.cfg, step, problems, library, version, sampling=self.sampling_config(step))
        context = self.context(step)
        if any(spec.stage == Stage.LIBRARY_GATE and spec.when(self.cfg) for spec in self.stages):
            context.gate_before = draw_gate_before(context, state, self.journal.step(step))  # beside the rollouts
        try:
            state.pipelined = await self.pipeline(state)
            for spec in self.stages:
                if spec.when(self.cfg):
                    await self.run_stage(spec, context, state)
        finally:
            if context.gate_before is not None:
                await context.gate_before.settle()
        return self.store.load_library(self.run_id, step)

    def context(self, step: int) -> StepContext:
        """What the step's stages get from the run (``flows.step``): never the Trainer itself."""
        return StepContext(self.cfg, self.run_id, step, self.store, self.log, self.gate_problems, self.learn_problems)

    async def run_stage(self, spec: StepStage, context: StepContext, state: StepState) -> None:
        """One stage of the step through the stage protocol; its typed output joins ``state`` for the next."""
        state.outputs[spec.output] = await self.runner.run(
            state.step,
            spec.stage,
            spec.output,
            partial(spec.compute, context, state),
            before_write=partial(spec.before_write, context, state) if spec.before_write else None,
            expect=partial(spec.expect, state) if spec.expect else None,
            computed=state.pipelined.output(spec.output) if state.pipelined else None,
            failures=spec.failures,
        )
        if spec.after:
            spec.after(context, state)

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
        numeric = next(spec for spec in self.stages if spec.stage == Stage.NUMERIC_UPDATE)
        await self.run_stage(numeric, self.context(step), state)
        return state.get(Adapters).adapters[0]

    def sampling_config(self, step: int) -> RunConfig:
        """What the step's rollouts sample with: with ``hybrid.rollout_adapter``, the policy carrying the
        latest adapter (the learner keeps its own settings); engines of older adapters are released."""
        cfg = self.cfg
        if not (cfg.hybrid.enabled and cfg.hybrid.rollout_adapter):
            return cfg
        adapter = parent_adapter(self.store, cfg, self.run_id, step)
        # local engine keys end with their adapter (clgrpo.llm.transformers_backend, vllm_backend)
        release_engines(lambda key: isinstance(key, tuple) and key[-1] not in (None, cfg.policy.adapter, adapter))
        if adapter == cfg.policy.adapter:
            return cfg
        self.log.info("step %d: rollouts sample with the adapter %s", step, adapter)
        return cfg.model_copy(
            update={"policy": cfg.policy.model_copy(update={"adapter": adapter}), "learner": cfg.learner_model}
        )

    async def pipeline(self, state: StepState) -> PipelineBatch | None:
        """Run rollout -> verify -> summarize -> group advantage group by group (no batch-wide barrier); the four
        stages' outputs, for ``run_stage`` to write in order, one transaction each. Off, with rollouts on the GPU
        pool, or when any of the four is already stored (resume): None, and the step goes stage by stage."""
        step = state.step
        if (
            not self.cfg.pipeline
            or self.cfg.rollout.placement == "pool"
            or any(self.store.stage_done(self.run_id, step, n) for n in pipelined(self.stages))
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
        chain = [(s.group, s.output) for s in self.stages if s.group is not None and s.when(self.cfg)]
        try:
            with recording(self.journal.step(step)):
                parts = await asyncio.gather(
                    *[
                        pipeline_task(state.sampling, step, i, c, state.version, chain)
                        for i, c in enumerate(state.rollout_chunks)
                    ]
                )
        finally:
            for done in pipelined(self.stages):
                progress.finish(done)
        return PipelineBatch.merge(parts)

    # --- the budget -------------------------------------------------------------------------------------
    def check_budget(self, step: int, name: str) -> None:
        """Before a stage: stop if the recorded calls of this run reached ``budget.max_tokens`` or ``max_usd``."""
        budget = self.cfg.budget
        if budget.max_tokens is None and budget.max_usd is None:
            return
        tokens, usd = self.store.spent(self.run_id)
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
        gate = gate_lines(self.gate_note, self.store.records(GateDecision, self.run_id), library)
        for line in gate[1:]:
            self.log.info("%s", line)
        return TrainResult(
            self.run_id, str(self.store.path), library.version, len(library), str(export_dir(self.cfg)), reports,
            stopped=stopped, gate=gate,
        )  # fmt: skip

    # --- reporting ------------------------------------------------------------------------------------
    def report(self, planned: PlannedStep, library: ExperienceLibrary) -> StepReport:
        def read(record: type[R], stage: str | None = None) -> list[R]:
            return self.store.records(record, self.run_id, planned.step, stage)

        return step_report(
            run_id=self.run_id,
            step=planned.step,
            epoch=planned.epoch,
            rollouts=read(Rollout),
            rewards=read(Reward),
            advantages=read(GroupAdvantage),
            summaries=read(Summary),
            proposals=read(Proposal, Stage.GROUP_ADVANTAGE),
            rationales=read(Proposal, Stage.RATIONALIZE),
            consolidation_plans=read(Proposal, Stage.CONSOLIDATE),
            results=read(OperationResult),
            library_size=len(library),
            calls=[c for c in read(LLMCall) if c.stage != Stage.VALIDATE],
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
            stats=experience_stats(self.store, self.run_id, step, [e.id for e in library]),
            operations=self.store.records(OperationResult, self.run_id, step),
            summaries=self.store.records(Summary, self.run_id, step),
            reports=reports,
        )
        await checkpoint_step(
            stored,
            write=partial(self.store.write_stage, self.run_id, step, Stage.CHECKPOINT),
            quality_history=lambda: self.store.records(LibraryQuality, self.run_id),
            log=self.log,
        )

    async def validate(self, validator: Validator, step: int, library: ExperienceLibrary) -> None:
        """Held-out evaluation of the library after ``step`` (0: the baseline), stage-keyed like the rest."""
        outputs = await self.runner.run(
            step,
            Stage.VALIDATE,
            Evaluated,
            partial(validator.compute, step, library),
            failures=VALIDATION_FAILURES,
            journals_items=False,  # its calls only: held-out samples are redone whole
        )
        await validator.publish(step, outputs)

    # --- the run --------------------------------------------------------------------------------------
    async def run(self) -> TrainResult:
        """Register (or resume) the run, train, and record its status: running, then completed or failed."""
        self.cfg, kept = self.store.as_started(self.cfg)  # a default changed since it started: its value stays
        for note in kept:
            self.log.warning("run %r: %s", self.run_id, note)
        if self.cfg.rollout.agent_settings() is not None and self.cfg.learning.examples != "off":
            self.log.warning(
                "learning.examples=%s with agent rollouts: a worked example is shown as its problem and final reply, "
                "without the tool calls and results that found the answer, which can teach the agent to answer "
                "without its tools (agent runs leave examples off unless the config sets them)",
                self.cfg.learning.examples,
            )
        created = self.store.register_run(self.cfg)
        self.log.info("%s run %r (db %s)", "starting" if created else "resuming", self.run_id, self.store.path)
        if not created:  # the model it was trained with answers still, or the user accepts another
            identity = self.cfg.policy.identity()
            if line := self.store.bind_identity(self.run_id, identity, accept_change=self.accept_model_change):
                self.log.warning("%s", line)
        self.store.set_run_status(self.run_id, "running")
        self.runner.keep_unrecorded_calls()  # of an attempt that was killed
        warm_verifier(self.cfg.domain)  # started by the flow already; a no-op then
        try:
            result = await self.steps()
        except BaseException as exc:
            self.runner.keep_unrecorded_calls()
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
async def train(config: RunConfig, preflight: bool = True, accept_model_change: bool = False) -> TrainResult:
    """Learn an experience library for a frozen policy (Training-Free GRPO). ``preflight``: check the dataset,
    API keys, endpoints and models before the first stage (the CLI has already done it when False).
    ``accept_model_change``: resume a run whose policy model changed since it was bound to it (its identity:
    what the endpoint states of the weights, and ``policy.revision``), saying so; without it such a resume is
    refused."""
    config = with_run_id(config)
    tune_gc()
    return await stopping.flow_body(partial(_train, config, preflight, accept_model_change))


async def _train(config: RunConfig, preflight: bool, accept_model_change: bool = False) -> TrainResult:
    warm_verifier(config.domain)  # first: it starts while the checks, the store and the first rollouts wait
    if preflight:
        config = await check_run(config)  # with what the endpoints state of their models
    remember_db(config.db_path)  # a deployment run's database is found by later commands as a CLI run's is
    # the run lock: no other live process runs this run id on this database (the store holds the file only
    # while it works, so other runs and readers share it)
    with RunLock(config.db_path, "train", config.require_run_id()), Store(config.db_path) as store:
        await mark_stale_runs_crashed(db_path=config.db_path, run_id=config.run_id)
        config = resolve_policy_adapter(config, store)  # RUN:STEP -> the stored adapter's folder, checked
        return await Trainer(config, store, accept_model_change=accept_model_change).run()
