"""The retry policy of calls to a remote model: which HTTP statuses are worth another attempt, how long to wait
before it (exponential backoff with jitter, capped) and what a server's ``Retry-After`` asks for.

Both clients of remote models use it: the LLM client (``clgrpo.llm.client``, over ``clgrpo.llm.backends``) and
the ``/v1/embeddings`` client (``clgrpo.models.embeddings``). Their loops differ in what they count (the LLM client
waits out rate limits by time, the embeddings client by attempts), not in the schedule, which lives here.
The lock retry of DuckDB opens (``clgrpo.storage.connection.retry_while_locked``) is a local wait, not a remote one, and
keeps its own pacing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Protocol

RETRYABLE_STATUSES = frozenset({408, 409, 429})  # and every 5xx
RATE_LIMITED = 429


class Uniform(Protocol):
    """What the schedule draws its jitter from: ``random.Random`` or the ``random`` module itself."""

    def uniform(self, a: float, b: float) -> float: ...


def is_retryable_status(status: int) -> bool:
    """Rate limits, request timeouts, conflicts and server errors; other 4xx will fail again the same way."""
    return status in RETRYABLE_STATUSES or status >= 500


def retry_after_seconds(headers: object) -> float | None:
    """A response's ``Retry-After`` in seconds (delta-seconds or an HTTP-date, never negative); None when the
    header is absent or unreadable. ``headers``: anything with a case-insensitive ``get``."""
    value = getattr(headers, "get", lambda _k: None)("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds())
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``base_s`` doubled per retry up to ``max_s``, the wait drawn from the upper half
    of that ceiling (so callers that failed together do not return together)."""

    base_s: float
    max_s: float

    def ceiling(self, retries: int) -> float:
        return min(self.max_s, self.base_s * 2**retries)

    def delay(self, retries: int, rng: Uniform = random) -> float:
        """The wait before retry number ``retries + 1``."""
        ceiling = self.ceiling(retries)
        return rng.uniform(ceiling / 2, ceiling)

    def delay_within_cap(self, retries: int, retry_after: float | None, rng: Uniform = random) -> float:
        """The backoff, or the server's ``Retry-After`` when that is longer, never past ``max_s``."""
        delay = self.delay(retries, rng)
        return delay if retry_after is None else min(max(delay, retry_after), self.max_s)


def retry_after_delay(retry_after: float, rng: Uniform = random) -> float:
    """The server's ``Retry-After`` as asked (not capped: a rate-limit window is bounded by time elsewhere), plus
    up to 10% and 50 ms of jitter so the callers waiting it out do not all return at the same instant."""
    return retry_after + rng.uniform(0, 0.1 * retry_after + 0.05)


@dataclass
class RetryBudget:
    """What one call has left after each transient failure: ``max_retries`` counted errors, or, once rate
    limited, ``max_rate_limit_wait_s`` seconds from its first 429 (rate limits are waited out by time, never
    counted). ``attempt`` numbers the attempts (0 for the first)."""

    max_retries: int
    max_rate_limit_wait_s: float
    backoff: Backoff
    attempt: int = 0
    errors: int = 0
    limited_since: float | None = None

    def spent(self, *, limited: bool, counted: bool, now: float) -> str | None:
        """After a transient failure: why no attempt is left (in words), or None."""
        if limited:
            self.limited_since = now if self.limited_since is None else self.limited_since
            waited = now - self.limited_since
            if waited > self.max_rate_limit_wait_s:
                return f"rate limited for {waited:.0f}s (max_rate_limit_wait_s={self.max_rate_limit_wait_s:g})"
            return None
        return f"gave up after {self.errors} retries" if counted and self.errors >= self.max_retries else None

    def next_delay(self, *, limited: bool, counted: bool, retry_after: float | None, rng: Uniform = random) -> float:
        """The wait before the next attempt (the server's ``Retry-After`` when it sent one); counts the error."""
        delay = self.backoff.delay(self.errors, rng) if retry_after is None else retry_after_delay(retry_after, rng)
        if counted and not limited:
            self.errors += 1
        self.attempt += 1
        return delay
