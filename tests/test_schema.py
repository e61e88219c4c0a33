"""The tables a new database file gets, and the pandera frames the store validates their rows with, are exactly
those recorded in ``tests/data/schema.json`` (written from the hand-written DDL and frames that each table's single
declaration replaced): column names, order, types, NULLs, defaults and keys; each frame's dtypes, NULLs, unique
columns, coercion, checks (with their arguments) and whole-frame checks. A deliberate change of the schema rewrites
the file (``CLGRPO_UPDATE_SCHEMA=1``) in the commit that says so."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from clgrpo.storage.store import Store
from schemas.catalog import TABLES

SNAPSHOT = Path(__file__).resolve().parent / "data" / "schema.json"


def _value(value: Any) -> Any:
    """A check's statistic as JSON (a pattern as its text, a tuple as a list)."""
    if hasattr(value, "pattern"):
        return value.pattern
    if isinstance(value, (list, tuple, set)):
        return [_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    return value


def _check(check: Any) -> list[Any]:
    return [check.name, _value(check.statistics)]


def tables(store: Store) -> dict[str, Any]:
    columns = store.query(
        "SELECT table_name, column_name, data_type, is_nullable, column_default FROM duckdb_columns() "
        "WHERE database_name = current_database() ORDER BY table_name, column_index"
    )
    constraints = store.query(
        "SELECT table_name, constraint_type, constraint_column_names FROM duckdb_constraints() "
        "WHERE database_name = current_database() ORDER BY ALL"
    )
    out: dict[str, Any] = {}
    for row in columns.itertuples(index=False):
        out.setdefault(row.table_name, {"columns": [], "constraints": []})["columns"].append(
            [row.column_name, row.data_type, bool(row.is_nullable), row.column_default]
        )
    for row in constraints.itertuples(index=False):
        out[row.table_name]["constraints"].append([row.constraint_type, list(row.constraint_column_names)])
    return out


def frames(names: list[str]) -> dict[str, Any]:
    out = {}
    for table in names:
        schema = TABLES[table].frame.to_schema()
        out[table] = {
            "strict": schema.strict,
            "coerce": schema.coerce,
            "checks": [_check(c) for c in schema.checks],
            "columns": [
                [
                    name,
                    str(column.dtype),
                    column.nullable,
                    column.unique,
                    column.coerce,
                    [_check(c) for c in column.checks],
                ]
                for name, column in schema.columns.items()
            ],
        }
    return out


def _dump(snapshot: dict[str, dict[str, Any]]) -> str:
    """One line per table and per frame, so that a change shows as the line of its table."""
    parts = []
    for part, items in snapshot.items():
        lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(items.items()))
        parts.append(f"{json.dumps(part)}: {{\n{lines}\n }}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def test_the_schema_is_the_recorded_one(tmp_path):
    with Store(tmp_path / "new.duckdb") as store:
        now = {"tables": tables(store)}
    now["frames"] = frames(sorted(now["tables"]))
    if os.environ.get("CLGRPO_UPDATE_SCHEMA"):
        SNAPSHOT.write_text(_dump(now))
    recorded = json.loads(SNAPSHOT.read_text())
    assert sorted(now["tables"]) == sorted(recorded["tables"])
    for table, expected in recorded["tables"].items():
        assert now["tables"][table] == expected, table
    for table, expected in recorded["frames"].items():
        assert now["frames"][table] == expected, table
