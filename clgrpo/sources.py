"""New problems for the nightly refresh: what arrived up to a cutoff in a directory of dataset files or a
DuckDB table, minus what earlier refreshes already took.

Every file (or the table's rows, exported to one parquet file) goes through the domain's dataset loader, so
new problems are validated exactly like a training set: a bad row stops the refresh with the file, row and
field named. Timestamps without a zone are read as UTC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pandas as pd

from domains.base import Domain
from schemas.config import DatasetConfig, RefreshSource
from schemas.records import Problem, RefreshInput, text_hash

Query = Callable[[str, Sequence[object]], pd.DataFrame]
DATASET_SUFFIXES = {".jsonl", ".json", ".csv", ".parquet"}


class SourceError(ValueError):
    """The refresh source cannot be read (missing directory, table or column)."""


@dataclass(frozen=True)
class Arrival:
    problem: Problem
    arrived_at: datetime


def problem_key(text: str) -> str:
    """Content key of a problem: its text lowercased with whitespace collapsed."""
    return text_hash(" ".join(text.lower().split()))


def _as_utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _dataset(source: RefreshSource, path: Path) -> DatasetConfig:
    return DatasetConfig(path=str(path), id_field=source.id_field, problem_field=source.problem_field,
                         answer_field=source.answer_field, shuffle=False)


# --- reading ---------------------------------------------------------------------------------------------
def directory_arrivals(source: RefreshSource, domain: Domain, cutoff: datetime) -> list[Arrival]:
    """Problems of the dataset files in ``source.path`` modified up to ``cutoff`` (at their file's mtime)."""
    folder = Path(source.path)
    if not folder.is_dir():
        raise SourceError(f"refresh source: {folder} is not a directory")
    arrivals = []
    for path in sorted(p for p in folder.glob(source.pattern) if p.is_file()):
        if path.suffix.lower() not in DATASET_SUFFIXES:
            raise SourceError(f"refresh source: {path} matches {source.pattern!r} but is not a dataset file "
                              f"({', '.join(sorted(DATASET_SUFFIXES))})")
        arrived = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
        if arrived > cutoff:
            continue
        problems, _ = domain.load_dataset(_dataset(source, path))
        arrivals += [Arrival(p, arrived) for p in problems]
    return arrivals


def table_arrivals(source: RefreshSource, domain: Domain, cutoff: datetime, scratch: Path,
                   query: Query | None = None) -> list[Arrival]:
    """Rows of ``source.table`` whose ``timestamp_column`` is at most ``cutoff``. ``query`` runs SQL on the
    source database when the caller already holds it open (the refresh's own DuckDB file)."""
    sql = f"SELECT * FROM {source.table}"
    try:
        if query is not None:
            frame = query(sql, [])
        else:
            with duckdb.connect(source.path, read_only=True) as con:
                frame = con.execute(sql).df()
    except duckdb.CatalogException as exc:
        raise SourceError(f"refresh source {source.path}: no table or view {source.table!r}") from exc
    except duckdb.IOException as exc:
        raise SourceError(f"refresh source {source.path}: cannot open it read-only ({exc})") from exc
    column = source.timestamp_column
    if column not in frame.columns:
        raise SourceError(f"refresh source {source.path} table {source.table!r}: no timestamp column {column!r} "
                          f"(columns: {', '.join(map(str, frame.columns))})")
    stamps = pd.to_datetime(frame[column], utc=True, errors="coerce")
    if stamps.isna().any():
        row = int(stamps.isna().to_numpy().nonzero()[0][0])
        raise SourceError(f"refresh source table {source.table!r} row {row}: field {column!r} is not a timestamp "
                          f"({frame[column].iloc[row]!r})")
    frame = frame.assign(**{column: stamps})
    frame = frame[frame[column] <= pd.Timestamp(cutoff)].sort_values(column, kind="stable").reset_index(drop=True)
    if frame.empty:
        return []
    scratch.mkdir(parents=True, exist_ok=True)
    exported = scratch / f"{source.table}.parquet"  # rows in arrival order: "row at index N" in errors
    frame.to_parquet(exported, index=False)
    problems, _ = domain.load_dataset(_dataset(source, exported))
    arrived: dict[str, pd.Timestamp] = {}
    for text, stamp in zip(frame[source.problem_field], frame[column]):
        arrived.setdefault(str(text).strip(), stamp)  # a repeated text arrived with its first row
    return [Arrival(p, arrived[p.problem].to_pydatetime()) for p in problems]


def read_arrivals(source: RefreshSource, domain: Domain, cutoff: datetime, scratch: Path,
                  query: Query | None = None) -> list[Arrival]:
    cutoff = _as_utc(cutoff)
    if source.kind == "directory":
        return directory_arrivals(source, domain, cutoff)
    return table_arrivals(source, domain, cutoff, scratch, query)


# --- selection -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    inputs: list[RefreshInput]
    n_arrived: int
    n_taken_before: int  # taken by an earlier refresh, or the same text as an earlier arrival
    n_deferred: int  # over max_problems: left for the next refresh

    def message(self, cutoff: datetime) -> str:
        return (f"{self.n_arrived} problem(s) arrived up to {cutoff.isoformat()}: {len(self.inputs)} taken, "
                f"{self.n_taken_before} taken before (or repeated), {self.n_deferred} left for the next refresh "
                "(max_problems)")


def select_new(arrivals: list[Arrival], consumed: set[str], *, name: str,
               max_problems: int | None = None) -> Selection:
    """The arrivals not taken before, oldest first, one per content key, capped at ``max_problems``.
    Ids stay as in the source; an id already used by another file or row gets the source's name in front."""
    selected: list[RefreshInput] = []
    keys, ids = set(consumed), set()
    repeated = deferred = 0
    for arrival in sorted(arrivals, key=lambda a: a.arrived_at):
        p = arrival.problem
        key = problem_key(p.problem)
        if key in keys:
            repeated += 1
            continue
        if max_problems is not None and len(selected) >= max_problems:
            deferred += 1
            continue
        problem_id = p.problem_id
        while problem_id in ids:
            problem_id = f"{Path(p.source).stem}-{problem_id}"
        keys.add(key)
        ids.add(problem_id)
        selected.append(RefreshInput(name=name, position=len(selected), problem_id=problem_id, problem=p.problem,
                                     answer=p.answer, source=p.source, arrived_at=_as_utc(arrival.arrived_at),
                                     problem_key=key))
    return Selection(selected, len(arrivals), repeated, deferred)
