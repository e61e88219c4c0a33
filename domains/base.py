"""The Domain protocol: what a domain plug-in supplies to the pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from domains.learner import LearnerPrompts
from schemas.config import DatasetConfig
from schemas.records import Problem

Message = dict[str, str]


@dataclass(frozen=True)
class VerifyResult:
    """One grade, or the verifier's admission that it could not grade.

    ``verified`` True: ``reward`` is a genuine grade (1.0 correct, 0.0 wrong, no answer found, empty output; ``error``
    may say why it is 0). ``verified`` False: the verifier could not do its work (it could not start, the item
    timed out, a worker crashed or hung, the pool kept restarting, an unexpected error, the reference answer is
    missing or unparseable); the cause is in ``error`` and ``reward`` is 0.0 only as a placeholder -- callers must
    not use it as a grade (store an error, retry).
    """

    reward: float  # in [0, 1]
    extracted: str | None = None  # the answer the verifier read from the output
    error: str | None = None  # why the reward is 0 (no answer found, ...) or why there is no grade
    verified: bool = True  # False: no grade (see above); the reward is then meaningless


@dataclass(frozen=True)
class LoadReport:
    """What loading a dataset kept and dropped (nothing is dropped without a count)."""

    source: str
    n_rows: int  # valid rows read
    n_duplicates_dropped: int  # rows whose normalized problem text repeats an earlier row
    n_after_limit: int  # problems returned
    dropped_ids: tuple[str, ...] = ()  # ids of the dropped duplicates
    n_oversize_skipped: int = 0  # rows left out for a problem or answer over the size limits (oversize: skip)
    oversize_ids: tuple[str, ...] = ()  # ids of those rows


@dataclass(frozen=True)
class Tool:
    """An optional tool for agent rollouts (name, JSON-schema parameters, implementation)."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[..., str]


@runtime_checkable
class Domain(Protocol):
    name: str
    learner_prompts: LearnerPrompts  # wording of the summarize / extract / consolidate prompts

    def load_dataset(self, cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
        """Load, validate, de-duplicate, shuffle and truncate the problems."""
        ...

    def verify(self, output: str, answer: str) -> VerifyResult:
        """Grade one output against the ground truth; never raises."""
        ...

    def verify_batch(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        """Grade many (output, answer) pairs; never raises."""
        ...

    def rollout_messages(self, problem: Problem, library_text: str) -> list[Message]:
        """Chat messages for one rollout. The library goes before the problem (shared prefix)."""
        ...

    def tools(self) -> list[Tool]:
        ...

    def warm(self) -> None:
        """Start whatever verification needs, in the background; returns at once. Optional: callers use
        ``getattr(domain, "warm", None)``, so a domain without it still works."""
        ...


_REGISTRY: dict[str, Callable[[], Domain]] = {}


def register_domain(name: str, factory: Callable[[], Domain]) -> None:
    _REGISTRY[name] = factory


def get_domain(name: str) -> Domain:
    if name not in _REGISTRY and name == "math":
        import domains.math  # noqa: F401  (registers itself)
    if name not in _REGISTRY:
        raise KeyError(f"unknown domain {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
