"""New problems for the refresh: arrival by file time or table timestamp, cutoffs, consumed problems, caps,
and errors that name the file, table, row and field."""

import os
from datetime import datetime, timedelta, timezone

import duckdb
import pytest

from clgrpo.inputs.dataset import DatasetError
from clgrpo.refresh.sources import SourceError, problem_key, read_arrivals, select_new
from clgrpo.testing.scripted_llm import make_problems, write_jsonl
from domains import get_domain
from schemas.refresh_config import RefreshConfig, RefreshSource

T0 = datetime(2026, 11, 20, 1, 0, tzinfo=timezone.utc)
MATH = get_domain("math")


def _touch(path, moment: datetime) -> None:
    os.utime(path, (moment.timestamp(), moment.timestamp()))


def test_directory_files_arrive_at_their_mtime_and_later_files_wait(tmp_path):
    problems = make_problems(n_per_family=2, seed=1)  # 8
    early = write_jsonl(problems[:5], tmp_path / "in" / "a.jsonl")
    late = write_jsonl(problems[5:], tmp_path / "in" / "b.jsonl")
    _touch(early, T0)
    _touch(late, T0 + timedelta(days=1))
    source = RefreshSource(path=str(tmp_path / "in"))

    arrivals = read_arrivals(source, MATH, T0 + timedelta(hours=1), tmp_path / "scratch")
    assert [a.problem.problem_id for a in arrivals] == [p["id"] for p in problems[:5]]
    assert {a.arrived_at for a in arrivals} == {T0}

    everything = read_arrivals(source, MATH, T0 + timedelta(days=2), tmp_path / "scratch")
    assert len(everything) == 8
    taken = {problem_key(p["problem"]) for p in problems[:5]}
    selection = select_new(everything, taken, name="nightly")
    assert (selection.n_arrived, selection.n_taken_before, selection.n_deferred) == (8, 5, 0)
    new = selection.inputs
    assert [i.problem_id for i in new] == [p["id"] for p in problems[5:]]
    assert [i.position for i in new] == [0, 1, 2] and all(i.name == "nightly" for i in new)


def test_a_source_path_may_name_one_file(tmp_path):
    problems = make_problems(n_per_family=1, seed=2)
    single = write_jsonl(problems, tmp_path / "prod2.jsonl")
    _touch(single, T0)
    write_jsonl(make_problems(n_per_family=1, seed=3), tmp_path / "other.jsonl")  # beside it: not read
    arrivals = read_arrivals(RefreshSource(path=str(single)), MATH, T0 + timedelta(hours=1), tmp_path / "scratch")
    assert [a.problem.problem_id for a in arrivals] == [p["id"] for p in problems]


def test_selection_is_oldest_first_capped_deduplicated_and_renames_clashing_ids(tmp_path):
    a = write_jsonl(
        [
            {"id": "1", "problem": "What is 2 + 2?", "answer": "4"},
            {"id": "2", "problem": "What is 3 + 3?", "answer": "6"},
        ],
        tmp_path / "in" / "a.jsonl",
    )
    b = write_jsonl(
        [
            {"id": "1", "problem": "What is 5 + 5?", "answer": "10"},
            {"id": "9", "problem": "what is  2 + 2?", "answer": "4"},
        ],
        tmp_path / "in" / "b.jsonl",
    )
    _touch(a, T0 + timedelta(minutes=5))
    _touch(b, T0)
    arrivals = read_arrivals(RefreshSource(path=str(tmp_path / "in")), MATH, T0 + timedelta(hours=1), tmp_path)
    new = select_new(arrivals, set(), name="n").inputs
    # b.jsonl is older; a's "What is 2 + 2?" repeats b's "what is  2 + 2?"; a's id "1" clashes with b's
    assert [i.problem for i in new] == ["What is 5 + 5?", "what is  2 + 2?", "What is 3 + 3?"]
    assert [i.problem_id for i in new] == ["1", "9", "2"]
    capped = select_new(arrivals, set(), name="n", max_problems=2)
    assert [i.problem_id for i in capped.inputs] == ["1", "9"] and capped.n_deferred == 1
    assert capped.n_taken_before == 1  # the repeated "2 + 2"

    clash = write_jsonl([{"id": "1", "problem": "What is 7 + 7?", "answer": "14"}], tmp_path / "in" / "c.jsonl")
    _touch(clash, T0 + timedelta(minutes=10))
    arrivals = read_arrivals(RefreshSource(path=str(tmp_path / "in")), MATH, T0 + timedelta(hours=1), tmp_path)
    assert [i.problem_id for i in select_new(arrivals, set(), name="n").inputs] == ["1", "9", "2", "c-1"]


def test_duckdb_table_rows_arrive_at_their_timestamp(tmp_path):
    db = tmp_path / "inbox.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE inbox (id VARCHAR, problem VARCHAR, answer VARCHAR, created_at TIMESTAMP)")
        rows = [
            (p["id"], p["problem"], p["answer"], (T0 + timedelta(hours=i)).replace(tzinfo=None))
            for i, p in enumerate(make_problems(n_per_family=1, seed=2))
        ]
        con.executemany("INSERT INTO inbox VALUES (?, ?, ?, ?)", rows[::-1])
    source = RefreshSource(kind="duckdb", path=str(db), table="inbox")
    arrivals = read_arrivals(source, MATH, T0 + timedelta(hours=2, minutes=30), tmp_path / "scratch")
    assert [a.problem.problem_id for a in arrivals] == [r[0] for r in rows[:3]]  # oldest first, naive = UTC
    assert [a.arrived_at for a in arrivals] == [T0 + timedelta(hours=i) for i in range(3)]
    assert all(a.problem.answer for a in arrivals)


def test_source_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(SourceError, match="missing: no such file or directory"):
        read_arrivals(RefreshSource(path=str(tmp_path / "missing")), MATH, T0, tmp_path)
    bad = write_jsonl([{"id": "1", "problem": "What is 1 + 1?", "answer": ""}], tmp_path / "in" / "bad.jsonl")
    _touch(bad, T0)
    with pytest.raises(DatasetError, match=r"bad.jsonl row at line 1 field 'answer': empty"):
        read_arrivals(RefreshSource(path=str(tmp_path / "in")), MATH, T0, tmp_path)

    db = tmp_path / "inbox.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE inbox (id VARCHAR, problem VARCHAR, answer VARCHAR, added VARCHAR)")
        con.execute("INSERT INTO inbox VALUES ('1', 'What is 1 + 1?', '2', 'yesterday')")
    with pytest.raises(SourceError, match="no table or view 'outbox'"):
        read_arrivals(RefreshSource(kind="duckdb", path=str(db), table="outbox"), MATH, T0, tmp_path)
    with pytest.raises(SourceError, match="no timestamp column 'created_at'"):
        read_arrivals(RefreshSource(kind="duckdb", path=str(db), table="inbox"), MATH, T0, tmp_path)
    with pytest.raises(SourceError, match=r"row 0: field 'added' is not a timestamp"):
        read_arrivals(
            RefreshSource(kind="duckdb", path=str(db), table="inbox", timestamp_column="added"), MATH, T0, tmp_path
        )


def test_refresh_config_validation():
    base = {
        "source": {"path": "in"},
        "training": {"policy": {"model": "m"}},
        "evaluation": {"dataset": {"path": "heldout.jsonl"}},
    }
    config = RefreshConfig.model_validate(base)  # the training template needs no dataset of its own
    assert config.training.run_id is None and config.timezone == "UTC"
    with pytest.raises(ValueError, match="not a known IANA zone"):
        RefreshConfig.model_validate({**base, "timezone": "Mars/Olympus"})
    with pytest.raises(ValueError, match="needs `table`"):
        RefreshConfig.model_validate({**base, "source": {"kind": "duckdb", "path": "x.duckdb"}})


def test_a_table_in_the_refresh_database_is_read_through_its_open_store(tmp_path):
    from clgrpo.storage.store import Store

    db = tmp_path / "clgrpo.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE inbox (problem VARCHAR, answer INTEGER, created_at TIMESTAMPTZ)")
        con.execute("INSERT INTO inbox VALUES ('What is 2 + 3?', 5, ?)", [T0])
    source = RefreshSource(kind="duckdb", path=str(db), table="inbox", id_field=None)
    with Store(db) as store:  # holds the file: a second connection is not needed
        (arrival,) = read_arrivals(source, MATH, T0, tmp_path / "scratch", query=store.query)
    assert arrival.problem.answer == "5" and arrival.arrived_at == T0 and arrival.problem.problem_id == "inbox-00000"
