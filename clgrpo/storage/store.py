"""The DuckDB store: the only code that touches the database file.

Every frame is validated with its pandera model before insert, a stage's output is written in one transaction
keyed by (run_id, step, stage) (a re-write replaces, never duplicates), and library versions are saved whole.

The file is held only while a method works on it (``clgrpo.storage.connection``: the attachment, the wait
for another process, the schema a new file gets).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol, Self, TypeVar, overload

import duckdb
import numpy as np
import pandas as pd
import pandera.pandas as pa
from pydantic import BaseModel

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.connection import DuckDBFile, StoreError, attached
from schemas.catalog import TABLES
from schemas.config import ModelIdentity, RunConfig
from schemas.config_migrations import as_started, not_fingerprinted, section_type
from schemas.records import (
    LibraryAdoption,
    LibraryHead,
    LibraryVersion,
    OperationResult,
    RefreshDecision,
    RefreshGateRow,
    ReviewRequest,
    Sample,
    utcnow,
)
from schemas.stages import Stage
from schemas.tables import run_tables, stage_tables, table_of


class StageRows(Protocol):
    """A stage's typed output (``tasks.outputs.StageOutput``): its tables by name, written as ``rows()`` and read
    back with ``from_rows``, so no code outside the store names a stage's tables."""

    @classmethod
    def tables(cls) -> tuple[str, ...]: ...

    @classmethod
    def from_rows(cls, rows: Mapping[str, Sequence[Any]]) -> Self: ...

    def rows(self) -> dict[str, list[Any]]: ...


Rows = TypeVar("Rows", bound=StageRows)
R = TypeVar("R")

# A stage's rows to write by table: each table named by its record class (``{Summary: [...]}``) or by its name
# (``StageRows.rows()``, and a table whose record another table holds too).
Outputs = Mapping[Any, Sequence[Any]]


def table_name(table: str | type) -> str:
    """The table a read or write names: a record class's one table (``schemas.tables.table_of``), or the name."""
    return table if isinstance(table, str) else table_of(table)


class FrameValidationError(StoreError, ValueError):
    pass


class ConfigMismatchError(StoreError, ValueError):
    pass


class ModelChangedError(StoreError, ValueError):
    """A run resumed against a policy whose identity changed since it was bound (``Store.bind_identity``)."""


def parse_library_ref(ref: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN:latest`` -> (RUN, None), the latest version; ``RUN:3`` -> (RUN, 3)."""
    run_id, _, version = ref.partition(":")
    if version in ("", "latest"):
        return run_id, None
    if not version.isdigit():
        raise StoreError(f"library reference {ref!r}: the version must be a number or 'latest'")
    return run_id, int(version)


def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, new_rows: pd.DataFrame, conflict: str = "") -> None:
    """Insert a validated frame's rows by column name. DuckDB reads ``new_rows`` by its name (a replacement scan),
    not through a registered view: a view made and dropped inside a transaction keeps the frame alive until the
    transaction ends, and dropping it in a transaction aborted by the insert hid the insert's own error."""
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM new_rows {conflict}")


def _fields(model: type[BaseModel], row: dict) -> dict:
    """The row's values of the model's fields; a NULL in a column added after a row was written (the field
    has a non-None default) takes the default."""
    out = {}
    for name, info in model.model_fields.items():
        if name not in row:
            continue
        if row[name] is None and info.default is not None and not info.is_required():
            continue
        out[name] = row[name]
    return out


# the tables whose rows are measured samples (schemas.records.Sample and a role): what a measurement may reuse
SAMPLE_TABLES = ("eval_results", "trial_samples", "gate_samples")
# when an llm_calls row's request was sent, after waiting for its turn (waited_s; rows stored before it have none)
LLM_CALL_SENT_AT = "started_at + to_seconds(coalesce(waited_s, 0))"


def _by_name(outputs: Outputs) -> dict[str, Sequence[Any]]:
    return {table_name(table): records for table, records in outputs.items()}


def _records(table: str, frame: pd.DataFrame) -> list[Any]:
    rows = ({k: _clean(v) for k, v in row.items()} for row in frame.to_dict(orient="records"))
    return [TABLES[table].record_of(row) for row in rows]


def _clean(value: Any) -> Any:
    """DuckDB/pandas missing values (NaN, NA, NaT) -> None."""
    try:
        return None if pd.isna(value) else value
    except (TypeError, ValueError):
        return value


def _describe_failures(table: str, exc: pa.errors.SchemaErrors, limit: int = 10) -> str:
    cases = exc.failure_cases
    lines = []
    for _, case in cases.head(limit).iterrows():
        column = case.get("column") or "(frame)"
        index = case.get("index")
        row = f"row {int(index)}" if _clean(index) is not None else "all rows"
        lines.append(
            f"table {table}: column {column!r} {row}: {case.get('check')} (value {case.get('failure_case')!r})"
        )
    more = len(cases) - limit
    return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))


def _aggregate(row: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """The one row of an aggregate query (``count(*)``, ``max()``), which DuckDB always returns."""
    assert row is not None, "an aggregate query returns one row"
    return row


class Store(DuckDBFile):
    """The tables of the DuckDB file ``path``: validated writes of a stage's output in one transaction, reads by
    record, the runs and the libraries. The file is attached only while a method works (``DuckDBFile``)."""

    # --- validation and writes ------------------------------------------------------------------------
    @staticmethod
    def validate(table: str, frame: pd.DataFrame) -> pd.DataFrame:
        try:
            return TABLES[table].frame.validate(frame, lazy=True)
        except pa.errors.SchemaErrors as exc:
            raise FrameValidationError(_describe_failures(table, exc)) from exc

    def _insert(self, table: str, frame: pd.DataFrame) -> None:
        if not frame.empty:
            _insert_rows(self.con, table, frame)

    def keyed_frame(self, table: str, records: Sequence[Any], key: Callable[[int], dict[str, Any]]) -> pd.DataFrame:
        """The validated frame of these records' rows, each with its key's columns (``key(position)``)."""
        rows = [{**row, **key(i)} for i, row in enumerate(TABLES[table].rows(records))]
        return self.validate(table, pd.DataFrame(rows, columns=TABLES[table].column_names))

    def stage_frame(self, table: str, run_id: str, step: int, stage: str, records: Sequence[Any]) -> pd.DataFrame:
        return self.keyed_frame(table, records, lambda _: {"run_id": run_id, "step": step, "stage": stage})

    def write_stage(self, run_id: str, step: int, stage: str, outputs: Outputs) -> int:
        """Replace the rows of (run_id, step, stage) in every given table and mark the stage complete,
        atomically. All frames are validated before anything is touched."""
        outputs = _by_name(outputs)
        unknown = set(outputs) - set(stage_tables())
        if unknown:
            raise StoreError(f"not stage tables: {sorted(unknown)}")
        frames = {t: self.stage_frame(t, run_id, step, stage, recs) for t, recs in outputs.items()}
        n_rows = sum(len(f) for f in frames.values())
        marker = self.validate(
            "stage_runs",
            pd.DataFrame(
                [{"run_id": run_id, "step": step, "stage": stage, "n_rows": n_rows, "completed_at": utcnow()}]
            ),
        )
        with self._transaction():
            for table, frame in frames.items():
                self.con.execute(
                    f"DELETE FROM {table} WHERE run_id = ? AND step = ? AND stage = ?", [run_id, step, stage]
                )
                self._insert(table, frame)
            self.con.execute(
                "DELETE FROM stage_runs WHERE run_id = ? AND step = ? AND stage = ?", [run_id, step, stage]
            )
            self._insert("stage_runs", marker)
        return n_rows

    def write_unfinished(self, run_id: str, step: int, stage: str, outputs: Outputs) -> int:
        """Replace the rows of (run_id, step, stage) in the given tables WITHOUT marking the stage complete:
        what a failed or killed stage attempt already paid for (its calls), stored so it is counted; the
        stage's own write later replaces these rows with its complete set."""
        frames = {t: self.stage_frame(t, run_id, step, stage, recs) for t, recs in _by_name(outputs).items()}
        with self._transaction():
            for table, frame in frames.items():
                self.con.execute(
                    f"DELETE FROM {table} WHERE run_id = ? AND step = ? AND stage = ?", [run_id, step, stage]
                )
                self._insert(table, frame)
        return sum(len(f) for f in frames.values())

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction, the file attached for it (the frames are validated before, without the file)."""
        with self.connected() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    # --- reads ----------------------------------------------------------------------------------------
    @attached
    def stage_done(self, run_id: str, step: int, stage: str) -> bool:
        row = self.con.execute(
            "SELECT 1 FROM stage_runs WHERE run_id = ? AND step = ? AND stage = ?", [run_id, step, stage]
        ).fetchone()
        return row is not None

    @attached
    def frame(self, table: str | type, run_id: str, step: int | None = None, stage: str | None = None) -> pd.DataFrame:
        """The rows of a table (a record class names its table) of ``run_id`` (one step, one stage), in order."""
        table = table_name(table)
        where: list[str] = ["run_id = ?"]
        params: list[str | int] = [run_id]
        for column, value in (("step", step), ("stage", stage)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        order = TABLES[table].order
        sql = f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY step, {order}"
        return self.con.execute(sql, params).df()

    @overload
    def records(self, table: type[R], run_id: str, step: int | None = None, stage: str | None = None) -> list[R]: ...

    @overload
    def records(self, table: str, run_id: str, step: int | None = None, stage: str | None = None) -> list[Any]: ...

    def records(self, table: str | type, run_id: str, step: int | None = None, stage: str | None = None) -> list[Any]:
        """The records of a table (``store.records(Summary, run_id, step)``: the table whose record is ``Summary``)
        of ``run_id`` (one step, one stage), in order."""
        return _records(table_name(table), self.frame(table, run_id, step, stage))

    def read_stage(self, kind: type[Rows], run_id: str, step: int | None = None, stage: str | None = None) -> Rows:
        """The typed output ``kind`` of (run_id, step, stage) as stored: each of its tables' rows."""
        return kind.from_rows({table: self.records(table, run_id, step, stage) for table in kind.tables()})

    @attached
    def reusable_samples(self, keys: Sequence[str]) -> dict[str, Sample]:
        """Samples without error stored under these draw keys (``tasks.measure``), by key, from every table that holds
        samples (evaluations, lesson trials, library gates; any run of this file): the latest of each key (a key
        drawn again, ``clgrpo eval --fresh``, is read as drawn last)."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        columns = ", ".join(Sample.model_fields)
        union = " UNION ALL ".join(
            f"SELECT {columns}, created.done_at FROM {table} "
            f"JOIN (SELECT run_id AS r, step AS s, stage AS g, completed_at AS done_at FROM stage_runs) AS created "
            f"ON {table}.run_id = created.r AND {table}.step = created.s AND {table}.stage = created.g "
            "WHERE draw_key IN (SELECT unnest(?)) AND error IS NULL"
            for table in SAMPLE_TABLES
        )
        frame = self.con.execute(
            f"SELECT * FROM ({union}) ORDER BY drawn_at DESC NULLS LAST, done_at DESC", [wanted] * len(SAMPLE_TABLES)
        ).df()
        found: dict[str, Sample] = {}
        for row in frame.drop(columns=["done_at"]).to_dict(orient="records"):
            sample = Sample(**_fields(Sample, {k: _clean(v) for k, v in row.items()}))
            found.setdefault(row["draw_key"], sample)
        return found

    @attached
    def operation_results(self, run_id: str, step: int | None = None) -> list[tuple[int, OperationResult]]:
        """Every applied or rejected operation of a run (or one step), with its step, in order."""
        frame = self.frame("operations", run_id, step)
        rows = ({k: _clean(v) for k, v in row.items()} for row in frame.to_dict(orient="records"))
        return [(int(row["step"]), TABLES["operations"].record_of(row)) for row in rows]

    @attached
    def adapter_before(self, run_id: str, step: int) -> str | None:
        """The folder of the latest adapter a step of ``run_id`` before ``step`` trained (None: none did)."""
        row = self.con.execute(
            "SELECT path FROM adapters WHERE run_id = ? AND step < ? ORDER BY step DESC LIMIT 1", [run_id, step]
        ).fetchone()
        return None if row is None else str(row[0])

    # --- embeddings (shared by all runs of this file) ----------------------------------------------------
    @attached
    def cached_vectors(self, model: str, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """Stored embeddings of ``model`` by text hash (those not stored are absent)."""
        if not hashes:
            return {}
        rows = self.con.execute(
            "SELECT text_hash, vector FROM embeddings WHERE model = ? AND text_hash IN "
            f"({', '.join('?' for _ in hashes)})",
            [model, *hashes],
        ).fetchall()
        return {h: np.asarray(v, dtype=np.float32) for h, v in rows}

    def store_vectors(self, model: str, vectors: dict[str, np.ndarray]) -> None:
        """Keep embeddings of ``model`` by text hash (an existing one is left as it is)."""
        if not vectors:
            return
        frame = self.validate(
            "embeddings",
            pd.DataFrame(
                [
                    {
                        "model": model,
                        "text_hash": h,
                        "dim": len(v),
                        "vector": [float(x) for x in v],
                        "created_at": utcnow(),
                    }
                    for h, v in vectors.items()
                ]
            ),
        )
        with self.connected() as con:
            _insert_rows(con, "embeddings", frame, "ON CONFLICT DO NOTHING")

    @attached
    def query(self, sql: str, params: Iterable[Any] = ()) -> pd.DataFrame:
        return self.con.execute(sql, list(params)).df()

    # --- runs -----------------------------------------------------------------------------------------
    @attached
    def as_started(self, cfg: RunConfig) -> tuple[RunConfig, list[str]]:
        """``cfg`` for resuming its run as it started, with a line for each setting
        kept (``schemas.config_migrations.as_started``); a new run (or a stored config this version cannot read)
        as given."""
        row = self.con.execute("SELECT config_json FROM runs WHERE run_id = ?", [cfg.require_run_id()]).fetchone()
        try:
            started = RunConfig.from_stored(row[0]) if row is not None else None
        except ValueError:  # pydantic's ValidationError: register_run says what differs
            started = None
        return as_started(cfg, started) if started is not None else (cfg, [])

    @attached
    def register_run(self, cfg: RunConfig) -> bool:
        """Record a run's config; True if new (or restarted). The same run id with another config is refused
        once the run has completed a step; before that, the run's rows are removed and it starts afresh with
        the new config (fixing a dataset path after a failed first attempt needs no new run id)."""
        run_id = cfg.require_run_id()
        row = self.con.execute("SELECT fingerprint, config_json FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if row is not None and row[0] == cfg.fingerprint():
            return False
        if row is not None and _refingerprint(row[1]) == cfg.fingerprint():
            # stored before the fingerprint left out a setting (e.g. base_url): the same run, keep its new key
            self.con.execute("UPDATE runs SET fingerprint = ? WHERE run_id = ?", [cfg.fingerprint(), run_id])
            return False
        if row is not None:
            if self.steps_done(run_id):
                raise ConfigMismatchError(_mismatch_message(cfg, json.loads(row[1])))
            self.delete_run(run_id)
        now = utcnow()
        frame = self.validate(
            "runs",
            pd.DataFrame(
                [
                    {
                        "run_id": run_id,
                        "fingerprint": cfg.fingerprint(),
                        "config_json": cfg.model_dump_json(exclude=SERVED),  # the run's identity: its own column
                        "created_at": now,
                        "status": "running",
                        "updated_at": now,
                        "error": None,
                        "policy_identity": _identity_json(cfg),
                    }
                ]
            ),
        )
        self._insert("runs", frame)
        return True

    @attached
    def run_identity(self, run_id: str) -> ModelIdentity | None:
        """The policy identity ``run_id`` is bound to (None: none recorded)."""
        try:
            row = self.con.execute("SELECT policy_identity FROM runs WHERE run_id = ?", [run_id]).fetchone()
        except duckdb.BinderException:  # a file of an earlier version opened read-only (not migrated): none
            return None
        return ModelIdentity.from_json(row[0]) if row is not None and row[0] is not None else None

    @attached
    def bind_identity(self, run_id: str, identity: ModelIdentity, *, accept_change: bool = False) -> str | None:
        """A resumed run's policy checked against the identity it is bound to (``identity_change``); a new binding
        (an accepted change, a run stored before identities existed) is stored. The line to say, if any."""
        bound = self.run_identity(run_id)
        line = identity_change(run_id, bound, identity, accept_change=accept_change)
        if line is not None:
            self.con.execute("UPDATE runs SET policy_identity = ? WHERE run_id = ?", [identity.to_json(), run_id])
        return line

    @attached
    def set_run_status(self, run_id: str, status: str, error: str | None = None) -> None:
        """``running``, ``completed`` or ``failed`` (with the error), stamped with the time."""
        self.con.execute(
            "UPDATE runs SET status = ?, error = ?, updated_at = ? WHERE run_id = ?", [status, error, utcnow(), run_id]
        )

    @attached
    def steps_done(self, run_id: str) -> int:
        """Training steps whose checkpoint is stored."""
        row = self.con.execute(
            "SELECT count(*) FROM stage_runs WHERE run_id = ? AND stage = ? AND step > 0", [run_id, Stage.CHECKPOINT]
        ).fetchone()
        return int(_aggregate(row)[0])

    @attached
    def spent(self, run_id: str) -> tuple[int, float]:
        """The tokens (in and out) and the cost in USD of every recorded model call of ``run_id``."""
        row = self.con.execute(
            "SELECT coalesce(sum(tokens_in + tokens_out), 0), coalesce(sum(cost_usd), 0) FROM llm_calls "
            "WHERE run_id = ?",
            [run_id],
        ).fetchone()
        tokens, usd = _aggregate(row)
        return int(tokens), float(usd)

    def delete_run(self, run_id: str) -> dict[str, int]:
        """Remove every row of ``run_id`` from every table, in one transaction: rows removed per table."""
        removed: dict[str, int] = {}
        with self._transaction():
            for table in run_tables():
                count = _aggregate(
                    self.con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [run_id]).fetchone()
                )[0]
                if count:
                    self.con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
                    removed[table] = int(count)
        return removed

    @attached
    def run_config(self, run_id: str) -> RunConfig:
        row = self.con.execute("SELECT config_json FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if row is None:
            raise StoreError(f"{self.path}: no run {run_id!r}")
        return RunConfig.from_stored(row[0])

    @attached
    def runs(self) -> pd.DataFrame:
        """One row per run: status, training steps done, latest library version and size, last update."""
        return self.con.execute(
            """
            SELECT r.run_id, coalesce(r.status, 'unknown') AS status,
                   (SELECT count(*) FROM stage_runs s
                     WHERE s.run_id = r.run_id AND s.stage = ? AND s.step > 0) AS steps_done,
                   v.version AS library_version, v.n_experiences AS library_size,
                   greatest(r.created_at, r.updated_at,
                            (SELECT max(completed_at) FROM stage_runs s WHERE s.run_id = r.run_id)) AS updated_at,
                   r.created_at, r.error
            FROM runs r
            LEFT JOIN (SELECT run_id, version, n_experiences,
                              row_number() OVER (PARTITION BY run_id ORDER BY version DESC) AS k
                       FROM library_versions) v ON v.run_id = r.run_id AND v.k = 1
            ORDER BY r.created_at""",
            [Stage.CHECKPOINT],
        ).df()

    @attached
    def run_summary(self, run_id: str) -> dict[str, Any] | None:
        """The run's row of ``runs()`` (missing values None) with its last stored stage: ``last_step``,
        ``last_stage``, ``last_completed_at`` (None before any); None when there is no such run."""
        frame = self.runs()
        frame = frame[frame["run_id"] == run_id]
        if frame.empty:
            return None
        row = {k: _clean(v) for k, v in frame.iloc[0].to_dict().items()}
        last = self.con.execute(
            "SELECT step, stage, completed_at FROM stage_runs WHERE run_id = ? "
            "ORDER BY completed_at DESC, step DESC LIMIT 1",
            [run_id],
        ).fetchone()
        return {**row, **dict(zip(("last_step", "last_stage", "last_completed_at"), last or (None, None, None)))}

    @attached
    def evaluations_of(self, run_id: str) -> list[str]:
        """Ids of standalone evaluations that evaluated a library version of ``run_id`` (oldest first)."""
        rows = self.con.execute(
            "SELECT run_id FROM evaluations WHERE stage = ? AND starts_with(library_ref, ?) "
            "GROUP BY run_id ORDER BY min(created_at)",
            [Stage.EVALUATE, f"{run_id}:"],
        ).fetchall()
        return [r[0] for r in rows]

    @attached
    def evaluation_draws(self, eval_id: str) -> list[str]:
        """The stored evaluation ``eval_id`` and those drawn again beside it (``clgrpo eval --fresh``:
        ``eval_id-2``, ``eval_id-3``, ...), in the order they were stored."""
        rows = self.con.execute(
            "SELECT run_id FROM stage_runs WHERE step = 0 AND stage = ? "
            "AND (run_id = ? OR regexp_full_match(run_id, ?)) ORDER BY completed_at",
            [Stage.EVALUATE, eval_id, re.escape(eval_id) + "-[0-9]+"],
        ).fetchall()
        return [r[0] for r in rows]

    @attached
    def system_fingerprints(self, run_id: str) -> list[tuple[str, int, int, int]]:
        """The provider's ``system_fingerprint`` of a run's policy calls, one row per stretch of calls that
        reported the same one, in call order: (fingerprint, first step, last step, calls)."""
        rows = self.con.execute(
            "SELECT system_fingerprint, step FROM llm_calls WHERE run_id = ? AND role = 'policy' "
            "AND system_fingerprint IS NOT NULL ORDER BY started_at",
            [run_id],
        ).fetchall()
        stretches: list[tuple[str, int, int, int]] = []
        for fingerprint, step in rows:
            if stretches and stretches[-1][0] == fingerprint:
                first, _, calls = stretches[-1][1:]
                stretches[-1] = (fingerprint, first, int(step), calls + 1)
            else:
                stretches.append((fingerprint, int(step), int(step), 1))
        return stretches

    @attached
    def has_rows(self, column: str, value: str, tables: Sequence[str]) -> bool:
        """Whether one of ``tables`` (those this file has) holds a row with ``column = value``."""
        present = {
            r[0]
            for r in self.con.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database()"
            ).fetchall()
        }
        return any(
            self.con.execute(f"SELECT 1 FROM {t} WHERE {column} = ? LIMIT 1", [value]).fetchone()
            for t in tables
            if t in present
        )

    @attached
    def is_run(self, run_id: str) -> bool:
        return self.con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone() is not None

    # --- refreshes ------------------------------------------------------------------------------------
    @attached
    def refresh_decisions(self, name: str) -> list[RefreshDecision]:
        """Every decided refresh of ``name``, oldest date first."""
        frame = self.con.execute(
            "SELECT * FROM refreshes WHERE name = ? AND stage = ? ORDER BY refresh_date", [name, Stage.REFRESH_DECIDE]
        ).df()
        return _records("refreshes", frame)

    @attached
    def refresh_gates(self, name: str) -> dict[str, list[RefreshGateRow]]:
        """The promotion-gate rows of every decided refresh of ``name`` by refresh id (overall row first): those
        of the library its decision measured, the reviewed one (``<refresh_id>-served``) when it was measured."""
        frame = self.con.execute(
            "SELECT r.refresh_id AS decided, g.* FROM refresh_gate g JOIN refreshes r ON g.refresh_id = "
            "CASE WHEN r.eval_id = r.refresh_id || '-served' THEN r.eval_id ELSE r.refresh_id END "
            "WHERE r.name = ? AND r.stage = ? AND g.stage = ? ORDER BY g.refresh_id, g.tag NULLS FIRST",
            [name, Stage.REFRESH_DECIDE, Stage.REFRESH_GATE],
        ).df()
        gates: dict[str, list[RefreshGateRow]] = {}
        for row in frame.to_dict(orient="records"):
            decided = row.pop("decided")
            gates.setdefault(decided, []).append(
                TABLES["refresh_gate"].record_of({k: _clean(v) for k, v in row.items()})
            )
        return gates

    @attached
    def consumed_problem_keys(self, name: str) -> set[str]:
        """Content keys of the problems taken by decided refreshes of ``name`` (never taken again), less those of
        refreshes that gave theirs back (a review that timed out)."""
        rows = self.con.execute(
            "SELECT DISTINCT i.problem_key FROM refresh_inputs i JOIN refreshes r ON i.run_id = r.run_id "
            "WHERE r.name = ? AND NOT coalesce(r.released, false)",
            [name],
        ).fetchall()
        return {r[0] for r in rows}

    @attached
    def refresh_watermark(self, name: str) -> datetime | None:
        """The latest watermark of a decided traces refresh of ``name``: the next one reads rows after it."""
        row = self.con.execute(
            "SELECT max(w.watermark) FROM refresh_watermarks w JOIN refreshes r ON w.run_id = r.run_id "
            "WHERE r.name = ? AND r.stage = ?",
            [name, Stage.REFRESH_DECIDE],
        ).fetchone()
        return None if row is None or row[0] is None else row[0]

    @attached
    def reported_rejects(self, name: str) -> set[tuple[str, int, str]]:
        """(file, line, reason) of the source rows decided refreshes of ``name`` skipped (reported once)."""
        rows = self.con.execute(
            "SELECT DISTINCT j.file, j.line, j.reason FROM refresh_rejects j JOIN refreshes r ON j.run_id = r.run_id "
            "WHERE r.name = ? AND r.stage = ?",
            [name, Stage.REFRESH_DECIDE],
        ).fetchall()
        return {(f, int(line), reason) for f, line, reason in rows}

    @attached
    def review_of_flow_run(self, flow_run_id: str) -> str | None:
        """The refresh id of the review that the flow run ``flow_run_id`` requested (None: it requested none)."""
        row = self.con.execute(
            "SELECT run_id FROM review_requests WHERE flow_run_id = ? LIMIT 1", [flow_run_id]
        ).fetchone()
        return None if row is None else str(row[0])

    def review_requests(self, name: str) -> list[ReviewRequest]:
        """Every review requested by refreshes of ``name``, oldest first (answered or not)."""
        frame = self.con.execute("SELECT * FROM review_requests WHERE name = ? ORDER BY created_at", [name]).df()
        return _records("review_requests", frame)

    @attached
    def library_adoptions(self, name: str) -> list[LibraryAdoption]:
        """Promotions and rollbacks of ``name``'s served library, in order."""
        frame = self.con.execute("SELECT * FROM library_adoptions WHERE name = ? ORDER BY seq", [name]).df()
        return _records("library_adoptions", frame)

    # --- library versions -----------------------------------------------------------------------------
    def save_library(self, run_id: str, library: ExperienceLibrary) -> None:
        """Save one version (replacing that version if it was saved before)."""
        v = library.to_version()
        fields = v.model_dump(include=set(LibraryHead.model_fields))
        record = LibraryHead(**fields, n_experiences=len(v.experiences), content_hash=library.content_hash())
        head = self.keyed_frame("library_versions", [record], lambda _: {"run_id": run_id})
        body = self.keyed_frame(
            "library_experiences", v.experiences, lambda i: {"run_id": run_id, "version": v.version, "position": i}
        )
        with self._transaction():
            for table in ("library_versions", "library_experiences"):
                self.con.execute(f"DELETE FROM {table} WHERE run_id = ? AND version = ?", [run_id, v.version])
            self._insert("library_versions", head)
            self._insert("library_experiences", body)

    @attached
    def library_versions(self, run_id: str) -> list[int]:
        rows = self.con.execute(
            "SELECT version FROM library_versions WHERE run_id = ? ORDER BY version", [run_id]
        ).fetchall()
        return [r[0] for r in rows]

    @attached
    def load_library(self, run_id: str, version: int | None = None) -> ExperienceLibrary:
        """Load a version (default: the latest) of a run's library."""
        if version is None:
            versions = self.library_versions(run_id)
            if not versions:
                raise StoreError(f"{self.path}: run {run_id!r} has no saved library")
            version = versions[-1]
        head = self.con.execute(
            "SELECT * FROM library_versions WHERE run_id = ? AND version = ?", [run_id, version]
        ).df()
        if head.empty:
            raise StoreError(f"{self.path}: run {run_id!r} has no library version {version}")
        (h,) = _records("library_versions", head)
        body = self.con.execute(
            "SELECT * FROM library_experiences WHERE run_id = ? AND version = ? ORDER BY position", [run_id, version]
        ).df()
        fields = h.model_dump(include=set(LibraryVersion.model_fields))
        return ExperienceLibrary.from_version(
            LibraryVersion(**fields, experiences=_records("library_experiences", body))
        )


def identity_change(
    run_id: str, bound: ModelIdentity | None, identity: ModelIdentity, *, accept_change: bool = False
) -> str | None:
    """What resuming ``run_id``, bound to ``bound``, with the policy ``identity`` means: None when it is the same
    or nothing is known to compare (not asked at a preflight). Another identity is refused
    (``ModelChangedError``: one line naming both) unless ``accept_change``; then, and for a run stored before
    identities existed, the line saying what the run is bound to from now on."""
    if not identity.checked or (bound is not None and bound.key == identity.key):
        return None
    if bound is None:
        return (
            f"run {run_id!r} was stored before model identities were recorded: it is bound to the policy model "
            f"{identity.label} from now on"
        )
    if not accept_change:
        raise ModelChangedError(
            f"run {run_id!r} was trained with the policy model {bound.label}; its endpoint now serves "
            f"{identity.label}. Resume against the first model, start a new run id, or pass "
            f"--accept-model-change to continue this run with the new one"
        )
    return (
        f"run {run_id!r}: the policy model changed since the run was bound to it ({bound.label}, now "
        f"{identity.label}); continuing with the new one as asked (--accept-model-change)"
    )


# what the endpoints stated at the preflight (``ModelConfig.served``) is no setting of the run: not in its config
SERVED: Any = {"policy": {"served"}, "learner": {"served"}}


def _identity_json(cfg: RunConfig) -> str | None:
    """The policy identity a new run is bound to (None: not asked at a preflight, bound at its first resume)."""
    identity = cfg.policy.identity()
    return identity.to_json() if identity.checked else None


def _refingerprint(config_json: str) -> str | None:
    """The stored config's fingerprint as this version computes it, the settings added since at the value the run
    had (None if it no longer validates)."""
    try:
        return RunConfig.from_stored(config_json).fingerprint()
    except ValueError:
        return None


def _mismatch_message(cfg: RunConfig, stored: dict) -> str:
    new = cfg.model_dump(mode="json")
    changed = sorted(_changed_paths(stored, new))
    return (
        f"run {cfg.run_id!r} already exists with a different config (changed: {', '.join(changed) or 'unknown'}). "
        "Use a new run_id for new settings, or restore the original config to resume."
    )


def _changed_paths(old: Any, new: Any, prefix: str = "", model: type[BaseModel] | None = RunConfig) -> Iterable[str]:
    """The dotted paths of the settings that differ, without those that shape no result (``NotFingerprinted``
    in ``model``, the config section the two are of)."""
    if isinstance(old, dict) and isinstance(new, dict):
        left_out = not_fingerprinted(model) if model is not None else set()
        for key in sorted((set(old) | set(new)) - left_out):
            inner = section_type(model, key) if model is not None else None
            yield from _changed_paths(old.get(key), new.get(key), f"{prefix}{key}.", inner)
    elif old != new:
        yield prefix.rstrip(".")
