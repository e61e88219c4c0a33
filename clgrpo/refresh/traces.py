"""Production traces as refresh problems: OpenAI-style chat logs, one conversation per JSONL line (or per row of
a DuckDB / Parquet table with the same columns), turned into problems with whatever answer their feedback gives.

A row: ``messages`` (a list of ``{role, content}``), the model's ``reply`` (else the last assistant message),
optional ``tool_calls``, ``feedback`` (``thumbs``: +1/-1, up/down or true/false; ``correction``; ``reference``),
``tag``, ``id`` and the arrival time in ``timestamp_field`` (else the file's modification time).

* The problem is the last user message; earlier user and assistant turns (system and tool messages left out)
  go before it as context when together they are at most ``context_chars`` long, else they are dropped.
* The answer, first found: ``feedback.reference``, ``feedback.correction``, the final answer of a thumbs-up
  reply (the domain's ``reply_answer``), else none. A thumbs-down reply's final answer is kept as
  ``rejected_answer`` (a known wrong answer; stored, not used in grading).
* Secrets are redacted (``clgrpo.refresh.redact``) from every text before it is kept.
* A malformed row (not JSON, no user message, a field of the wrong type, a line over ``max_line_bytes``) is
  skipped with ``file:line: reason``; a missing ``feedback`` is fine (feedback is optional).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from numbers import Real
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from clgrpo.refresh.redact import Redactor
from schemas.config import DatasetConfig
from schemas.refresh_config import RefreshSource

Query = Callable[[str, Sequence[object]], pd.DataFrame]
AnswerReader = Callable[[str], "str | None"]
MAX_PROBLEM_CHARS = DatasetConfig.model_fields["max_problem_chars"].default  # what training will accept
MAX_ANSWER_CHARS = DatasetConfig.model_fields["max_answer_chars"].default
THUMBS: dict[object, bool] = {
    1: True,  # also JSON true (True == 1)
    -1: False,
    "+1": True,
    "-1": False,
    "1": True,
    "up": True,
    "down": False,
    False: False,  # JSON false (and, as False == 0, a 0)
    "true": True,
    "false": False,
}


class TraceError(ValueError):
    """One row is malformed: the message is the reason (the caller adds file and line)."""


@dataclass(frozen=True)
class Trace:
    problem: str
    answer: str | None
    answer_source: str  # reference, correction, thumbs_up_reply or none
    rejected_answer: str | None
    tag: str | None
    trace_id: str | None
    arrived_at: datetime
    file: str
    line: int


@dataclass(frozen=True)
class Reject:
    file: str
    line: int
    reason: str
    arrived_at: datetime

    def render(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class TraceRead:
    """What a source held after ``after`` up to the cutoff: usable traces, skipped rows, redactions."""

    traces: list[Trace] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    redactor: Redactor = field(default_factory=Redactor)


# --- one row ---------------------------------------------------------------------------------------------
def _text(value: Any, where: str) -> str:
    """A message content: text, or OpenAI content parts (their text parts joined); None is empty."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return "\n".join(str(p.get("text", "")) for p in value if p.get("type", "text") == "text")
    raise TraceError(f"{where}: wrong type: expected text, got {type(value).__name__}")


def _optional_scalar(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, Real)):
        raise TraceError(f"{where}: wrong type: expected text or a number, got {type(value).__name__}")
    return str(value).strip() or None


JSON_COLUMNS = ("messages", "feedback", "tool_calls")  # a table may hold them as JSON text


def decode_columns(row: dict[str, Any]) -> dict[str, Any]:
    """A table row with its JSON text columns decoded."""
    out = dict(row)
    for column in JSON_COLUMNS:
        if isinstance(out.get(column), str):
            try:
                out[column] = json.loads(out[column])
            except json.JSONDecodeError as exc:
                raise TraceError(f"{column}: not JSON ({exc.msg})") from exc
    return out


def _messages(row: dict[str, Any]) -> list[tuple[str, str]]:
    messages = row.get("messages")
    if messages is None:
        raise TraceError("no messages")
    if not isinstance(messages, list):
        raise TraceError(f"messages: wrong type: expected a list, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TraceError(f"messages[{i}]: expected an object with a text `role`")
        out.append((message["role"], _text(message.get("content"), f"messages[{i}].content")))
    return out


def _thumbs(value: Any) -> bool | None:
    if value is None:
        return None
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    if key not in THUMBS:
        raise TraceError(f"feedback.thumbs: expected +1/-1, up/down or true/false, got {value!r}")
    return THUMBS[key]


def _feedback(row: dict[str, Any]) -> tuple[bool | None, str | None, str | None]:
    """(thumbs, correction, reference); no feedback at all is fine."""
    feedback = row.get("feedback")
    if feedback is None:
        return None, None, None
    if not isinstance(feedback, dict):
        raise TraceError(f"feedback: wrong type: expected an object, got {type(feedback).__name__}")
    return (
        _thumbs(feedback.get("thumbs")),
        _optional_scalar(feedback.get("correction"), "feedback.correction"),
        _optional_scalar(feedback.get("reference"), "feedback.reference"),
    )


def _problem_text(messages: list[tuple[str, str]], context_chars: int) -> str:
    """The last user message, after the earlier user/assistant turns when they are short enough."""
    last = max((i for i, (role, text) in enumerate(messages) if role == "user" and text.strip()), default=None)
    if last is None:
        raise TraceError("no user message")
    earlier = [
        f"{role.capitalize()}: {text.strip()}"
        for role, text in messages[:last]
        if role in ("user", "assistant") and text.strip()
    ]
    context = "\n".join(earlier)
    question = messages[last][1].strip()
    if earlier and len(context) <= context_chars:
        return f"Earlier in the conversation:\n{context}\n\nQuestion:\n{question}"
    return question


def _reply(row: dict[str, Any], messages: list[tuple[str, str]]) -> str | None:
    reply = row.get("reply")
    if reply is not None:
        return _text(reply, "reply")
    if messages and messages[-1][0] == "assistant":
        return messages[-1][1]
    return None


def _answer(
    thumbs: bool | None,
    correction: str | None,
    reference: str | None,
    reply: str | None,
    read_answer: AnswerReader | None,
) -> tuple[str | None, str, str | None]:
    """(answer, answer_source, rejected_answer) in the documented priority."""
    from_reply = read_answer(reply) if reply and read_answer and thumbs is not None else None
    rejected = from_reply if thumbs is False else None
    if reference:
        return reference, "reference", rejected
    if correction:
        return correction, "correction", rejected
    if thumbs and from_reply:
        return from_reply, "thumbs_up_reply", None
    return None, "none", rejected


def _check_size(text: str | None, limit: int, what: str) -> None:
    if text is not None and len(text) > limit:
        raise TraceError(f"{what}: {len(text):,} characters, over the limit of {limit:,}")


def parse_trace(
    row: dict[str, Any],
    *,
    source: RefreshSource,
    arrived_at: datetime,
    file: str,
    line: int,
    redact: Redactor,
    read_answer: AnswerReader | None,
) -> Trace:
    """One row as a trace (texts redacted); ``TraceError`` names what is wrong with it."""
    if row.get("tool_calls") is not None and not isinstance(row["tool_calls"], list):
        raise TraceError("tool_calls: wrong type: expected a list")
    messages = _messages(row)
    thumbs, correction, reference = _feedback(row)
    problem = redact(_problem_text(messages, source.context_chars))
    answer, answer_source, rejected = _answer(thumbs, correction, reference, _reply(row, messages), read_answer)
    answer = redact(answer) if answer else None
    rejected = redact(rejected) if rejected else None
    _check_size(problem, MAX_PROBLEM_CHARS, "problem (the last user message and its context)")
    _check_size(answer, MAX_ANSWER_CHARS, f"answer ({answer_source})")
    return Trace(
        problem=problem,
        answer=answer,
        answer_source=answer_source,
        rejected_answer=rejected,
        tag=_optional_scalar(row.get("tag"), "tag"),
        trace_id=_optional_scalar(row.get("id"), "id"),
        arrived_at=arrived_at,
        file=file,
        line=line,
    )


def arrival_time(row: dict[str, Any], field_name: str, default: datetime) -> datetime:
    """The row's ``field_name`` (ISO 8601 text, epoch seconds or a datetime; no zone: UTC), else ``default``."""
    value = row.get(field_name)
    if value is None:
        return default
    try:
        if isinstance(value, bool):
            raise ValueError
        stamp = pd.Timestamp(value, unit="s", tz="UTC") if isinstance(value, Real) else pd.Timestamp(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TraceError(f"field {field_name!r} is not a timestamp ({str(value)[:40]!r})") from exc
    if pd.isna(stamp):
        raise TraceError(f"field {field_name!r} is not a timestamp ({str(value)[:40]!r})")
    stamp = stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")
    return stamp.to_pydatetime()


def _safe_time(row: dict[str, Any], field_name: str, default: datetime) -> datetime:
    try:
        return arrival_time(row, field_name, default)
    except TraceError:
        return default


# --- reading ---------------------------------------------------------------------------------------------
def _lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, the line) for each line, or (line number, its size) for a line over ``max_bytes``: a long
    line is read in chunks and counted, never held whole."""
    with path.open("rb") as fh:
        number = 0
        while chunk := fh.readline(max_bytes + 1):
            number += 1
            if len(chunk) <= max_bytes or chunk.endswith(b"\n"):  # the whole line (its newline aside)
                yield number, chunk
                continue
            size = len(chunk)
            while not chunk.endswith(b"\n") and (chunk := fh.readline(1 << 20)):
                size += len(chunk)
            yield number, size


def _json_row(raw: bytes) -> dict[str, Any]:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise TraceError(f"not UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        message = exc.msg.removesuffix(" at")  # "Unterminated string starting at" + " at column 5"
        raise TraceError(f"not JSON ({message} at column {exc.colno})") from exc
    if not isinstance(row, dict):
        raise TraceError(f"not a JSON object ({type(row).__name__})")
    return row


class _Reader:
    """Collects the traces and rejects of rows that arrived in (after, cutoff]."""

    def __init__(
        self, source: RefreshSource, after: datetime | None, cutoff: datetime, read_answer: AnswerReader | None
    ) -> None:
        self.source, self.after, self.cutoff, self.read_answer = source, after, cutoff, read_answer
        self.out = TraceRead()

    def in_window(self, moment: datetime) -> bool:
        return moment <= self.cutoff and (self.after is None or moment > self.after)

    def reject(self, file: str, line: int, reason: str, moment: datetime) -> None:
        if self.in_window(moment):
            self.out.rejects.append(Reject(file, line, reason, moment))

    def row(self, row: dict[str, Any], file: str, line: int, default_time: datetime) -> None:
        try:
            moment = arrival_time(row, self.source.timestamp_field, default_time)
        except TraceError as exc:
            return self.reject(file, line, str(exc), default_time)
        if not self.in_window(moment):
            return
        try:
            self.out.traces.append(
                parse_trace(
                    row,
                    source=self.source,
                    arrived_at=moment,
                    file=file,
                    line=line,
                    redact=self.out.redactor,
                    read_answer=self.read_answer,
                )
            )
        except TraceError as exc:
            self.reject(file, line, str(exc), moment)

    def jsonl_file(self, path: Path) -> None:
        mtime = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
        limit = self.source.max_line_bytes
        for number, line in _lines(path, limit):
            if isinstance(line, int):
                self.reject(path.name, number, f"line of {line:,} bytes, over max_line_bytes ({limit:,})", mtime)
            elif line.strip():
                try:
                    row = _json_row(line)
                except TraceError as exc:
                    self.reject(path.name, number, str(exc), mtime)
                else:
                    self.row(row, path.name, number, mtime)

    def table(self, rows: list[dict[str, Any]], label: str, mtime: datetime) -> None:
        for number, row in enumerate(rows, start=1):
            try:
                decoded = decode_columns(row)
            except TraceError as exc:
                self.reject(label, number, str(exc), _safe_time(row, self.source.timestamp_field, mtime))
            else:
                self.row(decoded, label, number, mtime)


def _table_rows(source: RefreshSource, query: Query | None) -> tuple[list[dict[str, Any]], str, datetime]:
    """(rows, their label in messages, the file's mtime) of a traces table or Parquet file."""
    path = Path(source.path)
    if not path.is_file():
        raise FileNotFoundError(f"refresh source: {path} is not a file")
    mtime = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    if source.traces_layout == "parquet":
        with duckdb.connect() as con:
            cursor = con.execute("SELECT * FROM read_parquet(?)", [str(path)])
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, r)) for r in cursor.fetchall()], path.name, mtime
    sql = f"SELECT * FROM {source.table}"
    if query is not None:
        frame = query(sql, [])
        rows = [{k: _native(v) for k, v in r.items()} for r in frame.to_dict(orient="records")]
        return rows, str(source.table), mtime
    with duckdb.connect(str(path), read_only=True) as con:
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, r)) for r in cursor.fetchall()], str(source.table), mtime


def _native(value: Any) -> Any:
    """A pandas cell as a plain Python value (missing -> None, numpy arrays -> lists)."""
    if hasattr(value, "tolist"):
        return _native(value.tolist())
    if isinstance(value, list):
        return [_native(v) for v in value]
    if isinstance(value, dict):
        return {k: _native(v) for k, v in value.items()}
    try:
        return None if pd.isna(value) else value
    except (TypeError, ValueError):
        return value


def source_files(source: RefreshSource) -> list[Path]:
    """The files a folder source reads (``kind: directory``, or traces in JSON lines): ``path`` itself when it
    names a file, else the files in the folder ``path`` that match ``pattern``, in name order."""
    path = Path(source.path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"refresh source: {path}: no such file or directory")
    return sorted(p for p in path.glob(source.pattern) if p.is_file())


def read_traces(
    source: RefreshSource,
    cutoff: datetime,
    after: datetime | None,
    read_answer: AnswerReader | None,
    query: Query | None = None,
) -> TraceRead:
    """The traces of ``source`` that arrived after ``after`` (None: ever) up to ``cutoff``, file by file in
    name order; ``query`` runs SQL on the source database when the caller already holds it open."""
    reader = _Reader(source, after, cutoff, read_answer)
    if source.traces_layout == "jsonl":
        for path in source_files(source):
            reader.jsonl_file(path)
    else:
        reader.table(*_table_rows(source, query))
    return reader.out
