"""Garbage-collection pauses of this process, from ``gc.callbacks`` (used by client_cpu.py and scale.py)."""

from __future__ import annotations

import gc
import time


class GCPauses:
    """``with GCPauses() as pauses: ...``: total and count of pauses by generation, and the longest one."""

    def __init__(self) -> None:
        self.total = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count = {0: 0, 1: 0, 2: 0}
        self.longest = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info.get("generation", 2)
        self.total[generation] += pause
        self.count[generation] += 1
        self.longest = max(self.longest, pause)

    def __enter__(self) -> "GCPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)
