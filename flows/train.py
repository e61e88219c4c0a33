"""The training flow: epochs x batches of steps, each step the eight stages.

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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)

from clgrpo import progress, stopping
from clgrpo.adapters import resolve_policy_adapter
from clgrpo.errors import error_line
from clgrpo.journal import RunJournal, recording
from clgrpo.library import ExperienceLibrary
from clgrpo.llm import LLMCallError
from clgrpo.llm.local import release_engines
from clgrpo.quality import describe_quality, library_quality
from clgrpo.retrieval import route_library
from clgrpo.run_lock import RunLock
from clgrpo.runtime import tune_gc
from clgrpo.stale_runs import mark_stale_runs_crashed
from clgrpo.store import Store
from clgrpo.usefulness import step_stats
from domains.guard import LessonGuard
from flows.evaluate import EVAL_TABLES, Validator, publish_run_report
from schemas.config import AgentConfig, RunConfig
from schemas.ddl import VALIDATE_STAGE
from schemas.records import (
    AdapterVersion,
    ExperienceStat,
    GroupAdvantage,
    LibraryVersion,
    Operation,
    Problem,
    Proposal,
    Rollout,
)
from tasks.apply_operations import STAGE as APPLY
from tasks.apply_operations import apply_operations_task, near_duplicates_for
from tasks.checkpoint import (
    STAGE as CHECKPOINT,
)
from tasks.checkpoint import (
    StepReport,
    checkpoint_task,
    export_dir,
    export_library,
    library_table,
    operations_markdown,
    step_report,
)
from tasks.common import artifact_key, chunks
from tasks.consolidate import FINAL, consolidate_task, consolidation_calls
from tasks.consolidate import STAGE as CONSOLIDATE
from tasks.group_advantage import STAGE as GROUP_ADVANTAGE
from tasks.group_advantage import group_advantage_task
from tasks.integrity import BudgetExhaustedError, StageFailedError, failed_items, stage_failed_message
from tasks.limits import limit_plan, limit_proposals, plan_bound, rejected_results
from tasks.load_dataset import STAGE as LOAD
from tasks.load_dataset import load_dataset_task
from tasks.numeric_update import STAGE as NUMERIC_UPDATE
from tasks.numeric_update import numeric_inputs, numeric_update_task
from tasks.pipeline import PipelineBatch, pipeline_task
from tasks.preflight import check_run
from tasks.rollout import STAGE as ROLLOUT
from tasks.rollout import rollout_task
from tasks.summarize import STAGE as SUMMARIZE
from tasks.summarize import summarize_task
from tasks.validate_lessons import STAGE as VALIDATE_LESSONS
from tasks.validate_lessons import plan_after, validate_lessons_task
from tasks.verify import STAGE as VERIFY
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
    def __init__(self, config: RunConfig, store: Store) -> None:
        self.cfg = config
        self.store = store
        self.run_id = config.run_id
        self.log = get_run_logger()
        self.precomputed: dict[tuple[int, str], Outputs] = {}  # stage outputs the pipeline produced, to write
        self.journal = RunJournal.open(store.path, store.db_id, self.run_id)

    # --- the stage protocol: read back when done, else compute and write atomically -------------------
    async def stage(
        self,
        step: int,
        name: str,
        compute: Callable[[], Awaitable[Outputs]],
        tables: Sequence[str],
        before_write: Callable[[Outputs], None] | None = None,
        expect: tuple[int, str] | None = None,
    ) -> Outputs:
        """``expect``: (items, unit) the computation will report as it goes (the terminal's progress bar).
        The computation's calls and finished items go to the step's work journal as they happen; the stage is
        stored only if its failed items are within tolerance (else ``StageFailedError``)."""
        if self.store.stage_done(self.run_id, step, name):
            self.log.info("step %d %s: already stored, reading it back", step, name)
            return {t: self.store.records(t, self.run_id, step, name) for t in tables}
        stopping.note_stage(f"step {step} {name}" if step else name)
        outputs = self.precomputed.pop((step, name), None)
        if outputs is None:
            self.check_budget(step, name)
            if expect:
                progress.start(step, name, *expect)
            try:
                with recording(self.journal.step(step), stage=name, items=name != VALIDATE_STAGE):
                    outputs = await compute()
            except LLMCallError as exc:  # a stage that needs every call (consolidation) lost one
                self.keep_calls(step, name)
                raise StageFailedError(
                    f"step {step} {name}: a learner call failed after its retries: {exc}. "
                    f"Fix the cause, then Retry the flow run (Prefect UI) or rerun with "
                    f"--run-id {self.run_id}: finished items are not redone."
                ) from exc
            finally:
                progress.finish(name)
        if "llm_calls" in outputs:
            outputs["llm_calls"] = self.journal.step(step).all_calls(name, outputs["llm_calls"])
        self.check_failures(step, name, outputs)
        if before_write:
            before_write(outputs)
        self.store.write_stage(self.run_id, step, name, outputs)
        self.log.info("step %d %s: stored %s", step, name, describe_rows(outputs))
        return outputs

    def check_failures(self, step: int, name: str, outputs: Outputs) -> None:
        """The integrity rule: over tolerance, keep the calls and fail; under it, warn (and count)."""
        items = failed_items(name, outputs)
        if items is None or items.failed == 0:
            return
        tolerance = self.cfg.tolerance.of(name) or 0.0
        if items.fraction > tolerance:
            self.keep_calls(step, name)
            raise StageFailedError(stage_failed_message(items, step, tolerance, self.run_id))
        self.log.warning(
            "step %d %s: %s, within the tolerance of %.0f%%; stored with their causes (first: %s)",
            step,
            name,
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

        return (await self.stage(0, LOAD, compute, ["problems"]))["problems"]

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

    # --- one step -------------------------------------------------------------------------------------
    async def run_step(self, planned: PlannedStep, library: ExperienceLibrary) -> ExperienceLibrary:
        step, cfg, problems = planned.step, self.cfg, planned.problems
        version = (await route_library(cfg, self.store, library, problems)).to_version()  # what each prompt shows
        rollout_chunks = chunks(problems, cfg.grpo.rollout_chunk_size)

        run_chunk = rollout_task
        if cfg.rollout.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
            from flows.rollout_gpu import rollout_on_pool

            run_chunk = partial(rollout_on_pool, db_id=self.store.db_id)
        sampling = self.sampling_config(step)  # the config, or with hybrid learning the latest adapter on the policy
        await self.pipeline(step, rollout_chunks, version, sampling)

        async def do_rollout() -> Outputs:
            parts = await asyncio.gather(
                *[run_chunk(sampling, step, i, c, version) for i, c in enumerate(rollout_chunks)]
            )
            return {
                "rollouts": [r for p in parts for r in p.rollouts],
                "llm_calls": [c for p in parts for c in p.calls],
            }

        samples = (len(problems) * cfg.grpo.group_size, "samples")
        rollouts = (await self.stage(step, ROLLOUT, do_rollout, ["rollouts", "llm_calls"], expect=samples))["rollouts"]

        async def do_verify() -> Outputs:
            parts = await asyncio.gather(
                *[
                    verify_task(cfg, step, i, c, [r for r in rollouts if r.problem_id in {p.problem_id for p in c}])
                    for i, c in enumerate(rollout_chunks)
                ]
            )
            return {
                "rewards": [r for p in parts for r in p.rewards],
                "group_advantages": [a for p in parts for a in p.advantages],
                "llm_calls": [],
            }  # an LLM judge's calls, from the work journal

        verified = await self.stage(
            step, VERIFY, do_verify, ["rewards", "group_advantages", "llm_calls"], expect=(len(rollouts), "samples")
        )
        rewards, advantages = verified["rewards"], verified["group_advantages"]
        if cfg.hybrid.enabled:
            await self.numeric_update(step, problems, rollouts, advantages, version)
        selected_ids = [a.problem_id for a in advantages if a.selected]
        group_chunks = chunks(selected_ids, cfg.learning.summarize_chunk_size)

        def chunk_inputs(ids: list[str]) -> dict[str, Any]:
            wanted = set(ids)
            return dict(
                problems=[p for p in problems if p.problem_id in wanted],
                rollouts=[r for r in rollouts if r.problem_id in wanted],
                rewards=[r for r in rewards if r.problem_id in wanted],
                advantages=[a for a in advantages if a.problem_id in wanted],
            )

        async def do_summarize() -> Outputs:
            parts = await asyncio.gather(
                *[
                    summarize_task(cfg, step, i, library=version, **chunk_inputs(ids))
                    for i, ids in enumerate(group_chunks)
                ]
            )
            return {
                "summaries": [s for p in parts for s in p.summaries],
                "llm_calls": [c for p in parts for c in p.calls],
            }

        to_summarize = (
            sum(r.error is None and r.problem_id in set(selected_ids) for r in rollouts)
            if cfg.learning.summarize
            else 0
        )
        summaries = (
            await self.stage(
                step, SUMMARIZE, do_summarize, ["summaries", "llm_calls"], expect=(to_summarize, "summaries")
            )
        )["summaries"]

        async def do_extract() -> Outputs:
            parts = await asyncio.gather(
                *[
                    group_advantage_task(
                        cfg,
                        step,
                        i,
                        library=version,
                        summaries=[s for s in summaries if s.problem_id in set(ids)],
                        **chunk_inputs(ids),
                    )
                    for i, ids in enumerate(group_chunks)
                ]
            )
            return {
                "proposals": [p for part in parts for p in part.proposals],
                "llm_calls": [c for part in parts for c in part.calls],
            }

        proposals = (
            await self.stage(
                step, GROUP_ADVANTAGE, do_extract, ["proposals", "llm_calls"], expect=(len(selected_ids), "groups")
            )
        )["proposals"]

        limited_proposals, over_group = limit_proposals(proposals, cfg.learning)

        async def do_consolidate() -> Outputs:
            result = await consolidate_task(cfg, step, limited_proposals, version)
            if result.failed:
                self.log.warning("step %d: consolidation reply unusable after repair; no operations this step", step)
            return {"proposals": result.plans, "llm_calls": result.calls}

        calls = consolidation_calls(sum(bool(p.operations) for p in limited_proposals), cfg.learning)
        plans: list[Proposal] = (
            await self.stage(
                step, CONSOLIDATE, do_consolidate, ["proposals", "llm_calls"], expect=(calls, "learner calls")
            )
        )["proposals"]
        final_ops = next((p.operations for p in plans if p.group_id == FINAL), [])
        plan = limit_plan(final_ops, bound=plan_bound(limited_proposals, len(library)), cfg=cfg.learning)
        operations, failed_trials = await self.validated(step, version, plan.operations, problems, advantages)

        applied_version: list[LibraryVersion] = []

        async def do_apply() -> Outputs:
            near = await near_duplicates_for(cfg, self.store, ExperienceLibrary.from_version(version), operations)
            usefulness = (
                {s.exp_id: s for s in self.experience_stats(step, [e.id for e in library])}
                if cfg.library.max_tokens is not None
                else None
            )  # what the token budget evicts by
            applied = apply_operations_task(cfg, step, version, operations, problems, near, usefulness)
            applied_version.append(applied.library)
            if over_limits := over_group + plan.over:
                self.log.warning(
                    "step %d: %d operations over the learning limits rejected (first: %s)",
                    step,
                    len(over_limits),
                    over_limits[0][1],
                )
            over = rejected_results(over_limits + failed_trials, first_seq=len(applied.results))
            return {"operations": applied.results + over}

        def save_version(_: Outputs) -> None:
            self.store.save_library(self.run_id, ExperienceLibrary.from_version(applied_version[0]))

        await self.stage(step, APPLY, do_apply, ["operations"], before_write=save_version)
        return self.store.load_library(self.run_id, step)

    async def numeric_update(
        self,
        step: int,
        problems: list[Problem],
        rollouts: list[Rollout],
        advantages: list[GroupAdvantage],
        version: LibraryVersion,
    ) -> AdapterVersion:
        """Hybrid learning's numeric GRPO step on this step's stored completions (``tasks.numeric_update``):
        in this process, or as a child run on the cuda pool (``hybrid.placement: pool``)."""
        cfg = self.cfg

        async def do_update() -> Outputs:
            inputs = numeric_inputs(cfg, problems, rollouts, advantages, version)
            run = numeric_update_task
            if cfg.hybrid.placement == "pool":  # the GPU pool's flow, imported only by runs that use it
                from flows.numeric_gpu import numeric_update_on_pool

                run = partial(numeric_update_on_pool, db_id=self.store.db_id)
            record = await run(
                cfg,
                step,
                inputs.items,
                inputs.skipped,
                self.parent_adapter(step),
                version.version,
                str(export_dir(cfg)),
            )
            return {"adapters": [record]}

        record = (await self.stage(step, NUMERIC_UPDATE, do_update, ["adapters"]))["adapters"][0]
        self.log.info(
            "step %d numeric_update: %d completions (%d skipped), loss %s -> %s, mean log-prob change "
            "%s (positive advantage) / %s (negative), %.1fs on %s; adapter %s",
            step,
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
        return record

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

    async def validated(
        self,
        step: int,
        version: LibraryVersion,
        plan: list[Operation],
        problems: list[Problem],
        advantages: list[GroupAdvantage],
    ) -> tuple[list[Operation], list[tuple[Operation, str]]]:
        """The plan after lesson validation (``learning.lesson_validation``; off: the plan as it is), and the
        operations it rejected with their reasons."""
        if not self.cfg.learning.lesson_validation.enabled:
            return plan, []

        async def do_validate() -> Outputs:
            result = await validate_lessons_task(self.cfg, step, version, plan, problems, advantages)
            return {"lesson_trials": result.trials, "trial_samples": result.samples, "llm_calls": result.calls}

        trials = (
            await self.stage(step, VALIDATE_LESSONS, do_validate, ["lesson_trials", "trial_samples", "llm_calls"])
        )["lesson_trials"]
        kept = sum(t.verdict == "kept" for t in trials)
        rejected = sum(t.verdict == "rejected" for t in trials)
        self.log.info(
            "step %d lesson validation: %d candidate lessons kept, %d rejected (clgrpo library ops %s:%d "
            "lists each with its numbers)%s",
            step,
            kept,
            rejected,
            self.run_id,
            step,
            "".join(f"; {t.reason}" for t in trials if t.verdict == "kept"),
        )
        return plan_after(trials)

    async def pipeline(
        self, step: int, rollout_chunks: list[list[Problem]], version: LibraryVersion, sampling: RunConfig
    ) -> None:
        """Run rollout -> verify -> summarize -> group advantage group by group (no batch-wide barrier) and
        leave the four stages' outputs for ``stage`` to write, in order and one transaction each. Off, with
        rollouts on the GPU pool, or when any of the four is already stored (resume): stage by stage."""
        names = (ROLLOUT, VERIFY, SUMMARIZE, GROUP_ADVANTAGE)
        if (
            not self.cfg.pipeline
            or self.cfg.rollout.placement == "pool"
            or any(self.store.stage_done(self.run_id, step, n) for n in names)
        ):
            return
        self.check_budget(step, ROLLOUT)
        stopping.note_stage(f"step {step} rollout (pipelined with verify, summarize, group_advantage)")
        samples = sum(len(c) for c in rollout_chunks) * self.cfg.grpo.group_size
        for name, total, unit in (
            (ROLLOUT, samples, "samples"),
            (VERIFY, samples, "samples"),
            (SUMMARIZE, 0, "summaries"),
            (GROUP_ADVANTAGE, 0, "groups"),
        ):
            progress.start(step, name, total, unit)
        try:
            with recording(self.journal.step(step)):
                parts = await asyncio.gather(
                    *[pipeline_task(sampling, step, i, c, version) for i, c in enumerate(rollout_chunks)]
                )
        finally:
            for name in names:
                progress.finish(name)
        merged = PipelineBatch.merge(parts)
        self.precomputed.update(
            {
                (step, ROLLOUT): {"rollouts": merged.rollouts, "llm_calls": merged.rollout_calls},
                (step, VERIFY): {"rewards": merged.rewards, "group_advantages": merged.advantages, "llm_calls": []},
                (step, SUMMARIZE): {"summaries": merged.summaries, "llm_calls": merged.summary_calls},
                (step, GROUP_ADVANTAGE): {"proposals": merged.proposals, "llm_calls": merged.proposal_calls},
            }
        )

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
        return TrainResult(
            self.run_id,
            str(self.store.path),
            library.version,
            len(library),
            str(export_dir(self.cfg)),
            reports,
            stopped=message,
        )

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
            proposals=read("proposals", GROUP_ADVANTAGE),
            consolidation_plans=read("proposals", CONSOLIDATE),
            results=read("operations"),
            library_size=len(library),
            calls=[c for c in read("llm_calls") if c.stage != VALIDATE_STAGE],
        )

    async def checkpoint(self, planned: PlannedStep, library: ExperienceLibrary, reports: list[StepReport]) -> None:
        step = planned.step
        paths = checkpoint_task(self.cfg, step, library.to_version())
        report = reports[-1]
        stats = self.experience_stats(step, [e.id for e in library])
        await acreate_table_artifact(
            library_table(library, stats) or [{"id": "", "text": "(empty library)"}],
            key=artifact_key(self.run_id, "library"),
            description=f"Library after step {step} (version {library.version})",
        )
        await acreate_markdown_artifact(
            operations_markdown(step, self.store.records("operations", self.run_id, step)),
            key=artifact_key(self.run_id, "operations"),
            description=f"Operations applied and rejected at step {step}",
        )
        await acreate_table_artifact(
            [r.as_row() for r in reports],
            key=artifact_key(self.run_id, "counts"),
            description="Per-step counts: groups, proposals, operations, tokens, cost",
        )
        quality = library_quality(
            self.store.load_library(self.run_id, step - 1),
            library,
            stats,
            self.store.records("operations", self.run_id, step),
            self.store.records("summaries", self.run_id, step),
        )
        self.store.write_stage(self.run_id, step, CHECKPOINT, {"experience_stats": stats, "library_quality": [quality]})
        await acreate_table_artifact(
            [q.model_dump() for q in self.store.records("library_quality", self.run_id)],
            key=artifact_key(self.run_id, "quality"),
            description="Library quality per version: size, tokens, duplicates, confidence, coverage, churn",
        )
        self.log.info("step %d: %s", step, describe_quality(quality))
        self.log.info(
            "step %d (epoch %d): accuracy %.3f, groups %d/%d selected, proposals %d parsed / %d failed, "
            "operations %d applied / %d rejected, library %d, %d calls (%d requests), tokens %d in / %d out, "
            "cost $%.4f; exported %s",
            step,
            planned.epoch + 1,
            report.accuracy,
            report.groups_selected,
            report.groups_total,
            report.proposals_parsed,
            report.proposals_failed,
            report.operations_applied,
            report.operations_rejected,
            report.library_size,
            report.llm_calls,
            report.llm_requests,
            report.tokens_in,
            report.tokens_out,
            report.cost_usd,
            paths[0],
        )
        if problems := step_problems(report, agent=self.cfg.rollout.agent_settings()):
            self.log.warning("step %d: %s (details: clgrpo report %s)", step, "; ".join(problems), self.run_id)

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
        outputs = await self.stage(step, VALIDATE_STAGE, lambda: validator.compute(step, library), EVAL_TABLES)
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
        problems = await self.problems()
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
            done = self.store.stage_done(self.run_id, planned.step, CHECKPOINT)
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
        return TrainResult(
            self.run_id, str(self.store.path), library.version, len(library), str(export_dir(self.cfg)), reports
        )


def step_problems(report: StepReport, agent: AgentConfig | None = None) -> list[str]:
    """What went wrong in a stored step, for a WARNING line: failures, retries, unusable learner replies."""
    found = [
        (report.rollouts_failed, "policy samples failed"),
        (report.verify_failed, "samples could not be verified"),
        (report.rollouts_truncated, "replies were cut off at max_tokens (graded, marked)"),
        (report.summaries_failed, "summaries failed"),
        (report.proposals_call_failed, "learner calls for group proposals failed"),
        (report.proposals_failed - report.proposals_call_failed, "group proposals were unusable replies"),
        (report.llm_retries, "requests were retries"),
        (report.llm_rate_limited, "requests were rate limited (429)"),
    ]
    problems = [f"{n} {what}" for n, what in found if n]
    if report.consolidation_failed:
        problems.append("the consolidation reply was unusable: no operations")
    elif report.operations_proposed and not (report.operations_applied or report.operations_rejected):
        problems.append(
            f"the consolidation plan kept none of the {report.operations_proposed} proposed operations "
            f"(the learner's decision; learning.consolidation: passthrough applies the group proposals)"
        )
    if agent is not None and report.tool_calls == 0 and report.model_turns:
        hint = (
            "the endpoint may ignore `tools` (some local servers accept and drop them): try "
            "rollout.agent.protocol: text"
            if agent.protocol != "text"
            else "the model wrote no action"
        )
        problems.append(f"agent mode, but no rollout called a tool: {hint}")
    if report.groups_selected and report.proposals_parsed == 0:
        problems.append(f"all {report.proposals_total} group proposals failed: this step learned nothing")
    return problems


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
    # the run lock: no other live process runs this run id on this database (the store holds the file only
    # while it works, so other runs and readers share it)
    with RunLock(config.db_path, "train", config.run_id), Store(config.db_path) as store:
        await mark_stale_runs_crashed(db_path=config.db_path, run_id=config.run_id)
        config = resolve_policy_adapter(config, store)  # RUN:STEP -> the stored adapter's folder, checked
        return await Trainer(config, store).run()
