"""Which DuckDB files this user worked with, so commands find a run without ``--db``.

``train``, ``demo``, ``eval`` and ``refresh run`` remember their database (absolute path, most recent first) in
``$CLGRPO_STATE_DIR`` (default ``$XDG_STATE_HOME/clgrpo`` or ``~/.local/state/clgrpo``); so do the train,
evaluate and refresh flows themselves, so a deployment run's database (resolved in the worker's directory) is
found as well, from any directory, when the worker runs as the same user. A command that names a
run looks for it in those databases, newest first; ``runs list`` shows the most recent one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_ENV = "CLGRPO_STATE_DIR"
DEFAULT_DB = "runs/clgrpo.duckdb"
MAX_REMEMBERED = 20


def state_dir() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "clgrpo"


def _state_file() -> Path:
    return state_dir() / "recent_dbs.json"


def remember_db(path: str | os.PathLike[str]) -> None:
    """Put ``path`` first in the list of recent databases (never fails a command)."""
    entry = str(Path(path).expanduser().resolve())
    try:
        recent = [p for p in _read() if p != entry]
        target = _state_file()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps([entry, *recent][:MAX_REMEMBERED], indent=1), encoding="utf-8")
    except OSError:
        pass


def _read() -> list[str]:
    try:
        data = json.loads(_state_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [str(p) for p in data] if isinstance(data, list) else []


def recent_dbs() -> list[Path]:
    """Remembered databases that still exist, most recent first."""
    return [Path(p) for p in _read() if Path(p).is_file()]


def database_holding(run_id: str) -> str | None:
    """The most recent remembered database that holds ``run_id``; None if none does."""
    return next((str(db) for db in recent_dbs() if holds(db, run_id)), None)


REFRESH_TABLES = ("refreshes", "review_requests")  # a decided refresh, or one whose review waits


def resolve_db(explicit: str | None, run_id: str | None = None, *, refresh: str | None = None) -> str:
    """``--db`` when given; else the most recent database holding ``run_id`` (or the refresh named
    ``refresh``); else the most recent database; else ``runs/clgrpo.duckdb``."""
    if explicit:
        return explicit
    recent = recent_dbs()
    holder = None
    if run_id:
        holder = next((db for db in recent if holds(db, run_id)), None)
    elif refresh:
        holder = next((db for db in recent if holds(db, refresh, column="name", tables=REFRESH_TABLES)), None)
    if holder is not None:
        return str(holder)
    if recent:
        return str(recent[0])
    return DEFAULT_DB


def holds(
    db: Path,
    value: str,
    *,
    column: str = "run_id",
    tables: tuple[str, ...] = ("runs", "stage_runs", "library_versions"),
) -> bool:
    """Whether ``db`` has rows with ``column = value`` in one of ``tables`` (by default: of the run, evaluation
    or refresh ``value``); False when it cannot be opened (it waits a little while a run writes it)."""
    import duckdb

    from clgrpo.storage.connection import StoreError
    from clgrpo.storage.store import Store

    try:
        with Store(db, read_only=True) as store:
            return store.has_rows(column, value, tables)
    except (StoreError, duckdb.Error):
        return False
