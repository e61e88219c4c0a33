"""What each stage returns and stores (the training step's, an evaluation's, a refresh's): one small dataclass per
stage whose fields are its tables.

A stage task returns its stage's output type itself (there is no second, task-side result type), the flow stores
it as it is and reads a stored stage back into the same type. The field names are the DuckDB tables the stage
writes (one transaction, keyed by run, step and stage); the values are that table's records. The flow writes
``rows()`` and reads a stored stage back with ``from_rows``, the pipelined path (``tasks.pipeline``) builds the
same types group by group and ``joined`` puts parts together, and the step state holds them by type, so a table
is named in one place: its stage's output class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from schemas.records import (
    AdapterVersion,
    EvalComparison,
    EvalSample,
    EvalSummary,
    GateDecision,
    GateSample,
    GroupAdvantage,
    LessonTrial,
    LibraryVersion,
    LLMCall,
    Operation,
    OperationResult,
    Problem,
    Proposal,
    RefreshInput,
    RefreshReject,
    RefreshWatermark,
    Reward,
    Rollout,
    Summary,
    TrialSample,
)

Out = TypeVar("Out", bound="StageOutput")

FINAL = "final"  # the group id of the consolidation's final plan (the chunk plans are ``chunk-<i>``)
NOT_STORED = {"stored": False}  # a field's metadata: it travels with the output but is no table


@dataclass
class StageOutput:
    """A stage's tables: every field is one table and holds that table's records (a field whose metadata is
    ``NOT_STORED`` is none: it is what the stage hands to the flow beside its rows)."""

    @classmethod
    def tables(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.metadata.get("stored", True))

    @classmethod
    def from_rows(cls: type[Out], rows: Mapping[str, Sequence[Any]]) -> Out:
        return cls(**{table: list(rows[table]) for table in cls.tables()})

    @classmethod
    def joined(cls: type[Out], parts: Sequence[Out]) -> Out:
        """The parts' tables one after the other (chunks or groups of one stage, in order)."""
        return cls.from_rows({table: [x for part in parts for x in getattr(part, table)] for table in cls.tables()})

    def rows(self) -> dict[str, list[Any]]:
        return {table: getattr(self, table) for table in self.tables()}

    def with_calls(self: Out, complete: Callable[[list[LLMCall]], list[LLMCall]]) -> Out:
        """The output with its calls completed (``complete``: adds the work journal's, of attempts before this
        one); as it is for a stage that makes no calls."""
        if "llm_calls" not in self.tables():
            return self
        return replace(self, **{"llm_calls": complete(self.rows()["llm_calls"])})


@dataclass
class Calls(StageOutput):
    """Model calls alone: what an unfinished stage paid for, stored without its other tables."""

    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Problems(StageOutput):
    """The run's dataset, loaded once (``load_dataset``)."""

    problems: list[Problem] = field(default_factory=list)


@dataclass
class Rollouts(StageOutput):
    rollouts: list[Rollout] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Verified(StageOutput):
    """Rewards, and the numeric group advantages they give (verify's second table); an LLM judge's calls."""

    rewards: list[Reward] = field(default_factory=list)
    group_advantages: list[GroupAdvantage] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Adapters(StageOutput):
    adapters: list[AdapterVersion] = field(default_factory=list)


@dataclass
class Summaries(StageOutput):
    summaries: list[Summary] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class GroupProposals(StageOutput):
    """The semantic group advantage: one learner proposal per selected group."""

    proposals: list[Proposal] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Rationales(StageOutput):
    """Worked examples written with the reference answer in view (stored in ``proposals`` under its own stage): one
    proposal per rationalized group, holding the candidate example when the verifier accepted it."""

    proposals: list[Proposal] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Plans(StageOutput):
    """The consolidation's plans (stored in ``proposals`` under its own stage): chunk plans, then the final one."""

    proposals: list[Proposal] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)

    @property
    def operations(self) -> list[Operation]:
        """The final plan's operations (none when there was nothing to consolidate)."""
        return next((p.operations for p in self.proposals if p.group_id == FINAL), [])

    @property
    def failed(self) -> bool:
        """The final plan's reply was unusable after repair: no operations this step."""
        return any(p.group_id == FINAL and p.parse_error for p in self.proposals)


@dataclass
class Trials(StageOutput):
    lesson_trials: list[LessonTrial] = field(default_factory=list)
    trial_samples: list[TrialSample] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Gate(StageOutput):
    gate_samples: list[GateSample] = field(default_factory=list)  # both arms' samples (read ones: drawn False)
    library_gates: list[GateDecision] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Applied(StageOutput):
    """Every operation of the step, applied or rejected with its reason; ``library``: the library after them, which
    the flow saves before the rows (absent when the stage is read back: it is stored already)."""

    operations: list[OperationResult] = field(default_factory=list)
    library: LibraryVersion | None = field(default=None, metadata=NOT_STORED)


@dataclass
class Evaluated(StageOutput):
    """An evaluation's tables (stage ``evaluate``; inside a training run, its held-out validation): what
    ``tasks.evaluate``'s task returns for a chunk (its samples and calls) and the flow for the whole evaluation."""

    evaluations: list[EvalSummary] = field(default_factory=list)
    eval_results: list[EvalSample] = field(default_factory=list)
    eval_comparisons: list[EvalComparison] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Selected(StageOutput):
    """The problems a refresh trains on (stage ``refresh-select``); from a traces source also the rows it skipped
    and what it read (its watermark)."""

    refresh_inputs: list[RefreshInput] = field(default_factory=list)
    refresh_rejects: list[RefreshReject] = field(default_factory=list)
    refresh_watermarks: list[RefreshWatermark] = field(default_factory=list)
