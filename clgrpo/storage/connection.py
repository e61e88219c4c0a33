"""Holding the DuckDB file only while the store works on it: the attachment, the wait for another process that
holds the file, and the schema a new file gets.

DuckDB lets one process at a time open a file for writing (and then no other process may even read it), so a
``Store`` holds the file only while one of its methods works: each public method attaches the file to the
store's own in-memory DuckDB connection and detaches it when it returns (about 2 ms; nested calls reuse the
attachment, ``connected()`` keeps it for a block). Another process's commands (``clgrpo runs list`` during a run)
and other runs on the same file get their turn between calls: opening retries with backoff while another
process holds the file, up to ``wait_s`` (60 s for writers, 10 s read-only), then ``StoreLockedError`` names
the holder's pid. One live process per run id is ``clgrpo.storage.run_lock``'s job, not DuckDB's.
"""

from __future__ import annotations

import functools
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Concatenate, ParamSpec, Self, TypeVar

import duckdb

from schemas.tables import create_statements


class StoreError(RuntimeError):
    pass


class StoreLockedError(StoreError):
    pass


T = TypeVar("T")
P = ParamSpec("P")
F = TypeVar("F", bound="DuckDBFile")

WRITE_WAIT_S = 60.0  # how long a write-mode Store waits for another process to let go of the file
READ_WAIT_S = 10.0  # the same for read-only Stores (CLI commands): a write holds the file for milliseconds
_ALIAS = "clgrpo_db"  # the attached file's name inside a Store's in-memory connection


def _held_elsewhere(exc: duckdb.Error) -> bool:
    """Whether opening failed only because the file is open elsewhere: another process (DuckDB's file lock)
    or another connection of this process with another mode."""
    text = str(exc).lower()
    return (isinstance(exc, duckdb.IOException) and "lock" in text) or (
        isinstance(exc, duckdb.ResourceInUseException) and "already attached" in text
    )


def retry_while_locked(attempt: Callable[[], T], path: str | Path, wait_s: float) -> T:
    """``attempt()`` (an open of ``path``), again with backoff while another process holds the file, for up to
    ``wait_s`` seconds; then ``StoreLockedError`` naming the holder. The one retry loop of DuckDB opens."""
    deadline = time.monotonic() + wait_s
    pause = 0.002
    while True:
        try:
            return attempt()
        except duckdb.Error as exc:
            if not _held_elsewhere(exc):
                raise
            if time.monotonic() >= deadline:
                raise StoreLockedError(_locked_message(path, exc, wait_s)) from exc
        time.sleep(min(pause * random.uniform(0.5, 1.5), max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.1)


def _locked_message(path: str | Path, exc: duckdb.Error, wait_s: float) -> str:
    holder = re.search(r"\(PID (\d+)\)", str(exc))
    who = f"process {holder.group(1)}" if holder else "another connection of this process"
    return (
        f"{path} is in use: {who} kept this DuckDB file open for {wait_s:g} s (DuckDB lets one process at a "
        "time open a file for writing, and clgrpo holds it only while it reads or writes). Is another program "
        "(a DuckDB shell, a notebook) keeping it open? Close it, or use another db_path."
    )


def attached(method: Callable[Concatenate[F, P], T]) -> Callable[Concatenate[F, P], T]:
    """A public method that works on the file: attached for the call (reusing an attachment already open)."""

    @functools.wraps(method)
    def wrapper(self: F, *args: P.args, **kwargs: P.kwargs) -> T:
        with self.connected():
            return method(self, *args, **kwargs)

    return wrapper


class DuckDBFile:
    """The DuckDB file ``path``, attached only while a method works on it (see the module docstring)."""

    def __init__(self, path: str | Path, *, read_only: bool = False, wait_s: float | None = None) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self.wait_s = wait_s if wait_s is not None else (READ_WAIT_S if read_only else WRITE_WAIT_S)
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.exists():
            raise StoreError(f"{self.path}: no such DuckDB file")
        self._memory: duckdb.DuckDBPyConnection | None = None  # made once; the file is attached to it
        self._depth = 0  # open connected() blocks (nested calls, interleaved coroutines)
        self._pinned = False  # attached by a bare ``con`` access: kept until close()
        self._schema_ready = read_only  # the tables are created on the first attach of a write-mode Store
        self._guard = threading.RLock()  # one thread at a time works on the file through this Store
        if not read_only:
            with self.connected():  # create the tables now, and fail here if the file cannot be opened
                pass

    # --- holding the file -------------------------------------------------------------------------------
    @contextmanager
    def connected(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """Keep the file attached for a block (one transaction, or many reads from one snapshot); the
        store's methods called inside reuse the attachment."""
        with self._guard:
            if self._depth == 0 and not self._pinned:
                self._attach()
            self._depth += 1
            try:
                yield self._connection()
            finally:
                self._depth -= 1
                if self._depth == 0 and not self._pinned:
                    self._detach()

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The connection with the file attached (and in use): inside ``connected()`` or a store method; a
        bare access (tests, scripts) attaches it until ``close()``."""
        with self._guard:
            if self._depth == 0 and not self._pinned:
                self._attach()
                self._pinned = True
            return self._connection()

    def _connection(self) -> duckdb.DuckDBPyConnection:
        assert self._memory is not None, "attached by _attach"
        return self._memory

    def _attach(self) -> None:
        if self._memory is None:
            self._memory = duckdb.connect(":memory:")  # ~10 ms, once: DuckDB's own start-up
        mode = " (READ_ONLY)" if self.read_only else ""
        path = str(self.path).replace("'", "''")
        memory = self._memory
        retry_while_locked(lambda: memory.execute(f"ATTACH '{path}' AS {_ALIAS}{mode}"), self.path, self.wait_s)
        memory.execute(f"USE {_ALIAS}")
        if not self._schema_ready:
            self._create_schema()

    def _create_schema(self) -> None:
        try:
            memory = self._connection()
            for statement in create_statements():
                memory.execute(statement)
            memory.execute("INSERT INTO db_meta VALUES ('db_id', ?) ON CONFLICT DO NOTHING", [uuid.uuid4().hex])
        except BaseException:
            self._detach()
            raise
        self._schema_ready = True

    def _detach(self) -> None:
        if self._memory is not None:
            self._memory.execute("USE memory")
            self._memory.execute(f"DETACH {_ALIAS}")

    @property
    @attached
    def db_id(self) -> str:
        """This database's identity: made when the file was created (a re-created file gets a new one)."""
        try:
            row = self.con.execute("SELECT value FROM db_meta WHERE key = 'db_id'").fetchone()
        except duckdb.CatalogException:  # a file from before db_meta, opened read-only
            row = None
        return row[0] if row else "legacy"

    # --- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the file and drop the connection (a Store kept alive by a traceback must not pin DuckDB
        objects)."""
        with self._guard:
            if self._memory is None:
                return
            try:
                if self._depth or self._pinned:
                    self._detach()
            finally:
                self._memory.close()
                self._memory = None
                self._depth, self._pinned = 0, False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
