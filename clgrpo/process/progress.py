"""Progress inside long stages: items done out of items expected, per stage of the running step.

The training flow opens a stage (``start``) with what it expects (rollout samples, summaries, groups, ...);
the stage functions report each finished item (``advance``), wherever they run in this process (an event
loop, a worker thread). Listeners render it: rich progress bars on a terminal (``application.terminal``), or
nothing. Without an open stage of that name, ``advance`` does nothing (the same stage functions serve
evaluations and GPU child runs, which have no bar).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StageProgress:
    step: int
    stage: str
    unit: str
    total: int
    done: int = 0
    finished: bool = False

    @property
    def label(self) -> str:
        """``step 3 rollout``; a stage outside the steps (step 0: loading, an evaluation) by its name alone."""
        return f"step {self.step} {self.stage}" if self.step else str(self.stage)


Listener = Callable[[StageProgress], None]

_lock = threading.Lock()
_open: dict[str, StageProgress] = {}
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    with _lock:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def _notify(progress: StageProgress) -> None:
    with _lock:
        listeners = list(_listeners)
        snapshot = StageProgress(**vars(progress))
    for listener in listeners:
        listener(snapshot)


def start(step: int, stage: str, total: int, unit: str) -> None:
    """Open ``stage`` of ``step`` expecting ``total`` items (more may be announced with ``expect``)."""
    progress = StageProgress(step, stage, unit, total)
    with _lock:
        _open[stage] = progress
    _notify(progress)


def expect(stage: str, n: int) -> None:
    """``n`` more items for an open stage (e.g. summaries of a group that was just selected)."""
    _change(stage, total=n)


def advance(stage: str, n: int = 1) -> None:
    _change(stage, done=n)


def _change(stage: str, *, done: int = 0, total: int = 0) -> None:
    with _lock:
        progress = _open.get(stage)
        if progress is None:
            return
        progress.done += done
        progress.total += total
    _notify(progress)


def finish(stage: str) -> None:
    with _lock:
        progress = _open.pop(stage, None)
        if progress is None:
            return
        progress.finished = True
    _notify(progress)


def finish_all() -> None:
    for stage in list(_open):
        finish(stage)
