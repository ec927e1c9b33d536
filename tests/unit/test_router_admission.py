from __future__ import annotations

import pytest

from router.admission import AdmissionConfig, AdmissionQueue, Refused


def queue(clock, **kw) -> AdmissionQueue:  # type: ignore[no-untyped-def]
    return AdmissionQueue(AdmissionConfig(**kw), clock)


def test_budget_queues_then_admits_in_priority_order(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    assert q.offer("a", 0, 60, None) is True
    assert q.offer("b", 1, 51, None) is False
    assert q.offer("c", 0, 50, None) is False
    assert q.queued_by_priority() == {0: 1, 1: 1}
    assert q.release("a") == ["c"]  # priority 0 before 1
    assert q.release("c") == ["b"]
    assert q.release("b") == []
    assert (q.inflight_tokens, q.num_admitted, q.num_queued) == (0, 0, 0)


def test_head_of_line_is_not_bypassed(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    assert q.offer("a", 0, 90, None) is True
    assert q.offer("big", 0, 80, None) is False
    assert q.offer("small", 0, 25, None) is False  # would fit, but waits behind "big"
    assert q.release("a") == ["big"]


def test_oversized_request_runs_alone(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    assert q.offer("huge", 0, 500, None) is True
    assert q.offer("x", 0, 1, None) is False
    assert q.release("huge") == ["x"]


def test_full_queue_is_refused_with_retry_hint(clock) -> None:
    q = queue(clock, max_inflight_tokens=10, max_queued_per_priority=2, min_retry_after_s=0.5)
    q.offer("a", 0, 10, None)
    q.offer("b", 0, 10, None)
    q.offer("c", 0, 10, None)
    r = q.offer("d", 0, 10, None)
    assert isinstance(r, Refused) and "priority 0 is full (2 requests waiting)" in r.reason
    assert r.retry_after_s == 0.5
    assert q.offer("e", 1, 10, None) is False  # another priority has its own bound


def test_deadline_that_cannot_be_met_is_refused_early(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    q.offer("a", 0, 100, None)
    clock.advance(1.0)
    q.offer("b", 0, 100, None)
    assert q.release("a") == ["b"]  # first release: no rate yet
    clock.advance(1.0)
    q.offer("c", 0, 100, None)
    assert q.release("b") == ["c"]  # 100 tokens/s measured
    r = q.offer("d", 0, 100, deadline=clock() + 0.5)  # 100 tokens short -> ~1 s wait
    assert isinstance(r, Refused) and "estimated queue wait 1.0 s" in r.reason
    assert r.retry_after_s == pytest.approx(1.0)
    assert q.offer("e", 0, 100, deadline=clock() + 5.0) is False


def test_expire_and_withdraw(clock) -> None:
    q = queue(clock, max_inflight_tokens=10, max_queue_wait_s=5.0)
    q.offer("a", 0, 10, None)
    q.offer("b", 0, 10, deadline=clock() + 1.0)
    q.offer("c", 0, 10, None)
    q.offer("d", 0, 10, None)
    q.release("d")  # a queued request leaving
    clock.advance(1.0)
    assert q.expire() == ["b"]
    clock.advance(4.0)
    assert q.expire() == ["c"]
    assert q.release("a") == []


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_inflight_tokens"):
        AdmissionConfig(max_inflight_tokens=0)
