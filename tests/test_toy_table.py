"""A table added from outside the package is its record and one declaration (``schemas.tables.Table``), nothing
else: a store opened after it creates the table, writes a stage's records to it (checked by the frame derived from
the record, with a check declared beside a field), reads them back equal, removes them with the run; and a column
added later is a migration that an older file gets when it is opened, its older rows reading the field's
default."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import Field

from clgrpo.storage.store import FrameValidationError, Store
from schemas.columns import Check
from schemas.records import Record
from schemas.tables import TABLES, Table, added, declare


class Verdict(Record):
    """The toy stage's record: its opinion of one problem's attempts."""

    problem_id: str
    verdict: Literal["good", "bad"]
    confidence: Annotated[float, Check(ge=0.0, le=1.0)] = 0.5


class LaterVerdict(Verdict):
    """The same record once it gained a field: the attempts it read."""

    sample_ids: list[int] = Field(default_factory=list)


@pytest.fixture
def toy_table():
    """The toy table, declared for one test (what the toy stage's module does when imported)."""
    yield declare(Table("toy_verdicts", Verdict, order="problem_id"))
    TABLES.pop("toy_verdicts")


def test_a_table_declared_outside_is_created_written_read_and_deleted(tmp_path, toy_table):
    verdicts = [Verdict(problem_id="p2", verdict="bad"), Verdict(problem_id="p1", verdict="good", confidence=0.9)]
    with Store(tmp_path / "toy.duckdb") as store:
        assert store.write_stage("run-1", 1, "toy", {"toy_verdicts": verdicts}) == 2
        assert store.records("toy_verdicts", "run-1", 1, "toy") == sorted(verdicts, key=lambda v: v.problem_id)
        columns = store.query("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'toy_verdicts'")
        assert columns.values.tolist() == [
            ["run_id", "VARCHAR"],
            ["step", "INTEGER"],
            ["stage", "VARCHAR"],
            ["problem_id", "VARCHAR"],
            ["verdict", "VARCHAR"],
            ["confidence", "DOUBLE"],
        ]
        sure = Verdict.model_construct(problem_id="p3", verdict="good", confidence=1.5)  # past the declared check
        with pytest.raises(FrameValidationError, match="table toy_verdicts: column 'confidence' row 0"):
            store.write_stage("run-1", 2, "toy", {"toy_verdicts": [sure]})
        assert store.delete_run("run-1") == {"stage_runs": 1, "toy_verdicts": 2}


def test_a_column_added_later_is_a_migration_an_older_file_gets(tmp_path, toy_table):
    path = tmp_path / "toy.duckdb"
    with Store(path) as store:
        store.write_stage("run-1", 1, "toy", {"toy_verdicts": [Verdict(problem_id="p1", verdict="good")]})
    declare(Table("toy_verdicts", LaterVerdict, order="problem_id", migrations=(added("sample_ids_json"),)))
    later = LaterVerdict(problem_id="p2", verdict="bad", sample_ids=[0, 3])
    with Store(path) as store:
        store.write_stage("run-1", 2, "toy", {"toy_verdicts": [later]})
        assert store.records("toy_verdicts", "run-1") == [LaterVerdict(problem_id="p1", verdict="good"), later]
        stored = store.con.execute("SELECT sample_ids_json FROM toy_verdicts ORDER BY step").fetchall()
        assert stored == [(None,), ("[0, 3]",)]  # the row written before the column: NULL, read as the default
