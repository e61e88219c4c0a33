"""How the run config names its results, and how it migrates: the fingerprint's rules, declared once.

A run id is bound to its config's fingerprint (``RunConfig.fingerprint``): a hash of every setting that shapes
results. Two things decide what it hashes, as columns and migrations decide a table (``schemas/tables.py``):

- What a field is, said beside it (``Annotated[..., marker]``; pydantic ignores these markers, only the functions
  here read them): ``NotFingerprinted`` (it shapes no result: where a model is reached, how fast, when a run
  stops), ``CountsWhen`` (it shapes results only when its section says so: a disabled feature's settings),
  ``FingerprintedAs`` / ``Inlined`` (the name it has in the fingerprint, where that differs from the config's:
  fingerprints are older than some sections) and ``FingerprintedBy`` (its own code writes it: a domain's
  settings).
- ``MIGRATIONS``: the settings added after the first release, in the order they were added, each with the value
  a config made before it had. A setting at that value is left out of the fingerprint, so a run made before the
  setting existed keeps its fingerprint; a section added later is left out while it is at its defaults (a
  setting added to it since counts as at its default at either value). A stored config (``migrate``) gets each
  setting it lacks at that value, so it reads back as the run ran.

Adding a setting is its field and one entry at the end of ``MIGRATIONS`` (with the value runs made before had:
usually the new default, never a changed one). This module imports nothing of the config, so that the config
imports it; the config's own classes are reached through the instances and classes handed in.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel


# --- what a field says of itself ------------------------------------------------------------------------------
@dataclass(frozen=True)
class NotFingerprinted:
    """Beside a field that shapes no result: left out of the run fingerprint, of evaluation fingerprints and of
    sample keys. ``kept_by_runs``: the run fingerprint keeps it all the same, as it has since the first release
    (what a model costs does not change what it draws, but leaving it out now would give every stored run
    another fingerprint); evaluations and sample keys leave it out."""

    kept_by_runs: bool = False


NOT_FINGERPRINTED = NotFingerprinted()


@dataclass(frozen=True)
class CountsWhen:
    """Beside a field that shapes results only when ``holds`` of the section holding it (its feature is on)."""

    holds: Callable[[Any], bool]


@dataclass(frozen=True)
class FingerprintedAs:
    """Beside a field whose name in the fingerprint is ``name`` (it was named so there before the config's)."""

    name: str


@dataclass(frozen=True)
class Inlined:
    """Beside a section whose fingerprinted settings go in the section holding it, as they were before it had a
    section of its own."""


@dataclass(frozen=True)
class FingerprintedBy:
    """Beside a field whose own code writes it into the fingerprint: ``write(section, payload)`` (the section
    holding it, and that section's part of the fingerprint, after every other rule)."""

    write: Callable[[Any, dict[str, Any]], None]


# --- what a config made before a setting existed had ----------------------------------------------------------
@dataclass(frozen=True)
class Defaults:
    """A whole section at its defaults, with ``changed`` settings otherwise (``defaults(enabled=False)``)."""

    changed: dict[str, Any] = field(default_factory=dict)


def defaults(**changed: Any) -> Defaults:
    return Defaults(changed)


@dataclass(frozen=True)
class ConfigMigration:
    """Settings added together (``name`` says what came with them): dotted path -> the value a config made
    before had (a ``Defaults`` for a whole section)."""

    name: str
    adds: dict[str, Any]


MIGRATIONS: list[ConfigMigration] = [
    ConfigMigration("held-out validation", {"validation": None}),
    ConfigMigration("a cap on the steps", {"grpo.max_steps": None}),
    ConfigMigration("the shortest lesson", {"learning.min_words": 5}),
    ConfigMigration("consolidation without a learner call", {"learning.consolidation": "llm"}),
    ConfigMigration("a pattern every lesson matches", {"learning.lesson_pattern": None}),
    ConfigMigration("repetition penalty", {"policy.repetition_penalty": None, "learner.repetition_penalty": None}),
    ConfigMigration(
        "bounded learning and input limits",
        {
            "learning.max_ops_per_step": 30,
            "learning.guard": "standard",
            "learning.max_learner_tokens": 2048,
            "dataset.max_problem_chars": 20_000,
            "dataset.max_answer_chars": 1_000,
            "dataset.oversize": "error",
        },
    ),
    ConfigMigration("agent rollouts", {"rollout.mode": "direct"}),
    ConfigMigration("near-duplicate control", {"library.near_duplicates": "off"}),
    ConfigMigration(
        "retrieval, domain routing and the library's token budget",
        {"library.injection": "all", "library.max_tokens": None, "dataset.domain_field": None},
    ),
    ConfigMigration("web questions' start pages", {"dataset.url_field": None}),
    ConfigMigration("an LLM judge", {"judge": None}),
    ConfigMigration(
        "contrast extraction and lesson validation",
        {
            "learning.extract": "operations",
            "learning.candidates": 1,
            "learning.fallback": "none",
            "learning.summarize": True,
            "learning.lesson_validation": defaults(),
        },
    ),
    ConfigMigration("task tags", {"dataset.tag_field": "tag", "validation.dataset.tag_field": "tag"}),
    ConfigMigration(
        "problems without answers",
        {"dataset.answer_source_field": None, "dataset.answers_optional": False, "learning.unlabeled": "compare"},
    ),
    ConfigMigration("hybrid learning", {"policy.adapter": None, "learner.adapter": None, "hybrid": defaults()}),
    ConfigMigration(
        "the library gate (off before it was on by default) and the sign test of lessons",
        {
            "learning.library_gate": defaults(enabled=False),
            "learning.lesson_validation.trials_on": "sources_first",
            "learning.lesson_validation.test": "mean",
            "learning.lesson_validation.max_problems": None,
            "learning.lesson_validation.alpha": 0.05,
        },
    ),
    ConfigMigration("lessons a person rejected", {"learning.blocked": []}),
    ConfigMigration("the gate's level of better", {"learning.library_gate.adopt_alpha": 0.2}),
    ConfigMigration("a sequential gate", {"learning.library_gate.looks": 1}),
    ConfigMigration("clusters of near-duplicate candidates", {"learning.lesson_validation.cluster_tries": 1}),
    ConfigMigration("a budget of the checks", {"learning.checks_budget": None}),
    ConfigMigration("trials by support", {"learning.lesson_validation.order": "plan"}),
    ConfigMigration(
        "worked examples",
        {
            "learning.examples": "off",
            "learning.rationalize_max": 6,
            "library.examples_shown": 2,
            "library.examples_as": "turns",
        },
    ),
]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class DefaultChange:
    """A default that changed after runs were made with the older one (``older``): a run resumed from a config
    that leaves the setting unset goes on with the value it started with (``keep_started_values``), saying so;
    one that sets it is compared as it says. New runs get the new default."""

    path: str
    older: Any
    why: str


DEFAULT_CHANGES: list[DefaultChange] = [
    DefaultChange(
        "learning.examples",
        "off",
        "worked examples on by default since issue 57's report (benchmarks/learning_runs/experiments/issue57-tuning)",
    ),
]


def as_started(config: M, started: BaseModel, changes: Sequence[DefaultChange] | None = None) -> tuple[M, list[str]]:
    """``config`` (a run's config as given now) for resuming the run ``started`` describes (the config it stored,
    read as it ran): each changed default ``config`` leaves unset where the run started with another value keeps
    the run's value; and one line for each saying so."""
    lines: list[str] = []
    for change in DEFAULT_CHANGES if changes is None else changes:
        *parents, key = change.path.split(".")
        now: Any = config
        then: Any = started
        for part in parents:
            now, then = getattr(now, part, None), getattr(then, part, None)
        if not isinstance(now, BaseModel) or not isinstance(then, BaseModel) or key in now.model_fields_set:
            continue
        value, default = getattr(then, key, _MISSING), getattr(now, key)
        if value is _MISSING or value == default:
            continue
        config = _with_setting(config, change.path.split("."), value)
        lines.append(
            f"{change.path} stays {value!r} for this run, the value it started with (the default is now "
            f"{default!r}: {change.why}); set it in the config to change it"
        )
    return config, lines


def _with_setting(section: Any, path: list[str], value: Any) -> Any:
    """``section`` with the setting at ``path`` (its parts) set to ``value``, marked as set."""
    head, *rest = path
    return section.model_copy(update={head: _with_setting(getattr(section, head), rest, value) if rest else value})


# --- reading the markers ----------------------------------------------------------------------------------------
def not_fingerprinted(model: type[BaseModel], *, kept_by_runs: bool = False) -> set[str]:
    """The fields of ``model`` that the run fingerprint leaves out; with ``kept_by_runs`` also those it keeps
    all the same (together: what evaluations and sample keys leave out of a model's settings)."""
    return {
        name
        for name, info in model.model_fields.items()
        if any(isinstance(m, NotFingerprinted) and (kept_by_runs or not m.kept_by_runs) for m in info.metadata)
    }


def section_type(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The section class of ``model``'s field ``name`` (None: not a section, or no such field)."""
    info = model.model_fields.get(name)
    return _section_class(info.annotation) if info is not None else None


def result_settings(section: BaseModel) -> dict[str, Any]:
    """What of ``section`` shapes results, as its fields say (``NotFingerprinted``, ``CountsWhen``), under the
    config's names: the settings a fingerprint starts from, before migrations leave out what older runs had."""
    return _shaping(section, section.model_dump(mode="json"))


def fingerprint_payload(config: BaseModel, migrations: Sequence[ConfigMigration] | None = None) -> dict[str, Any]:
    """What the fingerprint of ``config`` hashes: its settings that shape results, without those at the value a
    config made before they existed had (``migrations``, by default ``MIGRATIONS``), under their names in the
    fingerprint."""
    migrations = MIGRATIONS if migrations is None else migrations
    payload = result_settings(config)
    for index, migration in enumerate(migrations):
        for path, older in migration.adds.items():
            _leave_out_if_older(payload, config, path, older, migrations[index + 1 :])
    _lay_out(config, payload)
    return payload


def migrate(data: dict[str, Any], model: type[BaseModel], migrations: Sequence[ConfigMigration] | None = None) -> dict:
    """A stored config (``model``'s JSON data) as this version reads it: each setting a migration added that it
    lacks, at the value configs made before had, in the migrations' order (a section: its defaults then, so a
    setting added to it later is not asked for again)."""
    data = copy.deepcopy(data)
    for migration in MIGRATIONS if migrations is None else migrations:
        for path, older in migration.adds.items():
            *parents, key = path.split(".")
            holder: Any = data
            section: type[BaseModel] | None = model
            for part in parents:
                holder = holder.get(part) if isinstance(holder, dict) else None
                section = section_type(section, part) if section is not None else None
            if isinstance(holder, dict) and key not in holder:
                holder[key] = _older_value(older, section_type(section, key) if section is not None else None)
    return data


# --- the rules applied ------------------------------------------------------------------------------------------
_MISSING = object()


def _section_class(annotation: Any) -> type[BaseModel] | None:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        found = [c for c in map(_section_class, get_args(annotation)) if c is not None]
        return found[0] if len(found) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _shaping(section: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(section).model_fields.items():
        marks = info.metadata
        if name not in dumped or any(isinstance(m, FingerprintedBy) for m in marks):
            continue
        if any(isinstance(m, NotFingerprinted) and not m.kept_by_runs for m in marks):
            continue
        if any(isinstance(m, CountsWhen) and not m.holds(section) for m in marks):
            continue
        value = getattr(section, name)
        out[name] = _shaping(value, dumped[name]) if isinstance(value, BaseModel) else dumped[name]
    return out


def _older_value(older: Any, section: type[BaseModel] | None) -> Any:
    if isinstance(older, Defaults):
        if section is None:
            raise TypeError(f"defaults({older.changed}) names a setting that is not a section")
        return section(**older.changed).model_dump(mode="json")
    return copy.deepcopy(older)


def _leave_out_if_older(
    payload: dict[str, Any], config: BaseModel, path: str, older: Any, later: Sequence[ConfigMigration]
) -> None:
    """Leave ``path`` out of ``payload`` when it is at ``older``, and a section that this leaves empty too."""
    *parents, key = path.split(".")
    holders: list[tuple[dict[str, Any], str]] = []
    holder: Any = payload
    section: Any = config
    for part in parents:
        if not isinstance(holder, dict) or part not in holder:
            return
        holders.append((holder, part))
        holder, section = holder[part], getattr(section, part, None)
    if not isinstance(holder, dict) or key not in holder:
        return
    if isinstance(older, Defaults):
        value = getattr(section, key)
        since = {p[len(path) + 1 :]: o for m in later for p, o in m.adds.items() if p.startswith(f"{path}.")}
        at_older = _at_defaults(holder[key], result_settings(type(value)(**older.changed)), since)
    else:
        at_older = holder[key] == older
    if not at_older:
        return
    del holder[key]
    while holders and not holder:  # a section every setting of which was left out: left out itself
        holder, part = holders.pop()
        del holder[part]


def _at_defaults(value: Any, defaults: dict[str, Any], since: dict[str, Any]) -> bool:
    """A section's settings all at their defaults, those added to it ``since`` (-> the older value) at either."""
    if not isinstance(value, dict):
        return False
    return all(
        value.get(key, _MISSING) == defaults.get(key, _MISSING)
        or (key in since and value.get(key, _MISSING) == since[key])
        for key in value.keys() | defaults.keys()
    )


def _lay_out(section: BaseModel, payload: dict[str, Any]) -> None:
    """Rename and inline what its fields say, innermost first; then what a field's own code writes."""
    writers = []
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel) and isinstance(payload.get(name), dict):
            _lay_out(value, payload[name])
        for mark in info.metadata:
            if isinstance(mark, FingerprintedBy):
                writers.append(mark.write)
            elif name not in payload:
                continue
            elif isinstance(mark, FingerprintedAs):
                payload[mark.name] = payload.pop(name)
            elif isinstance(mark, Inlined):
                payload.update(payload.pop(name))
    for write in writers:
        write(section, payload)
