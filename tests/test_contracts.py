"""The data contract is written three times and mapped once more; this test fails when they disagree, for every
table.

- ``schemas/ddl.py``: the DuckDB tables, as a new file gets them and as an old file gets them after its columns
  were added (``ADDED_COLUMNS``, ``DROPPED_NOT_NULL``): both must end up the same.
- ``schemas/frames.py``: one pandera model per table, with the same columns in the same order, the pandas dtype
  that each DuckDB type takes, and the same nullability.
- ``schemas/records.py`` and the store's mappers (``clgrpo/store.py``): each table has the record the store writes
  to it (or a reason below why not); every field of the record is stored (under its name, as ``NAME_json``, or as
  listed in ``FIELD_COLUMNS``), every column comes from a field or is one the store adds (``ADDED_BY_STORE``); a
  field and its same-named column agree on type and on NULL; the mappers write exactly the table's columns; and a
  record with every field set (and one with only what is required) comes back from DuckDB equal to itself.

A new column therefore goes into all three (and a mapper when it is not a plain field): see CONTRIBUTING.md.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any, Literal, get_args, get_origin

import duckdb
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from clgrpo import store as store_module
from clgrpo.library import ExperienceLibrary
from clgrpo.store import Store
from schemas import records
from schemas.ddl import ADDED_COLUMNS, DROPPED_NOT_NULL, STAGE_KEY, STAGE_TABLES, TABLE_DDL, create_statements
from schemas.frames import FRAMES

# --- which record each table holds ------------------------------------------------------------------------------
STAGE_RECORDS: dict[str, type[BaseModel]] = {  # written by Store.write_stage, read by Store.records
    "problems": records.Problem,
    "rollouts": records.Rollout,
    "rewards": records.Reward,
    "group_advantages": records.GroupAdvantage,
    "summaries": records.Summary,
    "proposals": records.Proposal,
    "operations": records.OperationResult,
    "llm_calls": records.LLMCall,
    "evaluations": records.EvalSummary,
    "eval_results": records.EvalSample,
    "eval_comparisons": records.EvalComparison,
    "refresh_inputs": records.RefreshInput,
    "refreshes": records.RefreshDecision,
    "refresh_gate": records.RefreshGateRow,
    "refresh_rejects": records.RefreshReject,
    "refresh_watermarks": records.RefreshWatermark,
    "experience_stats": records.ExperienceStat,
    "library_quality": records.LibraryQuality,
    "adapters": records.AdapterVersion,
    "lesson_trials": records.LessonTrial,
    "trial_samples": records.TrialSample,
    "gate_samples": records.GateSample,
    "library_gates": records.GateDecision,
    "review_requests": records.ReviewRequest,
    "review_decisions": records.ReviewDecision,
    "library_adoptions": records.LibraryAdoption,
}
LIBRARY_RECORDS: dict[str, type[BaseModel]] = {  # Store.save_library / load_library: a version and its lessons
    "library_versions": records.LibraryVersion,
    "library_experiences": records.Experience,
}
NO_RECORD = {  # tables the store fills itself, from no record
    "db_meta": "the file's identity (key, value), written once when the file is created",
    "runs": "a run's RunConfig as JSON with its fingerprint and status (Store.register_run, set_run_status)",
    "stage_runs": "the store's marker of a completed stage (Store.write_stage)",
    "embeddings": "cached vectors by model and text hash (Store.store_vectors)",
}

# --- how fields become columns, besides NAME -> NAME and NAME -> NAME_json ---------------------------------------
FIELD_COLUMNS: dict[tuple[str, str], tuple[str, ...]] = {
    ("rollouts", "turns"): ("turns_json", "final_text"),  # final_text: the last assistant turn, for SQL readers
    ("proposals", "operations"): ("operations_json", "n_operations"),
    ("operations", "operation"): ("op", "target_ids_json", "text", "rationale", "source_groups_json"),
    ("library_versions", "experiences"): ("n_experiences",),  # the lessons are rows of library_experiences
    ("library_experiences", "id"): ("exp_id",),
}
NOT_STORED = {
    ("library_versions", "shown"): "which lessons each prompt shows: travels with the version, never stored",
}
ADDED_BY_STORE: dict[str, tuple[str, ...]] = {  # columns no field holds (besides the stage key of stage tables)
    "problems": ("position",),  # the problem's place in the step's batch
    "library_versions": ("run_id", "content_hash"),
    "library_experiences": ("run_id", "version", "position"),
}

# the pandas dtype (as pandera names it) each DuckDB type is validated with, NOT NULL / nullable
FRAME_DTYPES: dict[str, tuple[str, str]] = {
    "VARCHAR": ("string[pyarrow]", "string[pyarrow]"),
    "INTEGER": ("int64", "Int64"),  # a nullable integer column needs pandas' nullable Int64 (not float NaN)
    "BIGINT": ("int64", "Int64"),
    "DOUBLE": ("float64", "float64"),
    "BOOLEAN": ("bool", "boolean"),
    "TIMESTAMP WITH TIME ZONE": ("datetime64[us, UTC]", "datetime64[us, UTC]"),
    "FLOAT[]": ("object", "object"),
}
# the DuckDB types a plain record field may be stored as
FIELD_TYPES: dict[type, tuple[str, ...]] = {
    str: ("VARCHAR",),
    int: ("INTEGER", "BIGINT"),
    float: ("DOUBLE",),
    bool: ("BOOLEAN",),
    datetime: ("TIMESTAMP WITH TIME ZONE",),
}


class Column(typing.NamedTuple):
    type: str
    nullable: bool


def _columns(statements: list[str]) -> dict[str, dict[str, Column]]:
    con = duckdb.connect(":memory:")
    for statement in statements:
        con.execute(statement)
    rows = con.execute(
        "SELECT table_name, column_name, data_type, is_nullable FROM duckdb_columns() "
        "WHERE NOT internal AND schema_name = 'main' ORDER BY table_name, column_index"
    ).fetchall()
    con.close()
    tables: dict[str, dict[str, Column]] = {}
    for table, column, data_type, nullable in rows:
        tables.setdefault(table, {})[column] = Column(data_type, nullable)
    return tables


DDL = _columns(create_statements())


def _first_release_statements() -> list[str]:
    """The tables as the first release created them: without the columns added since, NOT NULLs not yet lifted."""
    statements = []
    for table, body in TABLE_DDL.items():
        added = {c.split()[0] for c in ADDED_COLUMNS.get(table, [])}
        lifted = set(DROPPED_NOT_NULL.get(table, []))
        lines = [line for line in body.strip().splitlines() if line.strip().split()[0] not in added]
        lines = [f"{line.rstrip(',')} NOT NULL," if line.split()[0] in lifted else line for line in lines]
        statements.append(f"CREATE TABLE {table} ({chr(10).join(lines).rstrip(',')})")
    return statements


# --- tables and their three definitions --------------------------------------------------------------------------
def test_every_table_has_a_frame_and_a_record_or_a_reason():
    assert set(DDL) == set(TABLE_DDL) == set(FRAMES)
    homes = [set(STAGE_RECORDS), set(LIBRARY_RECORDS), set(NO_RECORD)]
    assert set().union(*homes) == set(TABLE_DDL), "a table with neither a record nor a reason"
    assert sum(len(h) for h in homes) == len(TABLE_DDL), "a table listed twice"
    assert set(STAGE_TABLES) == set(STAGE_RECORDS)
    assert set(store_module._ROWS) == set(STAGE_RECORDS), "a stage table without a record -> rows mapper"
    assert set(store_module._RECORDS) == set(STAGE_RECORDS), "a stage table without a row -> record mapper"
    assert set(store_module._ORDER) <= set(STAGE_RECORDS)


def test_an_old_file_after_its_columns_were_added_has_the_new_file_s_schema():
    migrated = _columns(_first_release_statements() + create_statements())
    for table, columns in DDL.items():
        assert dict(sorted(migrated[table].items())) == dict(sorted(columns.items())), table


@pytest.mark.parametrize("table", sorted(TABLE_DDL))
def test_the_frame_has_the_table_s_columns_types_and_nulls(table):
    frame = FRAMES[table].to_schema().columns
    assert list(frame) == list(DDL[table]), f"{table}: frame columns differ from the DDL's"
    for name, column in DDL[table].items():
        dtype = FRAME_DTYPES[column.type][column.nullable]
        assert str(frame[name].dtype) == dtype, f"{table}.{name}: {column.type} is validated as {dtype}"
        assert frame[name].nullable == column.nullable, f"{table}.{name}: nullable in one and not the other"


# --- records and the store's mappers -----------------------------------------------------------------------------
def _records() -> dict[str, type[BaseModel]]:
    return {**STAGE_RECORDS, **LIBRARY_RECORDS}


def _base(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``None``, and whether None is allowed."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), len(args) < len(get_args(annotation))
    return annotation, False


def _stored_under(table: str, name: str, info: FieldInfo) -> tuple[str, ...]:
    if (table, name) in FIELD_COLUMNS:
        return FIELD_COLUMNS[(table, name)]
    return (name,) if name in DDL[table] else (f"{name}_json",)


@pytest.mark.parametrize("table", sorted(_records()))
def test_every_field_is_a_column_and_every_column_a_field(table):
    model = _records()[table]
    stored = {
        column: name
        for name, info in model.model_fields.items()
        if (table, name) not in NOT_STORED
        for column in _stored_under(table, name, info)
    }
    missing = sorted(c for c in stored if c not in DDL[table])
    assert not missing, f"{table}: fields of {model.__name__} with no column: {missing}"
    key = STAGE_KEY if table in STAGE_RECORDS else ()
    extra = sorted(set(DDL[table]) - set(stored) - set(key) - set(ADDED_BY_STORE.get(table, ())))
    assert not extra, f"{table}: columns no field of {model.__name__} holds: {extra}"


@pytest.mark.parametrize("table", sorted(_records()))
def test_a_field_and_its_column_agree_on_type_and_null(table):
    model = _records()[table]
    for name, info in model.model_fields.items():
        column = DDL[table].get(name)
        if column is None or (table, name) in FIELD_COLUMNS:
            continue
        base, optional = _base(info.annotation)
        kind = str if get_origin(base) is Literal or (isinstance(base, type) and issubclass(base, StrEnum)) else base
        assert column.type in FIELD_TYPES[kind], f"{table}.{name}: {column.type} holds a {base}"
        assert column.nullable or not optional, f"{table}.{name}: the field may be None, the column is NOT NULL"
        if column.nullable and not optional:  # an older row's NULL reads back as the field's default
            assert not info.is_required(), f"{table}.{name}: a NULL in the column would not read back"


NEVER_STORED_VALUES = {
    ("refreshes", "status"): {"awaiting_review"},  # what a refresh returns while its changes wait for a person
}


def _choices(annotation: Any) -> set[str] | None:
    base, _ = _base(annotation)
    if get_origin(base) is Literal:
        return set(get_args(base))
    if isinstance(base, type) and issubclass(base, StrEnum):
        return {v.value for v in base}
    return None


def _allowed(table: str, column: str) -> set[str] | None:
    checks = FRAMES[table].to_schema().columns[column].checks
    return next((set(c.statistics["allowed_values"]) for c in checks if c.name == "isin"), None)


@pytest.mark.parametrize("table", sorted(_records()))
def test_a_field_s_choices_are_the_values_its_frame_allows(table):
    fields = {**_records()[table].model_fields}
    if table == "operations":  # the operation's kind is stored in column op
        fields["op"] = records.Operation.model_fields["op"]
    for name, info in fields.items():
        choices = _choices(info.annotation)
        if choices is None or name not in DDL[table]:
            continue
        expected = choices - NEVER_STORED_VALUES.get((table, name), set())
        assert _allowed(table, name) == expected, f"{table}.{name}: the record allows {sorted(choices)}"


# --- sample records: every field set, or only what is required ---------------------------------------------------
WHEN = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
VALID: dict[tuple[str, str], Any] = {  # values the frames' checks ask for (the generic ones would not pass)
    ("Problem", "answer_source"): "reference",
    ("RefreshInput", "answer_source"): "reference",
    ("Reward", "reward_source"): "judge",
    ("RefreshDecision", "refresh_date"): "2026-01-02",
    ("RefreshDecision", "status"): "not_promoted",
    ("LessonChange", "change_id"): "c1",
    ("ReviewDecision", "change_id"): "c2",
    ("LLMCall", "stage"): "stage-1",  # written under the stage it is stored with
}
VALID_BARE: dict[tuple[str, str], Any] = {  # the same, for a record with only its required fields
    ("Reward", "error"): "not graded",  # a sample without a reward says why
    ("RefreshGateRow", "verdict"): "fail",  # the overall row (tag None): its CI low is not above the threshold
}


def _value(owner: str, name: str, annotation: Any, default: Any) -> Any:
    """A value of ``annotation`` that differs from ``default`` (so a field the store drops is noticed)."""
    base, _ = _base(annotation)
    origin = get_origin(base)
    if origin is Literal:
        return next(v for v in reversed(get_args(base)) if v != default)
    if origin is list:
        item = get_args(base)[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            return [_sample(item)]
        return [_value(owner, f"{name}-{i}", item, None) for i in range(2)]
    if origin is typing.Union:  # list[float | None]: a value of the first type
        return _value(owner, name, get_args(base)[0], default)
    if isinstance(base, type) and issubclass(base, StrEnum):
        return next(v for v in reversed(list(base)) if v != default)
    if isinstance(base, type) and issubclass(base, BaseModel):
        return _sample(base)
    if base is bool:
        return not default if isinstance(default, bool) else True
    return {str: f"{name}-1", int: 2, float: 0.25, datetime: WHEN}[base]


def _sample(model: type[BaseModel], *, bare: bool = False) -> Any:
    values = {}
    for name, info in model.model_fields.items():
        key = (model.__name__, name)
        if bare and key in VALID_BARE:
            values[name] = VALID_BARE[key]
        elif bare and not info.is_required():
            continue
        elif bare and _base(info.annotation)[1]:
            values[name] = None
        elif key in VALID:
            values[name] = VALID[key]
        elif key[1] == "shown" or (info.annotation is dict or get_origin(info.annotation) is dict):
            continue
        else:
            values[name] = _value(model.__name__, name, info.annotation, info.get_default(call_default_factory=True))
    return model(**values)


def _variants(table: str) -> Iterator[tuple[str, Any]]:
    model = _records()[table]
    yield "every field", _sample(model)
    yield "required fields", _sample(model, bare=True)


@pytest.mark.parametrize("table", sorted(STAGE_RECORDS))
def test_the_mappers_write_exactly_the_table_s_columns(table):
    for variant, record in _variants(table):
        written = set(store_module._ROWS[table]([record])[0]) | set(STAGE_KEY)
        assert written == set(DDL[table]), f"{table} ({variant}): the mapper writes {sorted(written ^ set(DDL[table]))}"


@pytest.mark.parametrize("table", sorted(STAGE_RECORDS))
def test_a_stage_record_comes_back_equal(tmp_path, table):
    with Store(tmp_path / "contract.duckdb") as store:
        for step, (variant, record) in enumerate(_variants(table)):
            store.write_stage("run-1", step, "stage-1", {table: [record]})
            assert store.records(table, "run-1", step, "stage-1") == [record], f"{table} ({variant})"


def test_a_library_version_comes_back_equal(tmp_path):
    """(``created_at`` aside: an ``ExperienceLibrary`` stamps its version when it is saved.)"""
    with Store(tmp_path / "contract.duckdb") as store:
        for v in (_sample(records.LibraryVersion), records.LibraryVersion(version=0, step=0, next_id=0)):
            store.save_library("run-1", ExperienceLibrary.from_version(v))
            back = store.load_library("run-1", v.version).to_version()
            assert back.model_dump(exclude={"created_at"}) == v.model_dump(exclude={"created_at"})
