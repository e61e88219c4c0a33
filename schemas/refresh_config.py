"""The nightly refresh's config (``clgrpo refresh run --config``): where new problems arrive (``RefreshSource``),
the training template each refresh fills in, the held-out evaluation and promotion gate, and the review of a
candidate (``RefreshConfig``). A config of its own beside the run config (``schemas.config``), whose pieces it
composes; it is not fingerprinted (each refresh's training run is, as any run).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.config import DatasetConfig, EvalConfig, RunConfig, Section


class RefreshSource(Section):
    """Where new problems arrive. ``directory``: dataset files (``pattern``) in ``path``; a file's problems
    arrive at its modification time. ``duckdb``: rows of ``table`` in the DuckDB file ``path``; a row arrives
    at its ``timestamp_column``. Field names are read as in ``DatasetConfig``. ``traces``: production chat
    logs (``clgrpo.refresh.traces``): JSONL files (``pattern``) in ``path``, or ``table`` in the DuckDB file ``path``,
    or the Parquet file ``path``; a row arrives at its ``timestamp_field``, else its file's modification time,
    and each refresh reads only rows after the previous decided refresh's watermark."""

    kind: Literal["directory", "duckdb", "traces"] = "directory"
    path: str
    pattern: str = "*.jsonl"  # directory / traces: which files (glob)
    table: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")  # duckdb / traces: table or view
    timestamp_column: str = Field("created_at", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")  # duckdb
    id_field: str | None = "id"  # None or a missing column: ids are derived per refresh (<file or table>-<row>)
    problem_field: str = "problem"
    answer_field: str | None = "answer"
    # traces: a row's arrival time (ISO 8601 text or epoch seconds; without a zone: UTC); a row without it
    # arrives at its file's modification time
    timestamp_field: str = Field("created_at", min_length=1)
    max_line_bytes: int = Field(1_000_000, ge=1_024)  # traces: a longer JSONL line is skipped with its size
    # traces: earlier turns of a conversation go with its last user message when together at most this long
    context_chars: int = Field(2_000, ge=0)

    @model_validator(mode="after")
    def _table_for_duckdb(self) -> "RefreshSource":
        if self.kind == "duckdb" and not self.table:
            raise ValueError("source: kind 'duckdb' needs `table` (the table or view holding new problems)")
        if self.kind == "traces" and self.table and self.path.lower().endswith(".parquet"):
            raise ValueError(
                f"source: kind 'traces' reads the Parquet file {self.path} whole; leave out `table` "
                "(or point `path` at a DuckDB file)"
            )
        return self

    @property
    def traces_layout(self) -> Literal["jsonl", "duckdb", "parquet"]:
        """How a traces source is stored: JSONL files in a directory, a DuckDB table, or a Parquet file."""
        if self.path.lower().endswith(".parquet"):
            return "parquet"
        return "duckdb" if self.table else "jsonl"


class TrainingTemplate(RunConfig):
    """The training settings of a refresh: a run config whose run id, dataset, initial library and
    ``grpo.max_steps`` each refresh sets (the dataset may be left out)."""

    dataset: DatasetConfig | None = None  # type: ignore[assignment]  # optional here: each refresh sets it


class RefreshConfig(Section):
    """The nightly experience refresh: train on the problems that arrived since the last refresh, starting
    from the latest promoted library, and promote the result only if it beats that library on a held-out set
    (the lower bound of the paired gain's CI above ``margin``) and no task tag of that set regressed (the upper
    bound of the tag's gain's CI below ``-tag_margin``). One refresh per ``name`` and date."""

    name: str = Field("nightly", pattern=r"^[A-Za-z0-9_.-]+$")
    source: RefreshSource
    # the training template: model, learner, GRPO and learning settings and db_path. Each refresh sets run_id,
    # dataset (the new problems), initial_library (the promoted library) and grpo.max_steps (``steps``).
    training: TrainingTemplate
    evaluation: EvalConfig  # the held-out set and sampling of the promotion test
    steps: int = Field(3, ge=1)  # training steps per refresh (fewer when the new problems make fewer)
    max_problems: int | None = Field(None, ge=1)  # oldest first; the rest waits for the next refresh
    metric: Literal["mean_at_k", "pass_at_k"] = "mean_at_k"
    margin: float = Field(0.0, ge=-1.0, lt=1.0)  # promote iff the gain's CI lower bound > margin
    # the per-task no-regression gate (``clgrpo.refresh.promotion``), over the held-out set's task tags
    # (``dataset.tag_field``): a tag fails when the upper bound of its gain's CI is below -tag_margin (by default: when
    # its CI lies wholly below 0), and a candidate with a failing tag is not promoted, whatever its overall gain
    tag_margin: float = Field(0.0, ge=0.0, lt=1.0)
    # tags with fewer held-out problems are reported but not gated: a bootstrap over a handful of problems gives
    # intervals too narrow to trust (one problem: a single point)
    min_tag_problems: int = Field(10, ge=1)
    timezone: str = "UTC"  # the date of a refresh (its idempotency key) is taken in this zone
    initial_library: str | None = None  # the library before the first promotion (a file; None: empty)
    work_dir: str | None = None  # new-problem files and exported libraries; None: <db dir>/refresh/<name>
    # a person reviews each change of a candidate that passed the gate before it is promoted ("required"):
    # a deployment run suspends (answer in the Prefect UI or `clgrpo review`); a terminal run stores the review
    # and returns. No answer within review_timeout_s: nothing is promoted. The library the review leaves (the
    # approved and edited changes) is measured like the candidate was and promoted only if it passes the gate.
    review: Literal["none", "required"] = "none"
    review_timeout_s: int = Field(86400, ge=60)
    # a retried or rerun review whose deadline passed: record the timeout ("decide"), or ask again with a new
    # deadline ("reopen")
    review_after_timeout: Literal["decide", "reopen"] = "decide"
    # a night whose review timed out gives its problems back: the next refresh may take them again
    release_timed_out: bool = True
    # a lesson a reviewer rejected (or one near it) is not proposed again for this many nights (0: forgotten)
    remember_rejected_nights: int = Field(30, ge=0)

    @model_validator(mode="after")
    def _known_timezone(self) -> "RefreshConfig":
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"timezone {self.timezone!r} is not a known IANA zone (e.g. UTC, Europe/Berlin)") from exc
        return self
