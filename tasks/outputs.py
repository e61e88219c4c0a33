"""What each stage of the training step stores: one small dataclass per stage whose fields are its tables.

The field names are the DuckDB tables the stage writes (one transaction, keyed by run, step and stage); the
values are that table's records. The flow writes ``rows()`` and reads a stored stage back with ``from_rows``, the
pipelined path (``tasks.pipeline``) builds the same types, and the step state holds them by type, so a table is
named in one place: its stage's output class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from schemas.records import (
    AdapterVersion,
    GateDecision,
    GateSample,
    GroupAdvantage,
    LessonTrial,
    LLMCall,
    OperationResult,
    Proposal,
    Reward,
    Rollout,
    Summary,
    TrialSample,
)

Out = TypeVar("Out", bound="StageOutput")


@dataclass
class StageOutput:
    """A stage's tables: every field is one table and holds that table's records."""

    @classmethod
    def tables(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_rows(cls: type[Out], rows: Mapping[str, Sequence[Any]]) -> Out:
        return cls(**{table: list(rows[table]) for table in cls.tables()})

    def rows(self) -> dict[str, list[Any]]:
        return {table: getattr(self, table) for table in self.tables()}


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
class Plans(StageOutput):
    """The consolidation's plans (stored in ``proposals`` under its own stage): chunk plans, then the final one."""

    proposals: list[Proposal] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Trials(StageOutput):
    lesson_trials: list[LessonTrial] = field(default_factory=list)
    trial_samples: list[TrialSample] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Gate(StageOutput):
    gate_samples: list[GateSample] = field(default_factory=list)
    library_gates: list[GateDecision] = field(default_factory=list)
    llm_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class Applied(StageOutput):
    operations: list[OperationResult] = field(default_factory=list)
