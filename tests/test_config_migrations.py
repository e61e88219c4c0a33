"""What names a run's results, over many configs: each of a few base configs (the defaults, the gate off, the
checks on, agent rollouts, retrieval, hybrid learning, every optional section set, the web domain) and every
config one setting away from it, with the run fingerprint, the evaluation fingerprint and the sample key's
identity of each. ``tests/snapshots/config_fingerprints.json`` holds them, hashed per base and section (a
refactor must leave them byte-identical; ``CLGRPO_UPDATE_SNAPSHOTS=1`` rewrites them, for a change meant to
alter them, and the commit says which). Then the config migrations themselves: each names settings of the run
config, after the section they are in; a stored config reads back with what runs made before had, the old run's
(``tests/data/old_run``) with the fingerprint it was stored with; and a setting added with one migration resumes
a run made before it."""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

import domains  # noqa: F401 - the registry reads the web domain's settings
from clgrpo.storage.store import Store
from flows.evaluate import eval_fingerprint
from schemas import config_migrations
from schemas.config import DatasetConfig, EvalConfig, LearningConfig, LibraryGate, RunConfig
from schemas.config_migrations import MIGRATIONS, ConfigMigration, Defaults, migrate, section_type
from schemas.records import Problem, text_hash
from tasks.measure import Sampling

SNAPSHOT = Path(__file__).parent / "snapshots" / "config_fingerprints.json"
UPDATE = os.environ.get("CLGRPO_UPDATE_SNAPSHOTS") == "1"

BASES: dict[str, dict[str, Any]] = {
    "default": {},
    "gate-off": {"learning": {"library_gate": {"enabled": False}}},
    "checks": {"learning": {"lesson_validation": {"enabled": True}, "library_gate": {"enabled": False}}},
    "agent": {"rollout": {"mode": "agent"}},
    "library": {"library": {"injection": "top_k", "near_duplicates": "reject"}},
    "hybrid": {"hybrid": {"enabled": True}},
    "sections": {"validation": {"dataset": {"path": "v.jsonl"}}, "judge": {}, "learner": {"model": "l"}},
    "web": {"domain": "web", "rollout": {"mode": "agent"}, "domain_settings": {"search": {"top_k": 3}}},
}
WEB_SETTINGS: list[dict[str, Any]] = [
    {},
    {"search": {"top_k": 5}},
    {"open": {"max_links": 9}},
    {"search": {"backend": "http", "url_template": "http://x/{query}"}},
]
# the values a setting is tried with (those its section accepts, at most three per setting)
WORDS = (
    "auto off reject merge top_k all turns block llm passthrough contrast operations compare agreement strict "
    "standard rollouts rationalize sign mean others sources_first plan support better significant agent direct "
    "pool local tools text skip error transformers vllm openai embedded float32 bfloat16 x"
).split()
PROBLEMS = [Problem(problem_id="p1", problem="What is 2 + 3?", answer="5")]
EVALUATION = EvalConfig(dataset=DatasetConfig(path="e.jsonl"))


def tried_values(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, 1, 0]
    if isinstance(value, float):
        return [round(value + 0.05, 6), value * 0.5, value + 1]
    if isinstance(value, str):
        return [*WORDS, value + "x"]
    if value is None:
        return [1, 2, 0.5, "x", "auto", ["x"], True, "bfloat16", {"a": 1}]
    if isinstance(value, list):
        return [["x"], [{"text": "Do not guess the answer ever.", "reason": "r"}]]
    if isinstance(value, dict) and not value:
        return [{"a": 1}]
    return []


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        for key in sorted(tree):
            yield from leaves(tree[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def with_value(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    *parents, last = path.split(".")
    holder = tree
    for part in parents:
        holder = holder[part]
    holder[last] = value
    return tree


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) and value else value
    return out


def names(config: RunConfig) -> list[str]:
    """What names the results of ``config``: its run fingerprint, an evaluation's and a sample key's identity."""
    evaluation = eval_fingerprint(config, EVALUATION, [], PROBLEMS)
    return [config.fingerprint(), evaluation, Sampling.of(config, 0.5).identity]


def corpus() -> dict[str, list[str]]:
    """``base``, ``base:setting=value`` (one setting changed) and ``base:web-settings=...`` -> names."""
    out: dict[str, list[str]] = {}
    for base_name, extra in BASES.items():
        given = merged({"run_id": "r", "dataset": {"path": "t.jsonl"}}, extra)
        base = RunConfig.model_validate(given)
        out[base_name] = names(base)
        dump = base.model_dump(mode="json") | {"domain_settings": given.get("domain_settings", {})}
        for path, value in leaves({k: v for k, v in dump.items() if k not in ("domain", "domain_settings")}):
            tried = 0
            for other in tried_values(value):
                if other == value or tried == 3:
                    continue
                try:
                    config = RunConfig.model_validate(with_value(dump, path, other))
                except (ValidationError, ValueError):
                    continue
                tried += 1
                out[f"{base_name}:{path}={json.dumps(other)}"] = names(config)
        if base_name in ("default", "agent", "web"):
            for settings in WEB_SETTINGS:
                config = RunConfig.model_validate(dump | {"domain": "web", "domain_settings": settings})
                out[f"{base_name}:web-settings={json.dumps(settings, sort_keys=True)}"] = names(config)
    return out


def grouped(cases: dict[str, list[str]]) -> dict[str, str]:
    """The cases hashed per base and section (``agent:learning``), so that a change names where it is."""
    groups: dict[str, dict[str, list[str]]] = {}
    for case, value in cases.items():
        base, _, setting = case.partition(":")
        group = setting.split("=")[0].split(".")[0] if setting else ""
        groups.setdefault(f"{base}:{group}" if group else base, {})[case] = value
    return {group: text_hash(json.dumps(members, sort_keys=True)) for group, members in groups.items()}


def test_what_names_results_is_unchanged_over_a_corpus_of_configs():
    text = json.dumps(grouped(corpus()), indent=1, sort_keys=True) + "\n"
    if UPDATE:
        SNAPSHOT.write_text(text, encoding="utf-8")
    expected, now = json.loads(SNAPSHOT.read_text(encoding="utf-8")), json.loads(text)
    changed = sorted(group for group in expected.keys() | now.keys() if expected.get(group) != now.get(group))
    assert not changed, f"{SNAPSHOT.name}: what names results changed in {changed}"


# --- the migrations -------------------------------------------------------------------------------------------
OLD_RUN = Path(__file__).parent / "data" / "old_run" / "old_run.duckdb.gz"


def setting(tree: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        tree = tree[part]
    return tree


def test_each_migration_adds_settings_of_the_run_config_after_the_sections_they_are_in():
    assert len({m.name for m in MIGRATIONS}) == len(MIGRATIONS)
    earlier: list[str] = []
    for migration in MIGRATIONS:
        for path in migration.adds:
            *parents, key = path.split(".")
            section: type[BaseModel] | None = RunConfig
            for part in parents:
                section = section_type(section, part) if section is not None else None
            assert section is not None and key in section.model_fields, f"{migration.name}: no setting {path}"
            later_sections = [p for m in MIGRATIONS[MIGRATIONS.index(migration) + 1 :] for p in m.adds]
            assert not any(path.startswith(f"{p}.") for p in later_sections), f"{path} comes before its section"
            assert path not in earlier, f"{path} is added twice"
            earlier.append(path)


def test_a_stored_config_reads_back_with_what_a_run_made_before_a_setting_had():
    sections = {"learner": {}, "validation": {"dataset": {"path": "v.jsonl"}}, "policy": {}, "library": {}}
    learning = {"lesson_validation": {}, "library_gate": {}}
    stored = {"dataset": {"path": "t.jsonl"}, "learning": learning, "rollout": {}, **sections}
    config = RunConfig.model_validate(migrate(stored, RunConfig)).model_dump(mode="json")
    for migration in MIGRATIONS:
        for path, older in migration.adds.items():
            if not isinstance(older, Defaults) and path not in stored:  # (the sections given are kept)
                assert setting(config, path) == older, path
    # a section added later: as it was then (the gate was off before it was on by default)
    before_the_gate = RunConfig.model_validate(migrate({"dataset": {"path": "t.jsonl"}, "learning": {}}, RunConfig))
    assert before_the_gate.learning.library_gate == LibraryGate(enabled=False)
    assert RunConfig(dataset={"path": "t.jsonl"}).learning.library_gate.enabled == "auto"  # a new config: today's


def test_the_old_runs_stored_config_reads_back_with_the_fingerprint_it_was_stored_with(tmp_path):
    with gzip.open(OLD_RUN) as packed, open(tmp_path / "old_run.duckdb", "wb") as db:
        shutil.copyfileobj(packed, db)
    with Store(tmp_path / "old_run.duckdb") as store:
        (fingerprint,) = store.query("SELECT fingerprint FROM runs")["fingerprint"]
        config = store.run_config("old-run")
    assert config.fingerprint() == fingerprint
    lessons = config.learning.lesson_validation
    assert (lessons.cluster_tries, lessons.order, config.learning.checks_budget) == (1, "plan", None)  # as it ran


class LearningWithPatience(LearningConfig):
    """The learning section of a later version, with one setting more: what runs made before did is 0."""

    patience: int = Field(2, ge=0)


class LaterRunConfig(RunConfig):
    learning: LearningWithPatience = Field(default_factory=LearningWithPatience)


def test_a_setting_added_with_its_migration_resumes_a_run_made_before_it(tmp_path, monkeypatch):
    """Adding a setting is its field and one migration: a run stored before it reads back with the value it ran
    with, and resumes under its fingerprint with that value; another value is another run."""
    older = RunConfig(run_id="r", dataset=DatasetConfig(path="t.jsonl"), grpo={"group_size": 3})
    with Store(tmp_path / "runs.duckdb") as store:
        assert store.register_run(older)
        stored = store.query("SELECT fingerprint, config_json FROM runs")
    (fingerprint,), (config_json,) = stored["fingerprint"], stored["config_json"]
    later = {**older.model_dump(), "learning": LearningWithPatience(patience=0).model_dump()}
    assert LaterRunConfig.model_validate(later).fingerprint() != fingerprint  # without its migration: every run
    monkeypatch.setattr(
        config_migrations, "MIGRATIONS", [*MIGRATIONS, ConfigMigration("patience", {"learning.patience": 0})]
    )

    read_back = LaterRunConfig.from_stored(config_json)
    assert read_back.learning.patience == 0 and read_back.fingerprint() == fingerprint
    resumed = LaterRunConfig.model_validate(later)
    assert resumed.fingerprint() == fingerprint
    with Store(tmp_path / "runs.duckdb") as store:
        assert not store.register_run(resumed)  # the same run: resumed, not started again
        assert store.query("SELECT fingerprint FROM runs")["fingerprint"].tolist() == [fingerprint]
    patient = LaterRunConfig.model_validate({**later, "learning": LearningWithPatience().model_dump()})
    assert patient.learning.patience == 2 and patient.fingerprint() != fingerprint  # today's default: another run


def test_a_run_made_before_a_default_changed_resumes_with_the_value_it_started_with(tmp_path):
    """Worked examples became the default after runs were made without them: such a run, resumed from a config
    that leaves the setting unset, keeps ``off`` and says so; a config that sets another value is another run."""
    before = RunConfig(run_id="r", dataset=DatasetConfig(path="t.jsonl"), learning={"examples": "off"})
    with Store(tmp_path / "runs.duckdb") as store:
        assert store.register_run(before)
        given = RunConfig(run_id="r", dataset=DatasetConfig(path="t.jsonl"))
        assert given.learning.examples == "rationalize" and given.fingerprint() != before.fingerprint()
        resumed, lines = store.as_started(given)
        assert resumed.learning.examples == "off" and resumed.fingerprint() == before.fingerprint()
        assert len(lines) == 1 and lines[0].startswith("learning.examples stays 'off' for this run")
        assert not store.register_run(resumed)  # resumed, nothing started again
        explicit = RunConfig(run_id="r", dataset=DatasetConfig(path="t.jsonl"), learning={"examples": "rollouts"})
        assert store.as_started(explicit) == (explicit, [])  # set in the config: compared as it says
        new = RunConfig(run_id="new", dataset=DatasetConfig(path="t.jsonl"))
        assert store.as_started(new) == (new, [])  # a new run: today's default


def test_agent_runs_leave_worked_examples_off_unless_the_config_sets_them():
    """An agent's worked example would be its final reply alone, without the tool calls that found the answer: in
    agent mode ``learning.examples`` defaults to off (the fingerprint of an agent config is the one it had before
    examples became the default), however the config is given; a config that sets it keeps what it says."""
    from schemas.config import LearningConfig, RolloutPlacement

    data = DatasetConfig(path="t.jsonl")
    before = RunConfig(dataset=data, rollout={"mode": "agent"}, learning={"examples": "off"})
    for given in (
        RunConfig(dataset=data, rollout={"mode": "agent"}),
        RunConfig(dataset=data, rollout=RolloutPlacement(mode="agent"), learning=LearningConfig(summarize=True)),
        RunConfig.model_validate({"dataset": {"path": "t.jsonl"}, "rollout": {"mode": "agent"}, "learning": {}}),
    ):
        assert given.learning.examples == "off" and given.fingerprint() == before.fingerprint()
    explicit = RunConfig(dataset=data, rollout={"mode": "agent"}, learning={"examples": "rollouts"})
    assert explicit.learning.examples == "rollouts"
    assert RunConfig(dataset=data).learning.examples == "rationalize"  # direct rollouts: the default
    assert RunConfig(dataset=data, rollout={"mode": "direct"}).learning.examples == "rationalize"
