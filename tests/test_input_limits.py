"""Input limits at dataset load: a problem over ``dataset.max_problem_chars`` (or an answer over
``dataset.max_answer_chars``) stops the load with one line naming the file, the row, the field, the size and the
limit (``oversize: error``), or is left out and reported (``oversize: skip``). Every file format and the Hugging
Face path are checked, the check is fast on a 10 MB field, and ``clgrpo train`` ends with one ``error:`` line
(exit 2) before Prefect starts."""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from application.cli import main
from domains.math import DatasetError, load_problems_with_report
from schemas.config import DatasetConfig

BIG = 10 * 1024 * 1024  # the 10 MB problem
FAST_S = 3.0  # loading (and refusing) a file with a 10 MB field: well under this


def rows(big: str, *, answer: str = "3") -> list[dict[str, Any]]:
    return [
        {"id": "p1", "problem": "What is $1+1$?", "answer": "2"},
        {"id": "p2", "problem": big, "answer": answer},
        {"id": "p3", "problem": "Compute $3 \\cdot 4$.", "answer": "12"},
    ]


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(records), encoding="utf-8")
    elif suffix == ".csv":
        with path.open("w", encoding="utf-8", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:
        pd.DataFrame(records).to_parquet(path, index=False)
    return path


def refused(cfg: DatasetConfig) -> str:
    started = time.monotonic()
    with pytest.raises(DatasetError) as info:
        load_problems_with_report(cfg)
    assert time.monotonic() - started < FAST_S
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("big.jsonl", "row at line 2"),
        ("big.csv", "row at line 3"),
        ("big.json", "row at index 1"),
        ("big.parquet", "row at index 1"),
    ],
)
def test_a_10mb_problem_is_refused_in_one_line(tmp_path: Path, name: str, where: str) -> None:
    path = write(tmp_path / name, rows("x" * BIG))
    message = refused(DatasetConfig(path=str(path)))
    assert message == (
        f"{name} {where} field 'problem': {BIG:,} characters, over the limit of 20,000 "
        "(dataset.max_problem_chars); raise dataset.max_problem_chars or set dataset.oversize: "
        "skip to leave such rows out"
    )


def test_csv_rows_are_named_by_their_first_line(tmp_path: Path) -> None:
    records = rows("y" * 50)
    records[0]["problem"] = "What is\n$1+1$?"  # a record spanning two lines: the big one starts at line 4
    path = write(tmp_path / "multi.csv", records)
    message = refused(DatasetConfig(path=str(path), max_problem_chars=40))
    assert message.startswith("multi.csv row at line 4 field 'problem': 50 characters, over the limit of 40 ")


def test_an_answer_over_its_limit(tmp_path: Path) -> None:
    path = write(tmp_path / "answers.jsonl", rows("fine", answer="9" * 1001))
    message = refused(DatasetConfig(path=str(path)))
    assert message.startswith(
        "answers.jsonl row at line 2 field 'answer': 1,001 characters, over the limit of "
        "1,000 (dataset.max_answer_chars); raise dataset.max_answer_chars"
    )
    problems, _ = load_problems_with_report(DatasetConfig(path=str(path), max_answer_chars=1001))
    assert len(problems) == 3


def test_the_first_row_is_named_and_the_others_counted(tmp_path: Path) -> None:
    records = rows("x" * 30) + [{"id": "p4", "problem": "z" * 31, "answer": "1"}]
    path = write(tmp_path / "two.jsonl", records)
    message = refused(DatasetConfig(path=str(path), max_problem_chars=20))
    assert message.startswith("two.jsonl row at line 2 field 'problem': 30 characters")
    assert "(1 more row(s) over the size limits)" in message


def test_exactly_at_the_limit_is_accepted(tmp_path: Path) -> None:
    at_limit = "a" * 20_000
    path = write(tmp_path / "edge.jsonl", rows(at_limit, answer="7" * 1000))
    problems, report = load_problems_with_report(DatasetConfig(path=str(path), shuffle=False))
    assert [p.problem_id for p in problems] == ["p1", "p2", "p3"]
    assert problems[1].problem == at_limit and report.n_oversize_skipped == 0
    # surrounding whitespace is stripped before use, so it does not count
    path = write(tmp_path / "padded.jsonl", rows(f"  {at_limit}\n "))
    assert len(load_problems_with_report(DatasetConfig(path=str(path)))[0]) == 3


@pytest.mark.parametrize("name", ["skip.jsonl", "skip.csv"])
def test_skip_leaves_the_rows_out_and_reports_them(tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    records = rows("x" * BIG) + [{"id": "p4", "problem": "Find $x$ if $2x = 10$.", "answer": "5" * 2000}]
    path = write(tmp_path / name, records)
    started = time.monotonic()
    problems, report = load_problems_with_report(DatasetConfig(path=str(path), oversize="skip", shuffle=False))
    assert time.monotonic() - started < FAST_S
    assert [p.problem_id for p in problems] == ["p1", "p3"]
    assert (report.n_oversize_skipped, report.oversize_ids) == (2, ("p2", "p4"))
    assert (report.n_rows, report.n_after_limit) == (2, 2)
    assert "skipped 2 row(s) over the size limits" in caplog.text and "p2, p4" in caplog.text


def test_skip_keeps_derived_ids_stable(tmp_path: Path) -> None:
    """Without an id column the ids come from the row position: skipping a row does not renumber the rest."""
    records = [{"problem": r["problem"], "answer": r["answer"]} for r in rows("x" * 100)]
    path = write(tmp_path / "noid.jsonl", records)
    problems, report = load_problems_with_report(
        DatasetConfig(path=str(path), oversize="skip", shuffle=False, max_problem_chars=50)
    )
    assert [p.problem_id for p in problems] == ["noid-00000", "noid-00002"]
    assert report.oversize_ids == ("noid-00001",)


def test_skip_still_validates_the_rest(tmp_path: Path) -> None:
    records = rows("x" * 100) + [{"id": "p4", "problem": "", "answer": "1"}]
    path = write(tmp_path / "bad.jsonl", records)
    with pytest.raises(DatasetError, match="bad.jsonl row at line 4 field 'problem': empty"):
        load_problems_with_report(DatasetConfig(path=str(path), oversize="skip", max_problem_chars=50))


def fake_hub(monkeypatch: pytest.MonkeyPatch, records: list[dict[str, Any]]) -> None:
    class FakeSplit:
        def to_pandas(self) -> pd.DataFrame:
            return pd.DataFrame(records)

    class FakeDatasets:
        @staticmethod
        def load_dataset(name: str, config: str | None, split: str) -> FakeSplit:
            return FakeSplit()

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)


def test_hub_datasets_have_the_same_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub(monkeypatch, rows("x" * 30_000))
    message = refused(DatasetConfig(hf_name="someone/aime"))
    assert message.startswith(
        "someone/aime row at index 1 field 'problem': 30,000 characters, over the limit of "
        "20,000 (dataset.max_problem_chars)"
    )
    problems, report = load_problems_with_report(DatasetConfig(hf_name="someone/aime", oversize="skip"))
    assert sorted(p.problem_id for p in problems) == ["p1", "p3"] and report.oversize_ids == ("p2",)


def test_train_ends_with_one_error_line_naming_file_and_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = write(tmp_path / "huge.jsonl", rows("x" * BIG))
    config = tmp_path / "run.yaml"
    # the model endpoint is unreachable too: the dataset is checked first, so its error is the one reported
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(tmp_path / "r.duckdb"),
                "policy": {"model": "scripted", "base_url": "http://127.0.0.1:9/v1", "api_key_env": None},
            }
        )
    )
    started = time.monotonic()
    code = main(["train", "--config", str(config)])
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith(
        f"error: dataset: huge.jsonl row at line 2 field 'problem': {BIG:,} characters, over the limit of 20,000"
    ), lines[0]
    assert "dataset.oversize: skip" in lines[0]
    assert elapsed < 10.0 and not (tmp_path / "r.duckdb").exists()
