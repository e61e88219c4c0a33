"""New problems for the nightly refresh: what arrived up to a cutoff in a directory of dataset files or a
DuckDB table, minus what earlier refreshes already took; or the production traces (``clgrpo.refresh.traces``) that
arrived after the previous refresh's watermark.

Every dataset file (or the table's rows, exported to one parquet file) goes through the domain's dataset loader,
so new problems are validated exactly like a training set: a bad row stops the refresh with the file, row and
field named. Traces are production data: a bad row is skipped and reported (``file:line: reason``) instead.
Timestamps without a zone are read as UTC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Protocol

import duckdb
import pandas as pd

from clgrpo.inputs.dataset import LoadReport
from clgrpo.refresh.traces import Reject, TraceRead, read_traces, source_files
from schemas.config import DatasetConfig
from schemas.records import Problem, RefreshInput, RefreshReject, RefreshWatermark, text_hash
from schemas.refresh_config import RefreshSource

Query = Callable[[str, Sequence[object]], pd.DataFrame]
DATASET_SUFFIXES = {".jsonl", ".json", ".csv", ".parquet"}


class DatasetLoader(Protocol):
    """What reading a source needs of the run's domain plug-in (``domains.Domain`` has it): its dataset loader.
    A domain may also read a production reply's final answer (``reply_answer(output)``, looked up by name)."""

    def load_dataset(self, cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]: ...


class SourceError(ValueError):
    """The refresh source cannot be read (missing directory, table or column)."""


@dataclass(frozen=True)
class Arrival:
    problem: Problem
    arrived_at: datetime
    rejected_answer: str | None = None  # a trace's thumbs-down answer


def problem_key(text: str) -> str:
    """Content key of a problem: its text lowercased with whitespace collapsed."""
    return text_hash(" ".join(text.lower().split()))


def _as_utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _dataset(source: RefreshSource, path: Path) -> DatasetConfig:
    return DatasetConfig(
        path=str(path),
        id_field=source.id_field,
        problem_field=source.problem_field,
        answer_field=source.answer_field,
        shuffle=False,
    )


# --- reading ---------------------------------------------------------------------------------------------
def directory_arrivals(source: RefreshSource, domain: DatasetLoader, cutoff: datetime) -> list[Arrival]:
    """Problems of the dataset files of ``source`` (``source_files``: one file, or a folder's) modified up to
    ``cutoff`` (at their file's mtime)."""
    try:
        files = source_files(source)
    except FileNotFoundError as exc:
        raise SourceError(str(exc)) from exc
    arrivals = []
    for path in files:
        if path.suffix.lower() not in DATASET_SUFFIXES:
            raise SourceError(
                f"refresh source: {path} matches {source.pattern!r} but is not a dataset file "
                f"({', '.join(sorted(DATASET_SUFFIXES))})"
            )
        arrived = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
        if arrived > cutoff:
            continue
        problems, _ = domain.load_dataset(_dataset(source, path))
        arrivals += [Arrival(p, arrived) for p in problems]
    return arrivals


def table_arrivals(
    source: RefreshSource, domain: DatasetLoader, cutoff: datetime, scratch: Path, query: Query | None = None
) -> list[Arrival]:
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
        raise SourceError(
            f"refresh source {source.path} table {source.table!r}: no timestamp column {column!r} "
            f"(columns: {', '.join(map(str, frame.columns))})"
        )
    stamps = pd.to_datetime(frame[column], utc=True, errors="coerce")
    if stamps.isna().any():
        row = int(stamps.isna().to_numpy().nonzero()[0][0])
        raise SourceError(
            f"refresh source table {source.table!r} row {row}: field {column!r} is not a timestamp "
            f"({frame[column].iloc[row]!r})"
        )
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


def read_arrivals(
    source: RefreshSource, domain: DatasetLoader, cutoff: datetime, scratch: Path, query: Query | None = None
) -> list[Arrival]:
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
    first_deferred: datetime | None = None  # the arrival time of the oldest problem left for the next refresh

    def message(self, cutoff: datetime) -> str:
        return (
            f"{self.n_arrived} problem(s) arrived up to {cutoff.isoformat()}: {len(self.inputs)} taken, "
            f"{self.n_taken_before} taken before (or repeated), {self.n_deferred} left for the next refresh "
            "(max_problems)"
        )


def select_new(arrivals: list[Arrival], consumed: set[str], *, name: str, max_problems: int | None = None) -> Selection:
    """The arrivals not taken before, oldest first, one per content key, capped at ``max_problems``.
    Ids stay as in the source; an id already used by another file or row gets the source's name in front."""
    selected: list[RefreshInput] = []
    keys, ids = set(consumed), set()
    repeated = deferred = 0
    first_deferred: datetime | None = None
    for arrival in sorted(arrivals, key=lambda a: a.arrived_at):
        p = arrival.problem
        key = problem_key(p.problem)
        if key in keys:
            repeated += 1
            continue
        if max_problems is not None and len(selected) >= max_problems:
            deferred += 1
            first_deferred = first_deferred or _as_utc(arrival.arrived_at)
            continue
        problem_id = p.problem_id
        while problem_id in ids:
            problem_id = f"{Path(p.source).stem}-{problem_id}"
        keys.add(key)
        ids.add(problem_id)
        selected.append(
            RefreshInput(
                name=name,
                position=len(selected),
                problem_id=problem_id,
                problem=p.problem,
                answer=p.answer,
                source=p.source,
                arrived_at=_as_utc(arrival.arrived_at),
                problem_key=key,
                tag=p.tag,
                answer_source=p.answer_source,
                rejected_answer=arrival.rejected_answer,
            )
        )
    return Selection(selected, len(arrivals), repeated, deferred, first_deferred)


# --- traces ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSelection:
    """A traces refresh's input: the problems taken, the rows skipped and the watermark read up to."""

    selection: Selection
    rejects: list[RefreshReject]
    watermark: RefreshWatermark

    def stage_rows(self) -> dict[str, list]:
        return {
            "refresh_inputs": self.selection.inputs,
            "refresh_rejects": self.rejects,
            "refresh_watermarks": [self.watermark],
        }

    def message(self, cutoff: datetime) -> str:
        w = self.watermark
        since = f"after {w.after.isoformat()}" if w.after else "ever"
        return (
            f"traces {since}: {self.selection.message(cutoff)}; "
            f"{'; '.join(trace_notes(self.rejects, w)) or 'no rows skipped, no secrets redacted'}"
        )


def trace_arrivals(read: TraceRead) -> list[Arrival]:
    """The traces as arrivals; a trace without an id gets ``<file stem>-<line>``."""
    return [
        Arrival(
            Problem(
                problem_id=t.trace_id or f"{Path(t.file).stem}-{t.line:05d}",
                problem=t.problem,
                answer=t.answer,
                source=t.file,
                tag=t.tag,
                answer_source=t.answer_source,
            ),
            t.arrived_at,
            t.rejected_answer,
        )
        for t in read.traces
    ]


def _watermark(read: TraceRead, selection: Selection) -> tuple[datetime | None, list[Reject]]:
    """The latest arrival of a usable row this refresh consumed (a skipped row never moves it: a corrupt line
    "arrives" at its file's time, which says nothing of when the rows around it were logged), and the rejects up
    to the cutoff. Problems left for the next refresh (max_problems) are after it."""
    limit = selection.first_deferred - timedelta(microseconds=1) if selection.first_deferred else None
    consumed = [t.arrived_at for t in read.traces if limit is None or t.arrived_at <= limit]
    rejects = [r for r in read.rejects if limit is None or r.arrived_at <= limit]
    return max(consumed, default=None), rejects


def select_traces(
    source: RefreshSource,
    domain: DatasetLoader,
    cutoff: datetime,
    consumed: set[str],
    after: datetime | None,
    *,
    name: str,
    max_problems: int | None = None,
    reported: set[tuple[str, int, str]] | frozenset = frozenset(),
    query: Query | None = None,
) -> TraceSelection:
    """The traces up to ``cutoff`` not taken before (their content key), oldest first, capped at
    ``max_problems``: those after ``after`` (the previous decided refresh's watermark) and also those logged late
    with an earlier time (counted as late, never skipped); the skipped rows (less those ``reported`` by an earlier
    refresh: a row without its own time arrives again when its file grows); the new watermark."""
    try:
        read = read_traces(source, _as_utc(cutoff), None, getattr(domain, "reply_answer", None), query)
    except FileNotFoundError as exc:
        raise SourceError(str(exc)) from exc
    except duckdb.CatalogException as exc:
        raise SourceError(f"refresh source {source.path}: no table or view {source.table!r}") from exc
    except duckdb.Error as exc:
        raise SourceError(f"refresh source {source.path}: cannot read it ({exc})") from exc
    selection = select_new(trace_arrivals(read), consumed, name=name, max_problems=max_problems)
    watermark, rejects = _watermark(read, selection)
    records = [
        RefreshReject(name=name, file=r.file, line=r.line, reason=r.reason)
        for r in rejects
        if (r.file, r.line, r.reason) not in reported
    ]
    since = after and _as_utc(after)
    mark = RefreshWatermark(
        name=name,
        after=after,
        watermark=max(filter(None, (watermark, since)), default=None),
        n_rows=len(read.traces) + len(records),
        n_rejected=len(records),
        n_redacted=read.redactor.total,
        n_late=sum(since is not None and i.arrived_at <= since for i in selection.inputs),
    )
    return TraceSelection(selection, records, mark)


MAX_NOTED_REJECTS = 5


def trace_notes(rejects: list[RefreshReject], watermark: RefreshWatermark | None) -> list[str]:
    """What a traces refresh reports with its decision: the skipped rows (the first few) and the redactions."""
    notes = []
    if rejects:
        shown = "; ".join(r.render() for r in rejects[:MAX_NOTED_REJECTS])
        more = (
            f"; ... and {len(rejects) - MAX_NOTED_REJECTS} more (table refresh_rejects)"
            if len(rejects) > MAX_NOTED_REJECTS
            else ""
        )
        notes.append(f"{len(rejects)} trace row(s) skipped: {shown}{more}")
    if watermark is not None and watermark.n_late:
        notes.append(
            f"{watermark.n_late} trace row(s) arrived late (logged with a time before the previous refresh's "
            "watermark): taken"
        )
    if watermark is not None and watermark.n_redacted:
        notes.append(f"{watermark.n_redacted} secret(s) redacted from the traces")
    return notes
