"""The one fault model of the loopback fakes (``fake_openai``, ``fake_embeddings``): what a client of a remote
model meets besides answers, scripted by call count, rate or time window.

A ``Fault`` says what goes wrong (an HTTP status with ``Retry-After``, a delay, a connection dropped or reset, a
broken 200 body) and when (the next ``times`` matching requests, each one with probability ``rate``, or every
request within ``window_s``). A server holds its pending faults in a ``FaultPlan`` (seeded, thread-safe), takes
the fault for each request from it and serves it on the wire with ``loopback.LoopbackHandler``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast, get_args

__all__ = ["DEFAULT_MIX", "FAULT_KINDS", "WIRE_KINDS", "Fault", "FaultKind", "FaultPlan", "retry_after_header"]

FaultKind = Literal["status", "delay", "drop", "reset", "malformed", "no_choices", "empty", "truncate", "mixed"]
FAULT_KINDS = frozenset(get_args(FaultKind))


@dataclass
class Fault:
    """A scripted failure. ``kind``:

    - "status": answers HTTP ``status`` with an OpenAI-style error body (its ``message``, and ``Retry-After:
      retry_after`` if set), e.g. 429 or 5xx;
    - "delay": sleeps ``delay_s``, then answers normally (a client timeout below ``delay_s`` fires);
    - "drop": closes the connection cleanly (FIN) without any response;
    - "reset": resets the connection (RST: ``SO_LINGER (1, 0)``, then close) without any response;
    - "malformed": HTTP 200, ``application/json``, a body that is not valid JSON (a chat.completion cut in half);
    - "no_choices": HTTP 200, a valid chat.completion object (with ``usage``) that has no ``choices`` key;
    - "empty": HTTP 200, a normal completion whose every choice has content "" (finish_reason "stop");
    - "truncate": HTTP 200, the responder's normal reply with every choice cut to at most ``max(1, cut_words)``
      words and finish_reason "length" (these three are chat completions: ``FakeOpenAIServer`` only);
    - "mixed": one of ``options`` (other faults), picked uniformly per affected request on the server's seeded
      RNG; build it with ``Fault.mixed``.

    "status", "drop" and "reset" answer at once; the 200 kinds and "delay" wait the server's ``latency`` like a
    normal reply. Only "delay" and "truncate" call the responder (the server's normal answer).

    When the fault applies, for a request it ``match``es (None: every request; for chat requests
    ``fake_openai.match_roles`` scopes it to stages): without ``rate`` and ``window_s``, to the next ``times``
    matching requests, then it is removed. With ``rate``, to each matching request with that probability (one draw
    per matching request on the server's ``random.Random(seed)``); ``times`` is then ignored. With ``window_s``, to
    the matching requests that arrive within ``window_s`` seconds of the first matching request (the window starts
    at that request, not at inject time, so a slow start does not eat the window); after it the fault is removed.
    ``rate`` and ``window_s`` combine (a 20% rate for 2 s). Faults are tried in inject order and the first that
    applies is served; a rate fault whose draw misses lets the later faults be tried (``FaultPlan.take``).
    """

    kind: FaultKind = "status"
    match: Callable[[Any], bool] | None = None  # None: any request
    times: int = 1  # matching requests affected before the fault is consumed (without rate and window_s)
    status: int = 500
    retry_after: float | None = None  # seconds, sent as the Retry-After header
    message: str | None = None  # "status": the error body's message (None: "injected fault: HTTP <status>")
    delay_s: float = 0.0
    cut_words: int = 3  # "truncate": words kept per choice (at least 1)
    rate: float | None = None  # probability per matching request; never consumed
    window_s: float | None = None  # active for this long after the first matching request, then removed
    options: tuple["Fault", ...] = ()  # "mixed": the faults to pick from
    _window_started: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {sorted(FAULT_KINDS)}")
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.kind == "mixed":
            if not self.options:
                raise ValueError("a mixed fault needs options")
            if any(o.kind == "mixed" for o in self.options):
                raise ValueError("mixed faults cannot be nested")

    @classmethod
    def mixed(
        cls,
        rate: float | None = None,
        kinds: tuple["str | Fault", ...] | None = None,
        *,
        match: Callable[[Any], bool] | None = None,
        times: int = 1,
        window_s: float | None = None,
    ) -> "Fault":
        """A fault that serves one of ``kinds`` (default ``DEFAULT_MIX``), picked uniformly per affected request
        on the server's seeded RNG. A kind is a ``Fault`` (its own ``match``/``times``/``rate``/``window_s`` are
        ignored: the mixed fault decides when to apply) or a string: a kind name ("malformed", "reset", ...) or
        "status:<code>" (no Retry-After; pass ``Fault(kind="status", status=429, retry_after=1)`` for one).
        ``faults_served`` and the request log record the label of the kind served, never "mixed"."""
        options = tuple(_as_fault(k) for k in (DEFAULT_MIX if kinds is None else kinds))
        return cls(kind="mixed", match=match, times=times, rate=rate, window_s=window_s, options=options)

    @property
    def label(self) -> str:
        """ "status:<code>" for "status" faults, else the kind ("mixed" faults are recorded as the kind served)."""
        return f"status:{self.status}" if self.kind == "status" else self.kind

    def _expired(self, now: float) -> bool:
        return (
            self.window_s is not None
            and self._window_started is not None
            and now - self._window_started >= self.window_s
        )


def _as_fault(kind: "str | Fault") -> Fault:
    if isinstance(kind, Fault):
        return replace(kind)  # a copy: options are shared by nobody
    if kind.startswith("status:"):
        return Fault(kind="status", status=int(kind.split(":", 1)[1]))
    return Fault(kind=cast(FaultKind, kind))  # validated by __post_init__


DEFAULT_MIX: tuple["str | Fault", ...] = (
    "malformed",
    "no_choices",
    "empty",
    "truncate",
    "reset",
    "drop",
    "status:500",
    Fault(kind="status", status=429, retry_after=1),
)
"""The mix ``Fault.mixed`` uses by default: every reply fault a proxy sees, 429 with ``Retry-After: 1``."""


WIRE_KINDS = frozenset({"status", "delay", "drop", "reset", "malformed", "mixed"})
"""The kinds that any loopback fake serves; "no_choices", "empty" and "truncate" shape a chat completion."""


class FaultPlan:
    """A server's pending faults, in inject order, and the seeded RNG behind ``rate`` draws and ``mixed`` picks:
    the same seed and the same sequence of requests give the same faults (with concurrent requests, the arrival
    order decides). ``kinds``: the fault kinds the server can serve (others are refused at ``inject``)."""

    def __init__(self, seed: int = 0, kinds: Iterable[str] = FAULT_KINDS) -> None:
        self.kinds = frozenset(kinds)
        self._faults: list[Fault] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def inject(self, fault: Fault) -> Fault:
        refused = {f.kind for f in (fault, *fault.options)} - self.kinds
        if refused:
            raise ValueError(f"this server does not serve {sorted(refused)} faults; it serves {sorted(self.kinds)}")
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending(self) -> list[Fault]:
        """The faults not yet consumed (window faults whose window has passed are removed here too)."""
        now = time.monotonic()
        with self._lock:
            self._faults[:] = [f for f in self._faults if not f._expired(now)]
            return list(self._faults)

    def take(self, request: Any) -> Fault | None:
        """The fault to serve for ``request`` (a "mixed" one resolved to the option picked), consuming or
        expiring faults; None: answer normally."""
        now = time.monotonic()
        with self._lock:
            for fault in list(self._faults):
                if fault._expired(now):
                    self._faults.remove(fault)
                    continue
                if fault.match is not None and not fault.match(request):
                    continue
                if fault.window_s is not None and fault._window_started is None:
                    fault._window_started = now
                if fault.rate is not None:
                    if self._rng.random() >= fault.rate:
                        continue
                elif fault.window_s is None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                return self._rng.choice(fault.options) if fault.kind == "mixed" else fault
        return None


def retry_after_header(fault: Fault) -> dict[str, str]:
    """The ``Retry-After`` header of a "status" fault (whole seconds without a decimal point), or none."""
    if fault.retry_after is None:
        return {}
    value = fault.retry_after
    return {"Retry-After": str(int(value)) if float(value).is_integer() else f"{value:g}"}
