"""Loading the problems of every domain: local .jsonl / .json / .csv / .parquet files or a Hugging Face dataset.

Right after reading, every problem and answer text is measured against ``cfg.max_problem_chars`` /
``cfg.max_answer_chars`` (nothing else touches the text first): with ``oversize: error`` the first row over a
limit stops the load with one line naming the file, the row, the field, the size and the limit; with
``oversize: skip`` such rows are left out and counted in the ``LoadReport``. The remaining rows are validated
with pandera (lazily, so every problem is collected) before any record is built; failures are reported as one
``DatasetError`` naming the file, the row and the field. Valid rows are then de-duplicated by normalized
problem text, shuffled with a seeded RNG and truncated to ``cfg.limit``.
"""

from __future__ import annotations

import csv
import json
import logging
import numbers
import random
import re
import string
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pandera.pandas as pa

from schemas.config import DatasetConfig
from schemas.records import ANSWER_SOURCES, Problem

log = logging.getLogger("domains.math.dataset")  # its name before the move to the core: log lines unchanged

MAX_REPORTED_ISSUES = 20
JSON_ROW_KEYS = ("data", "problems", "rows")  # a .json file may wrap its rows in one of these keys
_STRIP_CHARS = string.whitespace + string.punctuation
_WHITESPACE = re.compile(r"\s+")
# the csv module refuses fields over 131,072 characters by default; while reading, fields may be as long as this
# (their sizes are then checked against dataset.max_problem_chars / max_answer_chars, with row and field named)
CSV_FIELD_LIMIT = 2**31 - 1
_CSV_LIMIT_LOCK = threading.Lock()  # csv.field_size_limit is process-wide: one reader changes it at a time


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


class DatasetError(ValueError):
    """The dataset could not be read or failed validation; the message lists the problems found."""


def normalize_problem_text(text: str) -> str:
    """Comparison key for problem texts: lowercase, whitespace collapsed, surrounding punctuation removed."""
    return _WHITESPACE.sub(" ", text.lower()).strip(_STRIP_CHARS)


def load_problems(cfg: DatasetConfig) -> list[Problem]:
    return load_problems_with_report(cfg)[0]


def load_problems_with_report(cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
    raw = _read(cfg)
    id_col = cfg.id_field if cfg.id_field and cfg.id_field in raw.frame.columns else None
    if len(raw.frame) == 0 and not raw.issues:
        raise DatasetError(f"{raw.source}: contains no rows")
    oversize = _oversize(raw, cfg)  # first: before any other work on a (possibly huge) text
    if oversize and cfg.oversize == "error":
        raise DatasetError(_oversize_message(raw, oversize))
    skipped = [_row_id(raw, id_col, o.pos) for o in oversize]
    if oversize:
        raw = raw.without([o.pos for o in oversize])
        log.warning(
            "%s: skipped %d row(s) over the size limits (dataset.max_problem_chars %d, "
            "dataset.max_answer_chars %d): %s",
            raw.source,
            len(skipped),
            cfg.max_problem_chars,
            cfg.max_answer_chars,
            ", ".join(skipped),
        )
    issues = raw.issues + (_validate(raw, cfg, id_col) if len(raw.frame) else [])
    if issues:
        raise DatasetError(_render(raw.source, issues))
    problems = _build(raw, cfg, id_col)
    kept, dropped = _dedupe(problems)
    if dropped:
        log.warning("%s: dropped %d duplicate problem(s): %s", raw.source, len(dropped), ", ".join(dropped))
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(kept)
    if cfg.limit is not None:
        kept = kept[: cfg.limit]
    report = LoadReport(
        raw.source,
        len(problems),
        len(dropped),
        len(kept),
        tuple(dropped),
        n_oversize_skipped=len(skipped),
        oversize_ids=tuple(skipped),
    )
    return kept, report


# --- reading ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Issue:
    order: int  # sort key: line or index of the row, -1 for file- or column-level issues
    where: str  # "row at line 3", "row at index 2", "at line 7" or ""
    field: str | None
    what: str

    def render(self, source: str) -> str:
        parts = [source, self.where, f"field {self.field!r}" if self.field else ""]
        return " ".join(p for p in parts if p) + f": {self.what}"


@dataclass
class _Raw:
    source: str  # file name or hub name: Problem.source and the prefix of every message
    stem: str  # prefix of derived ids
    # object dtype, one row per readable record; the index is the record's position among the readable records
    # (0, 1, 2, ...; rows skipped for their size leave gaps, so derived ids do not shift)
    frame: pd.DataFrame
    keys: list[int]  # per position: 1-based file line (jsonl, csv) or 0-based index (json, parquet, hub)
    unit: str  # "line" or "index"
    issues: list[_Issue] = field(default_factory=list)  # rows that could not be read at all

    def where(self, pos: int) -> str:
        return f"row at {self.unit} {self.keys[pos]}"

    def without(self, positions: list[int]) -> _Raw:
        return _Raw(self.source, self.stem, self.frame.drop(index=positions), self.keys, self.unit, self.issues)


def _read(cfg: DatasetConfig) -> _Raw:
    if cfg.hf_name is not None:
        return _read_hub(cfg)
    path = Path(cfg.path or "")
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path.name}: unsupported file type {path.suffix!r}; use one of {', '.join(readers)}")
    try:
        return reader(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path.name}: cannot read file: {exc}") from exc


def _records_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, dtype=object) if rows else pd.DataFrame()


def _read_jsonl(path: Path) -> _Raw:
    rows: list[dict[str, Any]] = []
    keys: list[int] = []
    issues: list[_Issue] = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"row at line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                issues.append(_Issue(line_no, where, None, f"invalid JSON: {exc.msg} (column {exc.colno})"))
                continue
            if not isinstance(obj, dict):
                issues.append(_Issue(line_no, where, None, f"expected a JSON object, got {type(obj).__name__}"))
                continue
            rows.append(obj)
            keys.append(line_no)
    return _Raw(path.name, path.stem, _records_frame(rows), keys, "line", issues)


def _read_json(path: Path) -> _Raw:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        issue = _Issue(exc.lineno, f"at line {exc.lineno}", None, f"invalid JSON: {exc.msg} (column {exc.colno})")
        raise DatasetError(_render(path.name, [issue])) from exc
    if isinstance(data, dict):
        data = next((data[k] for k in JSON_ROW_KEYS if isinstance(data.get(k), list)), data)
    if not isinstance(data, list):
        expected = "a list of objects or an object with a list under " + " / ".join(repr(k) for k in JSON_ROW_KEYS)
        raise DatasetError(f"{path.name}: expected {expected}")
    rows: list[dict[str, Any]] = []
    keys: list[int] = []
    issues: list[_Issue] = []
    for index, obj in enumerate(data):
        if isinstance(obj, dict):
            rows.append(obj)
            keys.append(index)
        else:
            what = f"expected a JSON object, got {type(obj).__name__}"
            issues.append(_Issue(index, f"row at index {index}", None, what))
    return _Raw(path.name, path.stem, _records_frame(rows), keys, "index", issues)


@contextmanager
def _long_csv_fields() -> Iterator[None]:
    with _CSV_LIMIT_LOCK:
        previous = csv.field_size_limit(CSV_FIELD_LIMIT)
        try:
            yield
        finally:
            csv.field_size_limit(previous)


def _read_csv(path: Path) -> _Raw:
    rows: list[dict[str, Any]] = []
    keys: list[int] = []
    issues: list[_Issue] = []
    with _long_csv_fields(), path.open(encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise DatasetError(f"{path.name}: empty file (no header row)")
        header = [name.strip() for name in header]
        line_no = reader.line_num  # last line of the record just read; a record may span lines
        for values in reader:
            start, line_no = line_no + 1, reader.line_num
            if not values:
                continue
            if len(values) != len(header):
                what = f"expected {len(header)} fields, got {len(values)}"
                issues.append(_Issue(start, f"row at line {start}", None, what))
                continue
            rows.append(dict(zip(header, values, strict=True)))
            keys.append(start)
    frame = _records_frame(rows) if rows else pd.DataFrame(columns=header, dtype=object)
    return _Raw(path.name, path.stem, frame, keys, "line", issues)


def _read_parquet(path: Path) -> _Raw:
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path.name}: cannot read parquet file: {exc}") from exc
    return _indexed(path.name, path.stem, frame)


def _read_hub(cfg: DatasetConfig) -> _Raw:
    name = cfg.hf_name or ""
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(
            f"loading the Hugging Face dataset {name!r} needs the `datasets` package: pip install clgrpo[datasets]"
        ) from exc
    try:
        frame = datasets.load_dataset(name, cfg.hf_config, split=cfg.hf_split).to_pandas()
    except Exception as exc:  # network, missing split, unknown name, ...
        raise DatasetError(f"cannot load Hugging Face dataset {name!r} (split {cfg.hf_split!r}): {exc}") from exc
    return _indexed(name, name.rstrip("/").rsplit("/", 1)[-1], frame)


def _indexed(source: str, stem: str, frame: pd.DataFrame) -> _Raw:
    frame = frame.reset_index(drop=True).astype(object)
    return _Raw(source, stem, frame, list(range(len(frame))), "index")


# --- size limits -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Oversize:
    pos: int
    field: str
    size: int  # characters, surrounding whitespace not counted (it is stripped before use)
    limit: int
    setting: str  # the config key of the limit


def _oversize(raw: _Raw, cfg: DatasetConfig) -> list[_Oversize]:
    """Rows whose problem or answer text is over its limit (the problem field reported first), in file order.
    Only lengths are read (and the ends of the few texts over a limit), so a 10 MB field costs nothing more."""
    limits = [(cfg.problem_field, cfg.max_problem_chars, "max_problem_chars")]
    if cfg.answer_field is not None:
        limits.append((cfg.answer_field, cfg.max_answer_chars, "max_answer_chars"))
    found: dict[int, _Oversize] = {}
    for column, limit, setting in limits:
        if column not in raw.frame.columns:
            continue  # validation reports the missing column
        values = raw.frame[column]
        lengths = values.map(lambda v: len(v) if isinstance(v, str) else 0)
        for pos in lengths.index[lengths > limit]:
            size = len(values[pos].strip())  # over the limit only by surrounding whitespace: not over it
            if size > limit and pos not in found:
                found[pos] = _Oversize(int(pos), column, size, limit, setting)
    return [found[pos] for pos in sorted(found)]


def _oversize_message(raw: _Raw, oversize: list[_Oversize]) -> str:
    first = oversize[0]
    more = f" ({len(oversize) - 1} more row(s) over the size limits)" if len(oversize) > 1 else ""
    return (
        f"{raw.source} {raw.where(first.pos)} field {first.field!r}: {first.size:,} characters, over the "
        f"limit of {first.limit:,} (dataset.{first.setting}){more}; raise dataset.{first.setting} or set "
        "dataset.oversize: skip to leave such rows out"
    )


def _row_id(raw: _Raw, id_col: str | None, pos: int) -> str:
    """The id the row's problem gets: its id field when that is usable, else the derived id."""
    key = _id_key(raw.frame.at[pos, id_col]) if id_col else None
    return key if key else f"{raw.stem}-{pos:05d}"


# --- validation ------------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value  # NaN is missing


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_text_or_number(value: Any) -> bool:
    return isinstance(value, str) or _is_number(value)


def _not_blank(value: Any) -> bool:
    return not isinstance(value, str) or value.strip() != ""


def _scalar_text(value: Any) -> str:
    """Text of a validated id or answer; integral floats lose their '.0' (204.0 -> '204')."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _cell_checks(type_test: Any) -> list[pa.Check]:
    return [
        pa.Check(type_test, element_wise=True, name="wrong type"),
        pa.Check(_not_blank, element_wise=True, name="empty"),
    ]


def _id_key(value: Any) -> str | None:
    return _scalar_text(value) if _is_text_or_number(value) else None


def _first_occurrences(ids: pd.Series) -> pd.Series:
    """True for rows whose id has not appeared before (ids that are invalid or missing never clash)."""
    keys = ids.map(_id_key)
    return keys.isna() | ~keys.duplicated(keep="first")


def _schema(cfg: DatasetConfig, id_col: str | None, raw_columns: pd.Index) -> pa.DataFrameSchema:
    columns = {cfg.problem_field: pa.Column(None, checks=_cell_checks(_is_text), nullable=False)}
    if cfg.answer_field is not None:
        checks = _cell_checks(_is_text_or_number)
        columns[cfg.answer_field] = pa.Column(None, checks=checks, nullable=cfg.answers_optional)
    if cfg.url_field is not None:  # a missing or blank start page: none
        columns[cfg.url_field] = pa.Column(
            None, checks=[pa.Check(_is_text, element_wise=True, name="wrong type")], nullable=True
        )
    if cfg.domain_field is not None:  # a missing or blank domain: the problem is untagged (sees every lesson)
        columns[cfg.domain_field] = pa.Column(
            None, checks=[pa.Check(_is_text_or_number, element_wise=True, name="wrong type")], nullable=True
        )
    tag_column = _tag_column(cfg, raw_columns)
    if tag_column is not None:  # a blank tag: untagged
        columns[tag_column] = pa.Column(
            None, checks=[pa.Check(_is_text_or_number, element_wise=True, name="wrong type")], nullable=True
        )
    if cfg.answer_source_field is not None:
        columns[cfg.answer_source_field] = pa.Column(None, checks=[pa.Check.isin(ANSWER_SOURCES)], nullable=True)
    if id_col is not None:
        checks = _cell_checks(_is_text_or_number)
        checks.append(pa.Check(_first_occurrences, name="duplicate"))
        columns[id_col] = pa.Column(None, checks=checks, nullable=False)
    return pa.DataFrameSchema(columns, strict=False, coerce=False)


def _validate(raw: _Raw, cfg: DatasetConfig, id_col: str | None) -> list[_Issue]:
    try:
        _schema(cfg, id_col, raw.frame.columns).validate(raw.frame, lazy=True)
    except pa.errors.SchemaErrors as exc:
        return [_translate(raw, cfg, case) for case in exc.failure_cases.to_dict("records")]
    return []


def _translate(raw: _Raw, cfg: DatasetConfig, case: dict[str, Any]) -> _Issue:
    """One pandera failure case as a readable issue."""
    check, column, index = str(case["check"]), case["column"], case["index"]
    if check == "column_in_dataframe":
        found = ", ".join(map(str, raw.frame.columns)) or "none"
        return _Issue(-1, "", str(case["failure_case"]), f"missing column (columns found: {found})")
    if index is None or pd.isna(index):
        return _Issue(-1, "", column, f"failed check {check}")
    pos = int(index)
    value = raw.frame.at[pos, column]
    if check == "not_nullable":
        what = "missing"
    elif check == "empty":
        what = "empty"
    elif check == "wrong type":
        expected = "text" if column == cfg.problem_field else "text or a number"
        if column == cfg.domain_field:
            expected += " (or empty: shared)"
        if column == cfg.tag_field:
            expected += " (or empty: untagged)"
        if column == cfg.url_field:
            expected = "a URL as text (or empty)"
        what = f"wrong type: expected {expected}, got {type(value).__name__}"
    elif check == "duplicate":
        key = _scalar_text(value)
        first = next(p for p in raw.frame.index if p < pos and _id_key(raw.frame.at[p, column]) == key)
        what = f"duplicate id {key!r} (first at {raw.unit} {raw.keys[first]})"
    else:
        what = f"failed check {check}: {value!r}"
    return _Issue(raw.keys[pos], raw.where(pos), column, what)


def _render(source: str, issues: list[_Issue]) -> str:
    ordered = sorted(issues, key=lambda issue: issue.order)
    lines = [f"invalid dataset {source}: {len(ordered)} problem(s)"]
    lines += [f"  - {issue.render(source)}" for issue in ordered[:MAX_REPORTED_ISSUES]]
    if len(ordered) > MAX_REPORTED_ISSUES:
        lines.append(f"  ... and {len(ordered) - MAX_REPORTED_ISSUES} more")
    return "\n".join(lines)


# --- records -------------------------------------------------------------------------------------------


def _build(raw: _Raw, cfg: DatasetConfig, id_col: str | None) -> list[Problem]:
    frame = raw.frame
    tag_col = _tag_column(cfg, frame.columns)
    problems = []
    for pos in frame.index:
        row = frame.loc[pos]
        problem_id = _scalar_text(row[id_col]) if id_col else f"{raw.stem}-{pos:05d}"
        answer = (
            _optional_text(row, cfg.answer_field)
            if cfg.answers_optional
            else (_scalar_text(row[cfg.answer_field]) if cfg.answer_field else None)
        )
        text = row[cfg.problem_field].strip()
        if start := _optional_text(row, cfg.url_field):
            text += f"\n\nStart page: {start}"
        problems.append(
            Problem(
                problem_id=problem_id,
                problem=text,
                answer=answer,
                source=raw.source,
                domain_tag=_domain_tag(row, cfg),
                tag=_optional_text(row, tag_col),
                answer_source=_optional_text(row, cfg.answer_source_field),
            )
        )
    return problems


def _optional_text(row: pd.Series, column: str | None) -> str | None:
    """The cell's text, or None for no column, a missing cell or a blank one."""
    value = row[column] if column and column in row.index else None
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    return _scalar_text(value) or None


def _tag_column(cfg: DatasetConfig, columns: pd.Index) -> str | None:
    """The task-tag column when the dataset has it (a missing column: no tags)."""
    return cfg.tag_field if cfg.tag_field and cfg.tag_field in columns else None


def _domain_tag(row: pd.Series, cfg: DatasetConfig) -> str | None:
    return _optional_text(row, cfg.domain_field)


def _dedupe(problems: list[Problem]) -> tuple[list[Problem], list[str]]:
    """Keep the first problem of each normalized text; return the kept problems and the dropped ids."""
    seen: set[str] = set()
    kept: list[Problem] = []
    dropped: list[str] = []
    for problem in problems:
        key = normalize_problem_text(problem.problem)
        if key in seen:
            dropped.append(problem.problem_id)
        else:
            seen.add(key)
            kept.append(problem)
    return kept, dropped
