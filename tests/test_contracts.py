"""The data contract: each table is declared once (``schemas/catalog.py``, from its record in
``schemas/records.py``), and the store's DDL, frames and mappers are derived from the declaration
(``schemas/tables.py``). This test fails where the derivation would lose something, for every table:

- the DDL as a new file gets it and as an old file gets it after its migrations (columns added, NOT NULLs lifted)
  end up the same;
- the pandera frame has the table's columns in the same order, the pandas dtype that each DuckDB type takes, and
  the same nullability;
- every field of the record is stored (under its name, as ``NAME_json``, renamed, or flattened), every column
  comes from a field or is one the store adds (the key, a computed column); a field and its same-named column
  agree on type and on NULL; the mappers write exactly the table's columns; and a record with every field set (and
  one with only what is required) comes back from DuckDB equal to itself.

``tests/test_schema.py`` holds the schema itself (what the hand-written DDL and frames were).
"""

from __future__ import annotations

import ast
import re
import types
import typing
from collections.abc import Iterator
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import duckdb
import pytest
from pydantic import BaseModel

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.store import Store
from schemas import records
from schemas.catalog import RUN_TABLES, STAGE_TABLES, TABLES
from schemas.tables import STAGE_KEY, AddColumns, DropNotNull, Table, create_statements, declare, table_of

ROOT = Path(__file__).resolve().parents[1]

STAGE_RECORDS: dict[str, type[BaseModel]] = {name: TABLES[name].record for name in STAGE_TABLES}
LIBRARY_RECORDS: dict[str, type[BaseModel]] = {  # Store.save_library / load_library: a version and its lessons
    "library_versions": records.LibraryHead,
    "library_experiences": records.Experience,
}
STORE_RECORDS = {  # tables the store fills itself
    "db_meta": records.DbMeta,
    "runs": records.RunRow,
    "stage_runs": records.StageRun,
    "embeddings": records.Embedding,
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
    """The tables as their first release created them: without the columns added since, NOT NULLs not yet
    lifted."""
    statements = []
    for table in TABLES.values():
        added = {c for m in table.migrations if isinstance(m, AddColumns) for c in m.columns}
        lifted = {c for m in table.migrations if isinstance(m, DropNotNull) for c in m.columns}
        lines = [
            f"{c.name} {c.sql}{' NOT NULL' if c.name in lifted or not c.nullable else ''}"
            for c in table.columns
            if c.name not in added
        ]
        statements.append(f"CREATE TABLE {table.name} ({', '.join(lines)})")
    return statements


# --- tables and their declarations -------------------------------------------------------------------------------
def test_every_table_is_declared_with_its_record():
    assert set(DDL) == set(TABLES)
    homes = [set(STAGE_RECORDS), set(LIBRARY_RECORDS), set(STORE_RECORDS)]
    assert set().union(*homes) == set(TABLES), "a table nobody writes"
    assert sum(len(h) for h in homes) == len(TABLES), "a table listed twice"
    for name, record in {**LIBRARY_RECORDS, **STORE_RECORDS}.items():
        assert TABLES[name].record is record, name
    assert RUN_TABLES == ("runs", "stage_runs", *STAGE_TABLES, "library_versions", "library_experiences")


def test_an_old_file_after_its_columns_were_added_has_the_new_file_s_schema():
    migrated = _columns(_first_release_statements() + create_statements())
    for table, columns in DDL.items():
        assert dict(sorted(migrated[table].items())) == dict(sorted(columns.items())), table


@pytest.mark.parametrize("table", sorted(TABLES))
def test_the_frame_has_the_table_s_columns_types_and_nulls(table):
    frame = TABLES[table].frame.to_schema().columns
    assert list(frame) == list(DDL[table]), f"{table}: frame columns differ from the DDL's"
    for name, column in DDL[table].items():
        dtype = FRAME_DTYPES[column.type][column.nullable]
        assert str(frame[name].dtype) == dtype, f"{table}.{name}: {column.type} is validated as {dtype}"
        assert frame[name].nullable == column.nullable, f"{table}.{name}: nullable in one and not the other"


# --- records and the store's mappers -----------------------------------------------------------------------------
def _records() -> dict[str, type[BaseModel]]:
    return {**STAGE_RECORDS, **LIBRARY_RECORDS, **STORE_RECORDS}


def _base(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``None`` (and without what ``Annotated`` declares beside it), and whether None is
    allowed."""
    optional = False
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        annotation = args[0] if len(args) == 1 else typing.Union[tuple(args)]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation, optional


def _stored_under(table: str, name: str) -> tuple[str, ...]:
    """The columns a field is stored in: its own (by name, as JSON, renamed) or its nested record's."""
    declared = TABLES[table]
    if name in declared.key:
        return (name,)
    return tuple(c.name for c in declared.columns if c.parent == name or (c.field == name and c.parent is None))


@pytest.mark.parametrize("table", sorted(_records()))
def test_every_field_is_a_column_and_every_column_a_field(table):
    model, declared = _records()[table], TABLES[table]
    stored = {column: name for name in model.model_fields for column in _stored_under(table, name)}
    unstored = sorted(name for name in model.model_fields if not _stored_under(table, name))
    assert unstored == sorted(declared.skip), f"{table}: fields of {model.__name__} with no column: {unstored}"
    missing = sorted(c for c in stored if c not in DDL[table])
    assert not missing, f"{table}: fields of {model.__name__} with no column: {missing}"
    computed = {c.name for c in declared.computed}
    extra = sorted(set(DDL[table]) - set(stored) - set(declared.key) - computed)
    assert not extra, f"{table}: columns no field of {model.__name__} holds: {extra}"


@pytest.mark.parametrize("table", sorted(_records()))
def test_a_field_and_its_column_agree_on_type_and_null(table):
    model = _records()[table]
    for name, info in model.model_fields.items():
        column = DDL[table].get(name)
        if column is None or _stored_under(table, name) != (name,):
            continue
        base, optional = _base(info.annotation)
        kind = str if get_origin(base) is Literal or (isinstance(base, type) and issubclass(base, StrEnum)) else base
        if get_origin(kind) is list:  # a native DuckDB list (an embedding's vector)
            continue
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
    checks = TABLES[table].frame.to_schema().columns[column].checks
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
        written = set(TABLES[table].rows([record])[0]) | set(STAGE_KEY)
        assert written == set(DDL[table]), f"{table} ({variant}): the mapper writes {sorted(written ^ set(DDL[table]))}"


@pytest.mark.parametrize("table", sorted(STAGE_RECORDS))
def test_a_stage_record_comes_back_equal(tmp_path, table):
    with Store(tmp_path / "contract.duckdb") as store:
        for step, (variant, record) in enumerate(_variants(table)):
            store.write_stage("run-1", step, "stage-1", {table: [record]})
            assert store.records(table, "run-1", step, "stage-1") == [record], f"{table} ({variant})"
            typed = store.records(TABLES[table].record, "run-1", step, "stage-1")  # the record names its table
            assert typed == [record], f"{table} ({variant}) read by its record"


def test_a_library_version_comes_back_equal(tmp_path):
    """(``created_at`` aside: an ``ExperienceLibrary`` stamps its version when it is saved; how examples are shown
    travels with a version but is the config's, not stored.)"""
    unstored = {"created_at", "examples_shown", "examples_as"}
    with Store(tmp_path / "contract.duckdb") as store:
        for v in (_sample(records.LibraryVersion), records.LibraryVersion(version=0, step=0, next_id=0)):
            store.save_library("run-1", ExperienceLibrary.from_version(v))
            back = store.load_library("run-1", v.version).to_version()
            assert back.model_dump(exclude=unstored) == v.model_dump(exclude=unstored)


# --- a table named by its record, not by a string ----------------------------------------------------------------
def test_every_record_names_its_one_table():
    for name, table in TABLES.items():
        assert table_of(table.record) == name


@pytest.fixture
def summaries_twice():
    """A second table whose record is ``Summary`` (a table declared from outside may reuse a record)."""
    yield declare(Table("toy_summaries", records.Summary, order="problem_id"))
    TABLES.pop("toy_summaries")


def test_a_record_of_two_tables_or_of_none_names_no_table(tmp_path, summaries_twice):
    with pytest.raises(TypeError, match=r"Summary is the record of 2 tables \(summaries, toy_summaries\)"):
        table_of(records.Summary)
    with pytest.raises(TypeError, match="LibraryVersion is the record of no table"):
        table_of(records.LibraryVersion)  # a library version is stored as its head and its lessons
    with pytest.raises(TypeError, match="Sample is the record of no table"):
        table_of(records.Sample)  # each sample table's record is a subclass: no table is the base class's
    summary = records.Summary(problem_id="p1", sample_idx=0, text="tried 4")
    with Store(tmp_path / "twice.duckdb") as store:
        with pytest.raises(TypeError, match="Summary is the record of 2 tables"):
            store.write_stage("run-1", 1, "summarize", {records.Summary: [summary]})
        with pytest.raises(TypeError, match="Summary is the record of 2 tables"):
            store.records(records.Summary, "run-1")
        store.write_stage("run-1", 1, "summarize", {"toy_summaries": [summary]})  # the explicit way: its name
        assert store.records("toy_summaries", "run-1") == [summary]
        assert store.records("summaries", "run-1") == []


# the store's methods: a string argument (or a key of a dict argument) of a call to one of them names no table
STORE_METHODS = {name for name in dir(Store) if not name.startswith("_")} | {"execute", "sql"}
SQL_TABLE = re.compile(r"\b(?:FROM|JOIN|INTO|UPDATE|TABLE)\s+(\w+)")  # this code writes SQL in capitals


def tables_named(source: str) -> list[tuple[int, str]]:
    """(line, table) where ``source`` names a table by a string: an argument of a store call (or a key of a dict
    argument), or SQL text that reads or writes a table."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, m) for m in SQL_TABLE.findall(node.value) if m in TABLES]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in STORE_METHODS:
            continue
        arguments = [*node.args, *(k.value for k in node.keywords)]
        arguments += [key for a in arguments if isinstance(a, ast.Dict) for key in a.keys if key is not None]
        found += [
            (a.lineno, a.value)
            for a in arguments
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in TABLES
        ]
    return sorted(set(found))


def test_a_table_named_by_a_string_is_found():
    source = (
        'rows = store.records("summaries", run_id, step)\n'
        'self.store.write_unfinished(run_id, 0, stage, {"llm_calls": calls})\n'
        "frame = store.frame(Summary, run_id)\n"
        'spent = store.query("SELECT sum(cost_usd) FROM llm_calls WHERE run_id = ?", [run_id])\n'
        'key = artifact_key(run_id, "operations")\n'  # not a store call: an artifact's name
    )
    assert tables_named(source) == [(1, "summaries"), (2, "llm_calls"), (4, "llm_calls")]


def test_flows_and_tasks_read_and_write_tables_by_their_records():
    """Outside the store, a table is named by its record (``store.records(Summary, ...)``) or by a stage's output
    type (``Store.read_stage``), and a query over a table is a named store method: flows/ and tasks/ spell no
    table's name in a store call or in SQL."""
    named = [
        f"{path.relative_to(ROOT)}:{line}: {table}"
        for folder in ("flows", "tasks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, table in tables_named(path.read_text())
    ]
    assert named == []
