"""Work journals: every model request and every finished item of a run, appended the moment it completes.

A stage reaches DuckDB in one transaction once the whole stage is done (``Store.write_stage``). Until then its
work lives here, in an append-only JSON-lines file per (database, run, step) next to the database::

    <db dir>/.clgrpo-journal/<db file name>-<db id>/<run id>/step-0003.jsonl

Two kinds of lines: ``call`` (one per request sent to a model, ok or not, with its cause) and ``item`` (one
per successful unit of work: a rollout sample, a verification, a summary, a group's proposal). So

- a stage that fails or is killed is still accounted: its calls are ingested into ``llm_calls`` when the run
  fails or resumes, and the stage's own write later includes them;
- a retry or rerun redoes only the items that are not in the journal (failed items are never written here);
- the journal belongs to one database file: its directory carries the database's identity (``Store.db_id``),
  so a new or re-created database never picks up another database's work; the journals of an earlier file
  of the same name (deleted and re-created) are removed when a run opens the new one.

Retention: a step's file is deleted once that step is checkpointed in DuckDB (and validated, when due); a
run's directory goes with ``clgrpo runs delete``. A line cut short by a kill is ignored (and trimmed).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from schemas.records import LLMCall

JOURNAL_DIR = ".clgrpo-journal"
M = TypeVar("M", bound=BaseModel)


def _db_dir(db_path: str | Path, db_id: str) -> Path:
    path = Path(db_path).expanduser().resolve()
    return path.parent / JOURNAL_DIR / f"{path.name}-{db_id}"


def run_journal_dir(db_path: str | Path, db_id: str, run_id: str) -> Path:
    return _db_dir(db_path, db_id) / run_id


def prune_other_incarnations(db_path: str | Path, db_id: str) -> list[Path]:
    """Remove the journals of earlier database files at this path (same name, another identity): their
    database is gone, so their work must never be used (nor kept forever)."""
    current = _db_dir(db_path, db_id)
    stale = [
        d
        for d in current.parent.glob(f"{current.name.rsplit('-', 1)[0]}-*")
        if d != current and d.is_dir() and d.name.rsplit("-", 1)[0] == current.name.rsplit("-", 1)[0]
    ]
    for directory in stale:
        shutil.rmtree(directory, ignore_errors=True)
    return stale


class StepJournal:
    """The journal of one step: thread-safe appends (verification runs in worker threads), an index in memory."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._calls: dict[str, dict[tuple[str, int], LLMCall]] = defaultdict(dict)  # stage -> (call, try) -> call
        self._items: dict[tuple[str, str], dict[str, Any]] = {}  # (stage, key) -> record as JSON
        self.unreadable_lines = 0
        self._load()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    # --- writes ---------------------------------------------------------------------------------------
    def add_call(self, call: LLMCall) -> None:
        """Filed under the stage being recorded (``recording(stage=...)``), else the call's own stage."""
        stage = _STAGE.get() or call.stage
        self._append({"t": "call", "stage": stage, "call": call.model_dump(mode="json")})
        self._index_call(stage, call)

    def put(self, stage: str, key: str, record: BaseModel) -> None:
        data = record.model_dump(mode="json")
        self._append({"t": "item", "stage": stage, "key": key, "record": data})
        self._items[(stage, key)] = data

    def _append(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        with self._lock:
            os.write(self._fd, line)  # one write per line (O_APPEND): a kill loses at most the line in flight

    # --- reads ----------------------------------------------------------------------------------------
    def calls(self, stage: str | None = None) -> list[LLMCall]:
        stages = [stage] if stage is not None else list(self._calls)
        return sorted((c for s in stages for c in self._calls.get(s, {}).values()), key=lambda c: c.started_at)

    def all_calls(self, stage: str, returned: list[LLMCall]) -> list[LLMCall]:
        """A stage's calls: every one recorded here for it (earlier, failed or killed attempts included) plus
        those its computation returned that were made elsewhere (a GPU pool worker), which are recorded now so
        a later attempt still counts them. Each request once."""
        known = {(c.call_id, c.retries) for c in self.calls(stage)}
        with recording(self, stage=stage):
            for call in returned:
                if not call.call_id or (call.call_id, call.retries) not in known:
                    self.add_call(call if call.call_id else call.model_copy(update={"call_id": uuid.uuid4().hex[:16]}))
        return self.calls(stage)

    def stages_with_calls(self) -> list[str]:
        return [s for s, calls in self._calls.items() if calls]

    def get(self, stage: str, key: str, model: type[M]) -> M | None:
        data = self._items.get((stage, key))
        return None if data is None else model.model_validate(data)

    def items(self, stage: str, prefix: str = "") -> int:
        """How many finished items of ``stage`` (whose key starts with ``prefix``) the journal holds."""
        return sum(s == stage and key.startswith(prefix) for s, key in self._items)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # --- loading --------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):  # the last line was cut by a kill: drop it before appending again
            with open(self.path, "r+b") as handle:
                handle.truncate(len(complete))
        for raw in complete.splitlines():
            try:
                entry = json.loads(raw)
                if entry["t"] == "call":
                    call = LLMCall.model_validate(entry["call"])
                    self._index_call(entry.get("stage") or call.stage, call)
                elif entry["t"] == "item":
                    self._items[(entry["stage"], entry["key"])] = entry["record"]
            except (ValueError, KeyError, TypeError):
                self.unreadable_lines += 1  # the work it described is redone; the count is reported
                continue

    def _index_call(self, stage: str, call: LLMCall) -> None:
        self._calls[stage][(call.call_id, call.retries)] = call


class RunJournal:
    """A run's journals in one database: one file per step."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._steps: dict[int, StepJournal] = {}

    @classmethod
    def open(cls, db_path: str | Path, db_id: str, run_id: str) -> "RunJournal":
        prune_other_incarnations(db_path, db_id)
        return cls(run_journal_dir(db_path, db_id, run_id))

    def step(self, step: int) -> StepJournal:
        if step not in self._steps:
            self._steps[step] = StepJournal(self.root / f"step-{step:04d}.jsonl", step)
        return self._steps[step]

    def steps_on_disk(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.stem.split("-")[1]) for p in self.root.glob("step-*.jsonl"))

    def discard_step(self, step: int) -> None:
        """The step is stored in DuckDB: its journal is no longer needed."""
        journal = self._steps.pop(step, None)
        if journal is not None:
            journal.close()
        (self.root / f"step-{step:04d}.jsonl").unlink(missing_ok=True)

    def close(self) -> None:
        for journal in self._steps.values():
            journal.close()
        self._steps.clear()

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)
        for empty in (self.root.parent, self.root.parent.parent):  # the database's folder, then the journal's
            try:
                empty.rmdir()
            except OSError:
                break


def discard_run(db_path: str | Path, run_id: str) -> None:
    """Remove a run's journals of the database file at this path (``clgrpo runs delete``)."""
    for directory in run_journals(db_path, run_id):
        shutil.rmtree(directory, ignore_errors=True)


def run_journals(db_path: str | Path, run_id: str) -> list[Path]:
    path = Path(db_path).expanduser().resolve()
    return [d for d in (path.parent / JOURNAL_DIR).glob(f"*/{run_id}") if d.parent.name.rsplit("-", 1)[0] == path.name]


# --- the journal of the work in progress ---------------------------------------------------------------
_ACTIVE: ContextVar[StepJournal | None] = ContextVar("clgrpo_step_journal", default=None)
_ITEMS: ContextVar[bool] = ContextVar("clgrpo_journal_items", default=True)
_STAGE: ContextVar[str | None] = ContextVar("clgrpo_journal_stage", default=None)


@contextmanager
def recording(
    journal: StepJournal | None, *, stage: str | None = None, items: bool = True
) -> Iterator[StepJournal | None]:
    """Calls produced inside this block (and the asyncio tasks it starts) go to ``journal``, filed under
    ``stage`` (None: each call's own stage); so do finished items, unless ``items`` is False (work that is not
    a training stage, e.g. validation, logs its calls only)."""
    tokens = _ACTIVE.set(journal), _ITEMS.set(items), _STAGE.set(stage)
    try:
        yield journal
    finally:
        _ACTIVE.reset(tokens[0])
        _ITEMS.reset(tokens[1])
        _STAGE.reset(tokens[2])


def active() -> StepJournal | None:
    return _ACTIVE.get()


class StageItems(Generic[M]):
    """A stage's finished items in the active journal (none when there is no journal, e.g. a pool worker).
    ``always``: even where the recording keeps no items (an evaluation keeps its graded samples, never the
    rollouts and verifications inside them, whose keys do not name the condition)."""

    def __init__(self, stage: str, model: type[M], *, always: bool = False) -> None:
        self.stage, self.model = stage, model
        self.journal = active() if always or _ITEMS.get() else None

    def get(self, key: str) -> M | None:
        return None if self.journal is None else self.journal.get(self.stage, key, self.model)

    def put(self, key: str, record: M) -> None:
        if self.journal is not None:
            self.journal.put(self.stage, key, record)


def sample_key(problem_id: str, sample_idx: int) -> str:
    return f"{problem_id}#{sample_idx}"
