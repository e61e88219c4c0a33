"""math-verify grading on a loaded machine: verification that cannot lie.

A sample's time limit counts only the sample's own work (CPU time in its child), never pool start-up or time
queued; what cannot be graded comes back ``verified=False`` with the cause, never as a reward of 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import domains.math.verify as verify_mod
from domains.base import VerifyResult
from domains.math import MathDomain
from domains.math.verify import pool_is_up, pool_start_seconds, shutdown_pool, verify_batch, warm_pool

# correct final answers in the shapes rollouts write them, against the reference as a dataset stores it
CORRECT = [
    *[(f"Adding the cases, so the answer is \\boxed{{{n}}}.", str(n)) for n in (204, 113, 371, 25, 55, 809, 0, 7)],
    *[(f"Final answer: $\\boxed{{{n}}}$", str(n)) for n in (33, 480, 721, 236)],
    ("so $x = \\frac{1}{2}$, and the answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("The probability is \\boxed{0.5}.", "\\frac{1}{2}"),
    ("Hence \\boxed{\\frac{3}{4}}.", "3/4"),
    ("We get \\boxed{\\dfrac{7}{8}}", "\\frac{7}{8}"),
    ("The ratio is \\boxed{2/3}.", "\\frac{2}{3}"),
    ("Thus \\boxed{\\sqrt{2}/2}.", "\\frac{\\sqrt{2}}{2}"),
    ("so the side is \\boxed{2\\sqrt{3}}.", "2\\sqrt{3}"),
    ("The area is \\boxed{\\pi r^2}.", "\\pi r^2"),
    ("which gives \\boxed{x^2+2x+1}.", "(x+1)^2"),
    ("The roots sum to \\boxed{-\\frac{b}{a}}", "-b/a"),
    ("Therefore the count is $$\\frac{408}{2}$$", "204"),
    ("After simplifying everything. The answer is 42", "42"),
    ("The answer is \\boxed{1{,}000}.", "1000"),
    ("so the answer is \\boxed{3\\pi}.", "3\\pi"),
    ("The solutions are \\boxed{1, 2}.", "1,2"),
    ("We obtain \\boxed{\\frac{\\pi}{4}}.", "\\pi/4"),
    ("The value is \\boxed{2^{10}}.", "1024"),
    ("The final answer is \\boxed{e^{2}}.", "e^2"),
]


# --- workers (module-level: they run in the spawned children) --------------------------------------


def _hang_or_grade(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Hangs (sleeps, using no CPU) on the output "hang"; grades everything else with math-verify."""
    if output == "hang":
        time.sleep(120)
    return verify_mod._grade_one(output, answer, timeout_s)


def _cpu_burner(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Busy forever: only the CPU budget stops it."""
    while True:
        pass


def _swallower(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Swallows every interruption and claims a grade after three times its CPU budget."""
    deadline = time.process_time() + 3 * timeout_s
    while time.process_time() < deadline:
        try:
            while time.process_time() < deadline:
                pass
        except BaseException:  # noqa: BLE001 - swallowing the time limit is what this grader tests
            pass
    return VerifyResult(1.0, "swallowed")


def _cpu_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Uses ``float(output)`` seconds of CPU time, then grades 1.0 and reports its own wall time."""
    started, wall = time.process_time(), time.monotonic()
    while time.process_time() - started < float(output):
        pass
    return VerifyResult(1.0, f"{time.monotonic() - wall:.3f}")


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def hogs() -> Iterator[list[subprocess.Popen]]:
    """One busy-looping process per core (this machine has 2): the verifier competes for every CPU."""
    n = max(2, os.cpu_count() or 2)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)
        assert all(p.poll() is None for p in procs)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def _wait_until_up(limit_s: float = 150.0) -> float:
    started = time.monotonic()
    while not pool_is_up():
        assert time.monotonic() - started < limit_s, "the pool did not come up"
        time.sleep(0.02)
    return time.monotonic() - started


# --- tests ------------------------------------------------------------------------------------------


def test_cold_pool_under_cpu_hogs_grades_every_correct_answer(hogs: list[subprocess.Popen]) -> None:
    """The bug: on a loaded 2-core machine a batch of correct answers came back 'verifier unavailable' with
    reward 0. Pool start-up and queueing must not count against the per-sample limit (default 5 s)."""
    shutdown_pool()  # cold start, under load
    domain = MathDomain()
    started = time.monotonic()
    box: list[list[VerifyResult]] = []
    thread = threading.Thread(target=lambda: box.append(domain.verify_batch(CORRECT)))  # as asyncio.to_thread
    thread.start()
    thread.join(timeout=300)
    wall = time.monotonic() - started
    (results,) = box
    print(
        f"\nunder {len(hogs)} CPU hogs: pool start {pool_start_seconds():.2f}s, batch of {len(CORRECT)} "
        f"(cold) {wall:.2f}s"
    )
    bad = [(item, r) for item, r in zip(CORRECT, results) if not (r.verified and r.reward == 1.0)]
    assert not bad, bad

    # again from three threads at once, the pool cold again: one pool is started and shared
    shutdown_pool()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        batches = list(pool.map(domain.verify_batch, [CORRECT[0:10], CORRECT[10:20], CORRECT[20:]]))
    wall = time.monotonic() - started
    print(f"three threads, cold pool: pool start {pool_start_seconds():.2f}s, {len(CORRECT)} items {wall:.2f}s")
    assert all(r.verified and r.reward == 1.0 for batch in batches for r in batch)


def test_a_starved_child_is_not_timed_out(hogs: list[subprocess.Popen]) -> None:
    """The limit is the child's CPU time: work that takes longer than the limit in wall time, because the
    machine is loaded, still counts as within it."""
    warm_pool()
    _wait_until_up()
    results = verify_batch([("0.3", "x")] * 4, timeout_s=0.6, worker=_cpu_worker)
    walls = [float(r.extracted or "nan") for r in results]
    print(f"\n0.3 s of CPU per item under load took {min(walls):.2f}-{max(walls):.2f}s wall (CPU limit 0.6 s)")
    assert all(r.verified and r.reward == 1.0 for r in results), results


def test_an_item_over_its_cpu_budget_is_unverified_and_the_pool_survives() -> None:
    warm_pool()
    _wait_until_up()
    before = verify_mod._POOL.current()
    started = time.monotonic()
    burnt, swallowed = verify_batch([("a", "1")], timeout_s=0.3, worker=_cpu_burner) + verify_batch(
        [("b", "1")], timeout_s=0.3, worker=_swallower
    )
    assert time.monotonic() - started < 10
    for result in (burnt, swallowed):
        assert result.verified is False and result.reward == 0.0
        assert result.error is not None and "timeout" in result.error and "CPU" in result.error
    assert verify_mod._POOL.current() is before  # the child stopped itself: nothing was killed
    assert verify_batch([("\\boxed{2.0}", "2")]) == [VerifyResult(1.0, "2.0", None, verified=True)]


def test_a_hung_worker_is_unverified_and_the_rest_of_the_batch_is_graded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "DEADLINE_MARGIN_S", 0.2)  # hang limit 4 * 0.5 + 0.2 = 2.2 s after start
    warm_pool()
    _wait_until_up()
    items = [*CORRECT[:3], ("hang", "1"), ("\\boxed{5}", "6"), *CORRECT[3:6]]
    started = time.monotonic()
    results = verify_batch(items, timeout_s=0.5, worker=_hang_or_grade)
    assert time.monotonic() - started < 30
    hung = results[3]
    assert hung.verified is False and hung.reward == 0.0 and "timeout" in (hung.error or "")
    others = results[:3] + results[4:]
    assert all(r.verified for r in others), others
    assert [r.reward for r in others] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert verify_batch([("\\boxed{2.0}", "2")])[0].reward == 1.0  # a fresh pool took over


def test_warm_pool_starts_the_pool_ahead_of_the_first_batch() -> None:
    shutdown_pool()
    assert not pool_is_up()
    warm_pool()
    MathDomain().warm()  # idempotent: joins the start under way
    assert not pool_is_up()  # returned at once: the start (about half a second) goes on in the background
    up_after = _wait_until_up()
    generation = verify_mod._POOL.current()
    warm_pool()  # a no-op once up
    assert verify_mod._POOL.current() is generation
    started = time.monotonic()
    results = verify_batch(CORRECT[12:22])  # no boxed integers: graded in the pool
    first_batch = time.monotonic() - started
    print(
        f"\nwarm_pool: pool up after {up_after:.2f}s (start {pool_start_seconds():.2f}s); "
        f"first batch {first_batch:.3f}s"
    )
    assert all(r.verified and r.reward == 1.0 for r in results)
    assert verify_mod._POOL.current() is generation  # the batch used the warm pool: it did not start one


def test_a_failed_start_is_reported_as_unverified_then_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    shutdown_pool()
    monkeypatch.setattr(verify_mod, "STARTUP_TIMEOUT_S", 0.0)  # no child can be ready in time
    warm_pool()
    deadline = time.monotonic() + 30
    while verify_mod._POOL._attempt is not None and not verify_mod._POOL._attempt.done.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monkeypatch.undo()
    (result,) = verify_batch([("\\boxed{1.0}", "1")])  # the warm-up's failure, reported on first use
    assert result.verified is False and result.reward == 0.0
    assert (result.error or "").startswith("verifier unavailable: TimeoutError")
    assert verify_batch([("\\boxed{1.0}", "1")])[0] == VerifyResult(1.0, "1.0", None, verified=True)


def test_unparseable_reference_is_unverified() -> None:
    (result,) = verify_batch([("\\boxed{1}", "}{")])
    assert result.verified is False and "reference answer" in (result.error or "")
