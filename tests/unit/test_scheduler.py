from __future__ import annotations

import pytest

from engine.core.request import FinishReason, RequestStatus
from engine.types import InvalidRequestError, RequestId
from tests.unit.helpers import fake_step, make_request, make_scheduler, plan


def test_token_budget_is_shared_and_prefill_is_chunked(clock) -> None:
    s = make_scheduler(clock, budget=8)
    r1, r2 = make_request("r1", 10, clock), make_request("r2", 3, clock)
    s.add_request(r1)
    s.add_request(r2)
    assert plan(fake_step(s)) == [("r1", 8)]  # first chunk fills the budget
    assert r1.block_ids == [0, 1] and r1.output_token_ids == []
    assert plan(fake_step(s)) == [("r1", 2), ("r2", 3)]  # last chunk + the short prompt
    assert (r1.num_prefill_chunks, r2.num_prefill_chunks) == (2, 1)
    assert r1.block_ids == [0, 1, 2] and r2.block_ids == [3]
    assert r1.output_token_ids == [7] and r2.output_token_ids == [7]
    assert plan(fake_step(s)) == [("r1", 1), ("r2", 1)]  # decode tokens share the budget


def test_decode_tokens_come_before_new_prefill_chunks(clock) -> None:
    s = make_scheduler(clock, budget=6)
    s.add_request(make_request("a", 2, clock))
    fake_step(s)
    s.add_request(make_request("b", 20, clock))
    assert plan(fake_step(s)) == [("a", 1), ("b", 5)]


def test_chunked_prefill_off_waits_for_a_whole_prompt(clock) -> None:
    s = make_scheduler(clock, budget=8, chunked=False)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        s.add_request(make_request("big", 9, clock))
    s.add_request(make_request("a", 6, clock))
    s.add_request(make_request("b", 5, clock))
    assert plan(fake_step(s)) == [("a", 6)]
    assert plan(fake_step(s)) == [("a", 1), ("b", 5)]


def test_max_num_seqs(clock) -> None:
    s = make_scheduler(clock, max_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 2, clock))
    assert plan(fake_step(s)) == [("r0", 2), ("r1", 2)]


def test_preemption_by_recompute_picks_newest_and_evicts_its_tail(clock) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4)
    r1, r2 = make_request("r1", 7, clock), make_request("r2", 7, clock)
    s.add_request(r1)
    s.add_request(r2)
    fake_step(s)  # both prefill 7 tokens: r1 [0, 1], r2 [2, 3]
    fake_step(s)  # token 8 of each fits in the second block
    assert (r1.block_ids, r2.block_ids) == ([0, 1], [2, 3])
    s.kv.pool.take_events()
    out = fake_step(s)  # both need a third block; none free
    assert out.preempted_ids == ["r2"]
    assert plan(out) == [("r1", 1)]
    assert r1.block_ids == [0, 1, 3]  # r2 freed tail first: 3 is evicted first
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_preemptions == 1 and r2.block_ids == []
    assert [e.kind for e in s.kv.pool.take_events()] == ["removed"]


def test_preempted_request_resumes_with_its_prefix_cached(clock) -> None:
    s = make_scheduler(clock, num_blocks=5, block_size=4)
    r1, r2 = make_request("r1", 7, clock, max_tokens=3), make_request("r2", 7, clock)
    s.add_request(r1)
    s.add_request(r2)
    fake_step(s)
    fake_step(s)
    out = fake_step(s)  # r1 takes block 4; r2 then needs a block: preempted
    assert out.preempted_ids == ["r2"]
    assert r1.is_finished and r1.finish_reason is FinishReason.LENGTH
    out = fake_step(s)
    # r2's two full blocks survived in the cache: only its last token is recomputed
    assert plan(out) == [("r2", 1)]
    assert r2.block_ids == [2, 3, 4]
    assert r2.num_computed_tokens == 9 and len(r2.output_token_ids) == 3


def test_priority_orders_waiting_and_aging_prevents_starvation(clock) -> None:
    s = make_scheduler(clock, budget=4)
    s.add_request(make_request("low", 4, clock, priority=1))
    s.add_request(make_request("high", 4, clock, priority=0))
    assert plan(fake_step(s)) == [("high", 4)]
    s2 = make_scheduler(clock, budget=4, aging_s=10.0)
    s2.add_request(make_request("old-low", 4, clock, priority=2))
    clock.advance(25.0)  # two aging intervals: effective priority 0
    s2.add_request(make_request("new-mid", 4, clock, priority=1))
    assert plan(fake_step(s2)) == [("old-low", 4)]


def test_a_more_important_waiting_request_goes_before_less_important_prefill_chunks(clock) -> None:
    s = make_scheduler(clock, budget=8)
    s.add_request(make_request("bulk", 20, clock, priority=1))
    assert plan(fake_step(s)) == [("bulk", 8)]
    s.add_request(make_request("peer", 20, clock, priority=1))
    s.add_request(make_request("urgent", 6, clock, priority=0))
    assert plan(fake_step(s)) == [("urgent", 6), ("bulk", 2)]  # bulk keeps what urgent leaves
    assert plan(fake_step(s)) == [("urgent", 1), ("bulk", 7)]  # peer (same class) waits for bulk


def test_a_light_tenant_goes_before_a_heavy_tenants_backlog_which_keeps_its_order(clock) -> None:
    s = make_scheduler(clock, budget=8)
    for i in range(3):
        s.add_request(make_request(f"heavy{i}", 8, clock, max_tokens=1, tenant="heavy"))
    assert plan(fake_step(s)) == [("heavy0", 8)]
    s.add_request(make_request("light", 8, clock, max_tokens=1, tenant="light"))
    assert plan(fake_step(s)) == [("light", 8)]  # heavy1 and heavy2 arrived first, but after heavy0 in fair time
    assert plan(fake_step(s)) == [("heavy1", 8)]
    assert plan(fake_step(s)) == [("heavy2", 8)]


@pytest.mark.parametrize("burst", [0, 9, 18])
def test_a_light_tenants_burst_runs_ahead_of_a_backlog_within_its_credit(clock, burst) -> None:
    """Requests cost 9 tokens (8 + 1 output). Strict fair queuing (burst 0) interleaves the
    light tenant's three with the heavy backlog one for one; each 9 tokens of credit lets
    one more of them go before the heavy tenant's next."""
    s = make_scheduler(clock, budget=8, burst=burst)
    s.add_request(make_request("light-early", 8, clock, max_tokens=1, tenant="light"))  # known, so it earns credit
    for i in range(6):
        s.add_request(make_request(f"heavy{i}", 8, clock, max_tokens=1, tenant="heavy"))
    for _ in range(5):  # light-early, then heavy0-3: the engine's virtual time moves on to heavy3's start
        fake_step(s)
    for i in range(3):
        s.add_request(make_request(f"light{i}", 8, clock, max_tokens=1, tenant="light"))
    order = [plan(fake_step(s))[0][0] for _ in range(5)]
    assert order == {0: ["light0", "heavy4", "light1", "heavy5", "light2"],
                     9: ["light0", "light1", "heavy4", "light2", "heavy5"],
                     18: ["light0", "light1", "light2", "heavy4", "heavy5"]}[burst]


def test_an_idle_engine_refills_known_tenants_credit_but_a_newcomer_starts_without(clock) -> None:
    """The light tenant had the engine to itself, then it idled: when a heavy newcomer's
    flood and the light tenant's burst meet, the burst (18 tokens of credit: two requests)
    goes first."""
    s = make_scheduler(clock, budget=8, burst=18)
    s.add_request(make_request("light0", 8, clock, max_tokens=1, tenant="light"))
    fake_step(s)
    assert not s.requests  # idle
    for i in range(3):
        s.add_request(make_request(f"heavy{i}", 8, clock, max_tokens=1, tenant="heavy"))
    for i in (1, 2):
        s.add_request(make_request(f"light{i}", 8, clock, max_tokens=1, tenant="light"))
    assert [plan(fake_step(s))[0][0] for _ in range(5)] == ["light1", "light2", "heavy0", "heavy1", "heavy2"]


def test_fair_order_follows_tenant_weights_and_outputs_go_before_prompt_work(clock) -> None:
    s = make_scheduler(clock, budget=4)
    for i in range(4):
        s.add_request(make_request(f"gold{i}", 4, clock, max_tokens=1, tenant="gold", weight=2.0))
        s.add_request(make_request(f"tin{i}", 4, clock, max_tokens=1, tenant="tin"))
    order = [plan(fake_step(s))[0][0] for _ in range(6)]
    assert order == ["gold0", "tin0", "gold1", "tin1", "gold2", "gold3"]  # twice the weight, twice the turns
    s.add_request(make_request("chat", 2, clock, max_tokens=3, tenant="chat"))
    assert plan(fake_step(s)) == [("chat", 2), ("tin2", 2)]
    assert plan(fake_step(s)) == [("chat", 1), ("tin2", 2), ("tin3", 1)]  # chat's output token first, then prompt work


def test_preemption_victim_is_lowest_priority_before_newest(clock) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4)
    low = make_request("low", 7, clock, priority=5)
    clock.advance(1)
    high = make_request("high", 7, clock, priority=0)
    s.add_request(low)
    s.add_request(high)
    fake_step(s)
    fake_step(s)
    out = fake_step(s)
    assert out.preempted_ids == ["low"] and plan(out) == [("high", 1)]


def _all_free(s) -> None:
    u = s.check_invariants()
    assert u.num_in_use == 0 and u.num_free + u.num_cached == u.num_total


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "decoding", "preempted", "remote_kv"])
def test_abort_in_every_state_frees_everything(clock, state: str) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4, budget=64 if state == "preempted" else 4)
    r = make_request("r", 7, clock)
    if state == "remote_kv":
        assert s.add_remote_request(r)
        assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and len(r.block_ids) == 2
    else:
        s.add_request(r)
    if state == "preempted":
        s.add_request(make_request("hog", 7, clock, priority=-1))
        for _ in range(3):
            fake_step(s)
        assert r.status is RequestStatus.PREEMPTED and r.num_preemptions == 1
        s.abort(RequestId("hog"))
    if state in ("mid_prefill", "decoding"):
        fake_step(s)
        assert r.num_computed_tokens == 4 and r.status is RequestStatus.RUNNING
    if state == "decoding":
        fake_step(s)
        assert r.output_token_ids == [7]
    assert s.abort(RequestId("r"))
    assert r.is_finished and r.finish_reason is FinishReason.ABORT
    assert not s.abort(RequestId("r"))  # finished: nothing left to abort
    assert s.waiting == [] and s.running == []
    _all_free(s)


def test_remote_kv_reuses_cached_prefix_then_decodes(clock) -> None:
    s = make_scheduler(clock, num_blocks=8, block_size=4)
    first = make_request("first", list(range(10)), clock, max_tokens=1)
    s.add_request(first)
    fake_step(s)
    assert first.is_finished
    r = make_request("remote", list(range(8)) + [50, 51, 52], clock)
    assert s.add_remote_request(r)
    assert r.num_cached_tokens == 8
    assert r.block_ids == [0, 1, 2]  # two cached blocks shared; first's uncached tail block is taken first
    assert plan(s.schedule()) == []  # nothing runs until the KV is there
    s.remote_kv_ready(RequestId("remote"), 99)
    assert r.output_token_ids == [99] and r.num_computed_tokens == 11
    out = fake_step(s)
    assert plan(out) == [("remote", 1)] and r.output_token_ids == [99, 7]


def test_remote_reservation_refused_when_pool_is_full(clock) -> None:
    s = make_scheduler(clock, num_blocks=2, block_size=4)
    assert s.add_remote_request(make_request("a", 7, clock))
    assert not s.add_remote_request(make_request("b", 5, clock))
    assert "b" not in s.requests
    assert s.check_invariants().num_in_use == 2


def test_bad_requests_refused(clock) -> None:
    s = make_scheduler(clock, max_model_len=16, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="context"):
        s.add_request(make_request("long", 16, clock))
    with pytest.raises(InvalidRequestError, match="empty"):
        make_request("empty", [], clock)
    s.add_request(make_request("dup", 3, clock))
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request(make_request("dup", 3, clock))


def test_stops_at_model_length(clock) -> None:
    s = make_scheduler(clock, max_model_len=6)
    r = make_request("r", 4, clock, max_tokens=100)
    s.add_request(r)
    for _ in range(3):
        fake_step(s)
    assert r.is_finished and r.finish_reason is FinishReason.LENGTH and r.num_tokens == 6


def test_a_lone_sequence_stops_when_it_fills_the_pool_instead_of_preempting_itself(clock) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4, max_model_len=1024)
    assert s.context_limit == 17
    r = make_request("r", 5, clock, max_tokens=100)
    s.add_request(r)
    for _ in range(20):
        out = fake_step(s)
        assert not out.preempted_ids
        if r.is_finished:
            break
    # 16 slots hold tokens 0..15; token 16 is sampled and never needs a slot.
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 17 and r.num_preemptions == 0
    assert s.check_invariants().num_in_use == 0


def test_a_sequence_that_outgrows_its_share_preempts_others_then_fills_the_pool(clock) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4, max_model_len=1024)
    old, new = make_request("old", 6, clock, max_tokens=100), make_request("new", 3, clock, max_tokens=100)
    s.add_request(old)
    s.add_request(new)
    for _ in range(60):
        fake_step(s)
        if old.is_finished:
            break
    assert old.finish_reason is FinishReason.LENGTH and old.num_tokens == 17
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    for _ in range(60):
        fake_step(s)
        if new.is_finished:
            break
    assert new.finish_reason is FinishReason.LENGTH and new.num_tokens == 17
    assert s.check_invariants().num_in_use == 0


def test_fair_order_forgets_only_tenants_past_their_credit_and_newcomers_get_none(clock) -> None:
    from engine.core.fair_order import STALE_TENANTS, FairOrder

    fair = FairOrder(burst_tokens=100)
    used = make_request("used", 4, clock, tenant="used")
    fair.tag(used, 250)  # new: starts at the virtual time, 0, and finishes at 250
    fair.started(used)
    for i in range(STALE_TENANTS):  # each 0 to 1
        fair.tag(make_request(f"t{i}", 4, clock, tenant=f"t{i}"), 1)
    fair.tag(make_request("big0", 4, clock, tenant="big"), 300)  # 0 to 300
    big1 = make_request("big1", 4, clock, tenant="big")
    fair.tag(big1, 1)
    fair.started(big1)  # virtual time 300, 66 tenants known: those finished by 200 go
    again = make_request("used-again", 4, clock, tenant="used")
    fair.tag(again, 1)
    assert again.fair_tag == 250  # kept: it finished within the credit of virtual time 300
    t0 = make_request("t0-again", 4, clock, tenant="t0")
    fair.tag(t0, 1)
    assert t0.fair_tag == 300  # forgotten: a newcomer again, which starts at the virtual time


def test_waiting_requests_whose_landed_kv_fills_the_pool_do_not_stall_it(clock) -> None:
    """Three remote prompts of exactly two blocks fill a 6-block pool; once their KV lands,
    each needs a seventh block for its first step and nothing runs to free one. The newest
    holder gives its blocks back (preempted, to recompute), and the other two start in them."""
    s = make_scheduler(clock, num_blocks=6, block_size=4)
    reqs = [make_request(rid, 8, clock) for rid in ("a", "b", "c")]
    for r in reqs:
        assert s.add_remote_request(r)
    for r in reqs:
        s.remote_kv_ready(r.request_id, 5)
    held = list(reqs[2].block_ids)
    out = fake_step(s)
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted_ids == []
    assert reqs[2].status is RequestStatus.PREEMPTED and reqs[2].block_ids == [] and s.num_preemptions == 1
    assert sorted([reqs[0].block_ids[2], reqs[1].block_ids[2]]) == sorted(held)
    while s.requests:  # every request ends, "c" recomputing its prompt and first token
        fake_step(s)
    assert [len(r.output_token_ids) for r in reqs] == [8, 8, 8] and reqs[2].num_preemptions == 1
    _all_free(s)
