"""The retry policy both remote clients share (clgrpo/models/retry.py) and the fault model the loopback fakes share."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from clgrpo.models.retry import Backoff, RetryBudget, is_retryable_status, retry_after_delay, retry_after_seconds
from clgrpo.testing.fake_embeddings import EmbeddingServer
from clgrpo.testing.faults import Fault, FaultPlan, retry_after_header


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 599])
def test_rate_limits_timeouts_conflicts_and_server_errors_are_retried(status):
    assert is_retryable_status(status)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_other_client_errors_are_not(status):
    assert not is_retryable_status(status)


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after_seconds({"retry-after": "2.5"}) == 2.5
    assert retry_after_seconds({"retry-after": "-3"}) == 0.0
    assert retry_after_seconds({}) is None and retry_after_seconds(None) is None
    assert retry_after_seconds({"retry-after": "soon"}) is None
    in_ten = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=10), usegmt=True)
    assert 8 <= retry_after_seconds({"retry-after": in_ten}) <= 10
    past = format_datetime(datetime.now(timezone.utc) - timedelta(seconds=10), usegmt=True)
    assert retry_after_seconds({"retry-after": past}) == 0.0


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half():
    backoff, rng = Backoff(base_s=1.0, max_s=5.0), random.Random(0)
    assert [backoff.ceiling(r) for r in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    for retries in range(6):
        ceiling = backoff.ceiling(retries)
        assert all(ceiling / 2 <= backoff.delay(retries, rng) <= ceiling for _ in range(50))


def test_retry_after_is_honoured_within_the_cap_or_as_asked_with_jitter():
    backoff, rng = Backoff(base_s=0.01, max_s=5.0), random.Random(0)
    assert backoff.delay_within_cap(0, 3.0, rng) == 3.0
    assert backoff.delay_within_cap(0, 60.0, rng) == 5.0
    assert backoff.delay_within_cap(0, None, rng) <= 0.01
    assert all(30.0 <= retry_after_delay(30.0, rng) <= 33.05 for _ in range(50))


def test_a_fault_plan_serves_times_then_is_empty_and_refuses_kinds_its_server_lacks():
    plan = FaultPlan(seed=0, kinds={"status"})
    fault = plan.inject(Fault(status=429, retry_after=1, times=2))
    assert [plan.take("req"), plan.take("req"), plan.take("req")] == [fault, fault, None]
    assert retry_after_header(fault) == {"Retry-After": "1"}
    with pytest.raises(ValueError, match="does not serve"):
        plan.inject(Fault(kind="empty"))
    with EmbeddingServer() as server, pytest.raises(ValueError, match=r"does not serve \['truncate'\]"):
        server.inject(Fault.mixed(kinds=("status:500", "truncate")))


def test_a_call_budget_counts_errors_and_times_rate_limits():
    budget = RetryBudget(max_retries=2, max_rate_limit_wait_s=10, backoff=Backoff(1, 8))
    for now in (0.0, 1.0):  # two counted errors are retried, the third is not
        assert budget.spent(limited=False, counted=True, now=now) is None
        assert 0 < budget.next_delay(limited=False, counted=True, retry_after=None) <= 2
    assert budget.spent(limited=False, counted=True, now=2.0) == "gave up after 2 retries"
    assert (budget.attempt, budget.errors) == (2, 2)
    # rate limits are waited out by time from the first 429, never counted; Retry-After sets the wait
    assert budget.spent(limited=True, counted=True, now=100.0) is None
    assert 30 <= budget.next_delay(limited=True, counted=True, retry_after=30) <= 33.05
    assert budget.errors == 2 and budget.attempt == 3
    assert budget.spent(limited=True, counted=True, now=109.0) is None
    assert budget.spent(limited=True, counted=True, now=111.0) == "rate limited for 11s (max_rate_limit_wait_s=10)"
