"""Process settings for long runs with many concurrent LLM calls.

The imports of a run (Prefect, pandas, pandera, DuckDB, the HTTP stack) leave about 200,000 objects
that the garbage collector would rescan in every full collection: at thousands of calls per second that froze
the event loop for 0.3-0.45 s about every 4 s (REPORT.md, "Scale"). ``tune_gc`` moves what is alive after the
imports into the permanent generation (never scanned; it is not garbage) and collects the youngest generation
less often, which cuts pauses without letting reference cycles pile up.

``auto_cpu_threads`` is how many threads a local model's CPU work may use (the chat engine of the transformers
backend, the embedded sentence-embedding model): the cores this process may use, less those busy now.
"""

from __future__ import annotations

import atexit
import gc
import os

YOUNG_THRESHOLD = 20_000  # allocations between young collections (CPython's default: 700)
DISABLE_ENV = "CLGRPO_TUNE_GC"  # "0": leave the garbage collector as Python set it (the test suite does)

_tuned = False


def tune_gc() -> None:
    """Once per process, after the heavy imports (the flows call it when they start): freeze the survivors and
    raise the young threshold."""
    global _tuned
    if _tuned or os.environ.get(DISABLE_ENV) == "0":
        return
    _tuned = True
    gc.freeze()
    atexit.register(gc.unfreeze)  # frozen objects are never finalized: give them back before the interpreter exits
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_cpu_threads() -> int:
    """The cores this process may use, less those that other work keeps busy now (1-minute load average):
    oversubscribed OpenMP threads slow torch down several times (measured here: a 32-row decode took 13 s on
    1 thread and 13-51 s on 2 threads on a 2-core machine under load 3; 10 s on 2 threads when idle)."""
    cpus = available_cpus()
    try:
        busy = round(os.getloadavg()[0])
    except OSError:  # no load average on this platform
        busy = 0
    return max(1, min(cpus, cpus - busy))
