"""The child side of the math-verify pool (``domains.math.verify``): what runs inside the spawned children.

It imports only the standard library and, in the children, math-verify: a child unpickles its tasks by module
path, and a module under ``domains`` would first import the ``domains`` packages (pandas, pydantic schemas),
about 0.5 s of CPU per child at every pool start, all of it competing with the flow's first rollouts.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TIMEOUT_ERROR = "verify timeout"  # every timeout cause starts with this


@dataclass(frozen=True)
class VerifyResult:
    """One grade, or the verifier's admission that it could not grade.

    ``verified`` True: ``reward`` is a genuine grade (1.0 correct, 0.0 wrong, no answer found, empty output; ``error``
    may say why it is 0). ``verified`` False: the verifier could not do its work (it could not start, the item
    timed out, a worker crashed or hung, the pool kept restarting, an unexpected error, the reference answer is
    missing or unparseable); the cause is in ``error`` and ``reward`` is 0.0 only as a placeholder -- callers must
    not use it as a grade (store an error, retry).
    """

    reward: float  # in [0, 1]
    extracted: str | None = None  # the answer the verifier read from the output
    error: str | None = None  # why the reward is 0 (no answer found, ...) or why there is no grade
    verified: bool = True  # False: no grade (see above); the reward is then meaningless
    reason: str | None = None  # an LLM judge's one-sentence reason for its grade (``tasks/judge.py``)


Worker = Callable[[str, str, float], VerifyResult]


class _CpuBudgetExceeded(BaseException):
    """Raised in the child when an item used up its CPU budget (not an Exception: nobody's ``except Exception``
    swallows it)."""


class ChildState:
    events: Any = None  # the SimpleQueue to the parent
    armed = False  # a CPU budget is running
    fired = False  # the running item's budget ran out


def _on_cpu_budget(signum: int, frame: object) -> None:
    if ChildState.armed:
        ChildState.fired = True
        raise _CpuBudgetExceeded()


def child_init(events: Any) -> None:
    """Pool initializer: import and warm up math-verify, install the CPU-budget handler, tell the parent."""
    ChildState.events = events
    try:
        preload_verifier()
        signal.signal(signal.SIGPROF, _on_cpu_budget)
    except BaseException as exc:
        events.put(("failed", os.getpid(), f"{type(exc).__name__}: {exc}"))
        raise
    events.put(("ready", os.getpid(), None))


def preload_verifier() -> None:
    """Import math-verify and load its LaTeX parser before the first real item."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse, verify

    # we pass no math-verify timeouts (the CPU budget replaces them); silence its one-time warning about that
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    verify(parse("\\boxed{1}", parsing_timeout=None), parse("1", parsing_timeout=None), timeout_seconds=None)


def run_item(worker: Worker, token: int, output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Run one item in the child: report its start, then run ``worker`` under a one-shot CPU-time budget."""
    if ChildState.events is not None:
        ChildState.events.put(("start", token, os.getpid()))
    ChildState.fired = False
    result: VerifyResult | None = None
    try:  # a one-shot timer raises at most once, anywhere in here; the outer except catches it
        ChildState.armed = True
        signal.setitimer(signal.ITIMER_PROF, max(timeout_s, 0.001))
        try:
            result = worker(output, answer, timeout_s)
        finally:
            ChildState.armed = False
            signal.setitimer(signal.ITIMER_PROF, 0)
    except _CpuBudgetExceeded:
        pass
    if ChildState.fired or result is None:
        return VerifyResult(0.0, None, f"{TIMEOUT_ERROR}: used over {timeout_s:g}s of CPU time", verified=False)
    return result


def grade_one(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Grade one output in a child process (the CPU budget of ``_run_item`` bounds the whole item)."""
    from math_verify import parse, verify

    try:
        predicted = parse(output, parsing_timeout=None)
        if not predicted:
            return VerifyResult(0.0, None, "no answer found")
        extracted = str(predicted[1] if len(predicted) > 1 else predicted[0])
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
        if not gold:
            return VerifyResult(0.0, extracted, f"cannot parse the reference answer {answer!r}", verified=False)
        correct = verify(gold, predicted, timeout_seconds=None)
        return VerifyResult(1.0 if correct else 0.0, extracted, None)
    except Exception as exc:  # noqa: BLE001 - math-verify swallows most errors itself; this is the backstop
        return VerifyResult(0.0, None, f"verify error: {type(exc).__name__}: {exc}", verified=False)
