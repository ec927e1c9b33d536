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


def test_capacity_lowers_the_budget_and_a_larger_one_admits_the_queue(clock) -> None:
    q = queue(clock, max_inflight_tokens=1000)
    assert q.set_capacity(100) == [] and q.budget_tokens == 90  # the pool holds 100 tokens of KV; 10 % headroom
    assert q.offer("a", 0, 60, None) is True
    assert q.offer("b", 0, 60, None) is False  # 120 > the budget: it would wait on a decode worker
    assert q.set_capacity(200) == ["b"]  # a decode worker joined
    assert q.set_capacity(0) == [] and q.budget_tokens == 1000  # unknown: the configured budget


def test_kv_overcommit_scales_the_capacity(clock) -> None:
    q = queue(clock, max_inflight_tokens=1000, kv_overcommit=1.5)
    q.set_capacity(100)
    assert q.budget_tokens == 135  # 150 less the share headroom


@pytest.mark.parametrize("headroom", [0.0, 0.1])
def test_the_share_headroom_lets_a_light_tenant_in_beside_a_flood_that_fills_the_budget(clock, headroom) -> None:
    q = queue(clock, max_inflight_tokens=1000, share_headroom=headroom)
    q.set_capacity(100)
    floods = [q.offer(f"a{i}", 0, 25, None, tenant="A") for i in range(5)]
    assert floods == ([True] * 4 + [False] if headroom == 0 else [True] * 3 + [False] * 2)
    assert q.offer("b0", 0, 10, None, tenant="B") is (headroom > 0)  # without headroom: no room left for B's share


def test_tenants_share_the_budget_fairly_within_a_class(clock) -> None:
    q = queue(clock, max_inflight_tokens=50)
    assert q.offer("a0", 0, 50, None, tenant="A") is True
    for i in range(1, 6):  # A floods first
        assert q.offer(f"a{i}", 0, 50, None, tenant="A") is False
    assert q.offer("b0", 0, 50, None, tenant="B") is False
    assert q.offer("b1", 0, 50, None, tenant="B") is False
    order, last = [], "a0"
    for _ in range(7):
        (last,) = q.release(last)
        order.append(last)
    # A already holds the budget, so B goes first, then they alternate: B never waits behind the flood
    assert order == ["b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_weights_set_the_shares(clock) -> None:
    q = queue(clock, max_inflight_tokens=10, tenant_weights={"gold": 3.0})
    assert q.offer("x", 0, 10, None) is True
    for i in range(6):
        assert q.offer(f"g{i}", 0, 10, None, tenant="gold") is False
        assert q.offer(f"s{i}", 0, 10, None, tenant="silver") is False
    served, last = [], "x"
    for _ in range(8):
        (last,) = q.release(last)
        served.append(last[0])
    assert served.count("g") == 6 and served.count("s") == 2  # 3:1 while both wait


def test_a_flooding_tenant_is_refused_naming_its_share(clock) -> None:
    q = queue(clock, max_inflight_tokens=10, max_queued_per_priority=8)
    q.offer("x", 0, 10, None, tenant="A")
    for i in range(8):  # alone, A may fill the queue
        assert q.offer(f"a{i}", 0, 10, None, tenant="A") is False
    for i in range(4, 8):
        q.release(f"a{i}")  # four leave the queue
    assert q.offer("b0", 0, 10, None, tenant="B") is False
    r = q.offer("a9", 0, 10, None, tenant="A")
    assert isinstance(r, Refused) and r.kind == "tenant_share"
    assert ("tenant 'A' already has 4 requests waiting at priority 0, its fair share of that queue (4 of 8 at "
            "weight 1 of 2)") in r.reason
    assert q.offer("b1", 0, 10, None, tenant="B") is False  # B still has room in its share


def test_a_tenant_quota_caps_its_admitted_tokens(clock) -> None:
    q = queue(clock, max_inflight_tokens=100, tenant_quota_tokens={"A": 30})
    assert q.offer("a0", 0, 20, None, tenant="A") is True
    assert q.offer("a1", 0, 20, None, tenant="A") is False  # 40 > A's quota, though the budget has room
    assert q.offer("b0", 0, 50, None, tenant="B") is True  # others pass it by
    r = q.offer("a2", 0, 31, None, tenant="A")
    assert isinstance(r, Refused) and r.kind == "quota" and r.retry_after_s is None
    assert q.release("a0") == ["a1"]
    assert q.tenant_tokens() == {"A": 20, "B": 50}


def test_aging_lets_the_least_important_class_progress(clock) -> None:
    q = queue(clock, max_inflight_tokens=10, aging_s=5.0, max_queue_wait_s=100.0)
    q.offer("x", 0, 10, None)
    q.offer("low", 8, 10, None)
    clock.advance(20.0)  # low has waited 4 agings: it now counts as priority 4
    q.offer("mid", 5, 10, None)
    assert q.release("x") == ["low"]
    q.offer("hi", 3, 10, None)
    assert q.release("low") == ["hi"]  # aging does not pass a fresher more important class


def test_the_wait_estimate_counts_only_what_is_served_first(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    q.offer("a", 0, 100, None, tenant="A")
    clock.advance(1.0)
    q.offer("b", 0, 100, None, tenant="A")
    q.release("a")
    clock.advance(1.0)
    q.offer("c", 0, 100, None, tenant="A")
    q.release("b")  # 100 tokens/s measured; c runs
    for i in range(5):  # A queues 500 tokens: ~5 s
        assert q.offer(f"a{i}", 0, 100, None, tenant="A") is False
    r = q.offer("late", 0, 100, deadline=clock() + 3.0, tenant="A")
    assert isinstance(r, Refused) and r.kind == "wait" and "estimated queue wait 6.0 s" in r.reason
    assert q.offer("b0", 0, 100, deadline=clock() + 3.0, tenant="B") is False  # B's turn comes after 1-2


def test_ttft_steering_cuts_the_budget_when_admitted_requests_are_slow_and_grows_it_back(clock) -> None:
    q = queue(clock, max_inflight_tokens=1000, ttft_budget_s=2.0, max_queue_wait_s=30.0)
    assert q.max_wait_s == 1.0  # half the TTFT budget is for the queue
    for i in range(10):
        assert q.offer(f"r{i}", 0, 100, None) is True
    for _ in range(15):
        assert q.observe_ttft(1.5, 100) == []  # 1.5 s > half the budget, but the window is not full
    q.observe_ttft(1.5, 100)
    assert q.limit_tokens == q.budget_tokens == 666  # two thirds of the 1000 in flight
    assert q.offer("x", 0, 100, None) is False  # 1000 + 100 > 666: waits
    for i in range(5):
        q.release(f"r{i}")  # 500 in flight: x still does not fit under 666? it does: 600
    assert q.num_admitted == 6 and q.num_queued == 0
    q.offer("y", 0, 100, None)
    assert q.num_queued == 1
    for _ in range(16):
        woken = q.observe_ttft(0.2, 100)  # fast again while requests wait: the budget grows
    assert q.limit_tokens == int(666 * 1.25) + 100 and woken == ["y"]
    for _ in range(40):
        q.observe_ttft(3.0, 100)
    assert q.limit_tokens == 400  # never below four requests' worth


def test_without_a_ttft_budget_nothing_is_steered(clock) -> None:
    q = queue(clock, max_inflight_tokens=1000)
    for _ in range(32):
        q.observe_ttft(100.0, 100)
    assert q.limit_tokens == q.budget_tokens == 1000 and q.max_wait_s == 30.0


def test_a_tenant_under_its_share_gets_in_while_another_overfills_the_budget(clock) -> None:
    q = queue(clock, max_inflight_tokens=1500, ttft_budget_s=1.0)
    for i in range(10):
        q.offer(f"a{i}", 0, 100, None, tenant="A")
    for _ in range(16):
        q.observe_ttft(2.0, 100)  # A's flood is slow: the budget is cut below what is in flight
    assert q.budget_tokens == 666 and q.inflight_tokens == 1000
    assert q.offer("a10", 0, 100, None, tenant="A") is False
    for i in range(3):  # B holds nothing of its half of the budget: in at once, up to 333 tokens
        assert q.offer(f"b{i}", 0, 100, None, tenant="B") is True
    assert q.offer("b3", 0, 100, None, tenant="B") is False
    assert q.offer("c0", 0, 100, None, tenant="C") is True  # a third of the budget each now
    assert q.offer("c1", 0, 100, None, tenant="C") is True
    assert q.inflight_tokens == 1500  # the KV capacity (the configured budget here) is never passed
    assert q.offer("d0", 0, 100, None, tenant="D") is False


def snapshot(q: AdmissionQueue) -> tuple:  # type: ignore[type-arg]
    """Everything the queue decides by, in plain values."""
    classes = {p: ({t: [(e.request_id, e.cost_tokens, e.start_tag) for e in fifo] for t, fifo in c.fifos.items()},
                   c.vtime, dict(c._finish), c.num_queued) for p, c in q._classes.items()}
    return (classes, dict(q._admitted), q.tenant_tokens(), q.inflight_tokens, q.budget_tokens, list(q._releases))


def test_a_refusal_at_a_lower_bound_of_the_cost_is_the_requests_own_and_changes_nothing(clock) -> None:
    """Random traffic (tenants, priorities, deadlines, a quota, releases, time); at each step a
    request is checked between a floor and a ceiling of its cost, then offered to a copy of the
    queue at its real cost: a refusal from the bounds is the same refusal at the cost, and the
    check moves nothing."""
    import copy
    import random

    rng = random.Random(7)
    q = queue(clock, max_inflight_tokens=400, max_queued_per_priority=6, max_queue_wait_s=5.0,
              tenant_weights={"A": 2.0}, tenant_quota_tokens={"C": 250})
    live: list[str] = []
    refused_early = 0
    for i in range(400):
        clock.advance(rng.random() * 0.3)
        if live and rng.random() < 0.4:
            live.remove(rid := rng.choice(live))
            q.release(rid)
        tenant, priority = rng.choice("ABC"), rng.choice((0, 0, 1))
        cost = rng.randrange(20, 300)
        floor = rng.randrange(1, cost + 1)
        deadline = clock() + rng.choice((0.5, 2.0, 10.0)) if rng.random() < 0.5 else None
        before = snapshot(q)
        early = q.refusal_at(priority, floor, cost + rng.randrange(0, 50), deadline, tenant)
        assert snapshot(q) == before
        if early is not None:
            refused_early += 1
            real = copy.deepcopy(q).offer(f"r{i}", priority, cost, deadline, tenant)
            assert isinstance(real, Refused) and real.kind == early.kind, (early, real)
        if (verdict := q.offer(f"r{i}", priority, cost, deadline, tenant)) is not False and verdict is not True:
            continue
        live.append(f"r{i}")
    assert refused_early > 20


def test_the_check_by_bounds_admits_what_offer_would_admit_past_a_full_queue(clock) -> None:
    q = queue(clock, max_inflight_tokens=100, max_queued_per_priority=2)
    assert [q.offer(f"a{i}", 0, 60, None, tenant="A") for i in range(3)] == [True, False, False]  # A's queue is full
    assert q.refusal_at(0, 30, 40, None, tenant="B") is None  # B, under its share, would go first and fit
    assert q.offer("b0", 0, 30, None, tenant="B") is True
    r = q.refusal_at(0, 30, 40, None, tenant="A")
    assert isinstance(r, Refused) and r.kind == "queue_full"


def test_each_queued_request_admitted_reports_actual_over_estimated_wait(clock) -> None:
    q = queue(clock, max_inflight_tokens=100)
    ratios: list[float] = []
    q.on_wait_estimate = ratios.append
    assert q.offer("w1", 0, 100, None) is True
    clock.advance(1.0)
    assert q.offer("w2", 0, 100, None) is False
    assert q.release("w1") == ["w2"] and ratios == []  # queued before any drain rate: no estimate to judge
    clock.advance(1.0)
    assert q.offer("a", 0, 100, None) is False  # 100 tokens/s measured below: told 1 s
    assert q.release("w2") == ["a"] and ratios == [] and q.drain_rate() == 100.0  # admitted at once: nothing waited
    assert q.offer("b", 0, 100, None) is False and q.offer("c", 0, 100, None) is False  # told 1 s and 2 s
    clock.advance(3.0)
    assert q.release("a") == ["b"]
    assert ratios == [pytest.approx(3.0)]  # b waited 3 s against 1 s estimated
    clock.advance(1.0)
    assert q.release("b") == ["c"]
    assert ratios[1] == pytest.approx(4.0 / 2.0)


def test_by_default_the_decode_pool_alone_sets_the_budget_however_large(clock) -> None:  # type: ignore[no-untyped-def]
    q = queue(clock)  # no max_inflight_tokens: a fleet's KV, not a fixed number, bounds what is admitted
    assert q.budget_tokens == 262_144  # the pool not known yet
    assert q.set_capacity(16 * 3_000_000) == [] and q.budget_tokens == int(48_000_000 * 0.9)
    for i in range(100):  # a hundred 15k-token requests in flight (a fixed 262,144 held 17)
        assert q.offer(f"r{i}", 0, 15_000, None) is True
    assert q.set_capacity(0) == [] and q.budget_tokens == 262_144  # unknown again
    capped = queue(clock, max_inflight_tokens=500_000)
    capped.set_capacity(48_000_000)
    assert capped.budget_tokens == int(500_000 * 0.9)  # a configured cap still holds
    with pytest.raises(ValueError, match="max_inflight_tokens must be positive"):
        AdmissionConfig(max_inflight_tokens=0)
