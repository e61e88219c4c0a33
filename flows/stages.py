"""The stage protocol, once: a stage stored is read back, else computed and its typed output stored atomically.

Training (its dataset, the stages of its step, held-out validation), an evaluation and a refresh run their stages
through ``StageRunner.run``, keyed by (run id, step, stage). While a stage is computed its model calls (and finished
items) go to the run's work journal (``clgrpo.storage.journal``); a failed computation keeps the calls it paid for,
without marking the stage done, and failed items beyond their tolerance fail the stage (``tasks.integrity``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from clgrpo.llm import LLMCallError
from clgrpo.process import progress, stopping
from clgrpo.storage.journal import RunJournal, recording
from clgrpo.storage.store import Store
from schemas.config import ToleranceConfig
from tasks.integrity import FailedItems, FailureRule, StageFailedError, stage_failed_message
from tasks.outputs import Calls, Out

Expect = Callable[[], tuple[int, str]]  # a stage's progress bar: (items, unit)


@dataclass
class StageRunner:
    """The stages of one run id in ``store``. ``journal``: the run's work journal (None: its stages make no model
    calls); ``before_compute``: called with (step, name) before a stage is computed (training: the budget)."""

    store: Store
    run_id: str
    log: logging.Logger | logging.LoggerAdapter[Any]
    journal: RunJournal | None = None
    tolerance: ToleranceConfig = field(default_factory=ToleranceConfig)
    before_compute: Callable[[int, str], None] | None = None

    async def run(
        self,
        step: int,
        name: str,
        kind: type[Out],
        compute: Callable[[], Awaitable[Out]],
        *,
        where: str | None = None,
        expect: Expect | None = None,
        computed: Out | None = None,
        failures: FailureRule | None = None,
        before_write: Callable[[Out], None] | None = None,
        journals_items: bool = True,
        keep_empty: bool = True,
    ) -> Out:
        """The stage's output (``kind``): read back when stored, else computed and written. ``where``: its name in
        log lines (``step <step> <name>``); ``expect``: (items, unit) for its progress bar; ``computed``: its output
        computed already (the pipeline's: only checked and written); ``failures``: its failure rule;
        ``journals_items`` False: the journal keeps its calls only; ``keep_empty`` False: no rows, nothing stored."""
        said = where or f"step {step} {name}"
        if self.store.stage_done(self.run_id, step, name):
            self.log.info("%s: already stored, reading it back", said)
            return self.store.read_stage(kind, self.run_id, step, name)
        stopping.note_stage(where or (f"step {step} {name}" if step else name))
        if computed is None:
            computed = await self.compute(step, name, compute, expect, journals_items)
        output = computed.with_calls(partial(self.journal.step(step).all_calls, name)) if self.journal else computed
        if failures is not None:
            self.check_failures(step, failures.count(name, output))
        if before_write:
            before_write(output)
        rows = output.rows()
        if keep_empty or any(rows.values()):
            self.store.write_stage(self.run_id, step, name, rows)
            self.log.info("%s: stored %s", said, describe_rows(rows))
        return output

    async def compute(
        self, step: int, name: str, compute: Callable[[], Awaitable[Out]], expect: Expect | None, journals_items: bool
    ) -> Out:
        """A stage's computation, in the step's work journal, with its progress bar; a failed one keeps its calls."""
        if self.before_compute:
            self.before_compute(step, name)
        if expect:
            progress.start(step, name, *expect())
        try:
            with recording(self.journal.step(step) if self.journal else None, stage=name, items=journals_items):
                return await compute()
        except BaseException as exc:
            self.keep_calls(step, name)
            if isinstance(exc, LLMCallError):  # a stage that needs every call (consolidation) lost one
                raise StageFailedError(
                    f"step {step} {name}: a learner call failed after its retries: {exc}. "
                    f"Fix the cause, then Retry the flow run (Prefect UI) or rerun with "
                    f"--run-id {self.run_id}: finished items are not redone."
                ) from exc
            raise
        finally:
            progress.finish(name)

    def check_failures(self, step: int, items: FailedItems) -> None:
        """The integrity rule: over tolerance, keep the calls and fail; under it, warn (and count)."""
        if items.failed == 0:
            return
        tolerance = self.tolerance.of(items.tolerance_setting)
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
        calls = self.journal.step(step).calls(name) if self.journal else []
        if calls:
            self.store.write_unfinished(self.run_id, step, name, Calls(calls).rows())

    def keep_unrecorded_calls(self) -> None:
        """Calls of stage attempts that failed or were killed, from every journal on disk, into llm_calls."""
        if self.journal is None:
            return
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


def describe_rows(outputs: Mapping[str, Sequence[Any]]) -> str:
    """``{"rollouts": [32 items], "llm_calls": [8 items]}`` -> "32 rollouts, 8 llm calls"."""
    parts = [f"{len(rows)} {table.replace('_', ' ')}" for table, rows in outputs.items()]
    return ", ".join(parts) if parts else "the stage marker"
