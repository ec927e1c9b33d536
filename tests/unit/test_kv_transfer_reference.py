"""The transfer reference (`KVCacheManager.begin_transfer` .. `end_transfer`): whatever ends a
request while a push lane reads its blocks or a one-sided writer may write them (its last
token at the first one, an abort, a preemption), the blocks stay held, off the pool, until
the transfer lets go; then, and only then, all of them go back."""
from __future__ import annotations

from engine.core.request import FinishReason
from engine.types import RequestId
from tests.unit.helpers import make_request, make_scheduler


def _step(s, token: int = 7) -> None:
    out = s.schedule()
    s.update_after_step(out, {x.request.request_id: (token, None) for x in out.scheduled
                              if x.request.num_computed_tokens + x.num_new_tokens == x.request.num_tokens})
    s.check_invariants()


def test_a_request_that_ends_at_its_first_token_keeps_its_blocks_until_the_transfer_ends(clock) -> None:
    s = make_scheduler(clock, num_blocks=8, block_size=4)
    s.kv.begin_transfer(RequestId("a"))  # the hand-off opens before the request is added
    s.add_request(make_request("a", 10, clock, max_tokens=1))
    _step(s)
    assert "a" not in s.requests  # finished (length) at its first token
    assert s.kv.held(RequestId("a")) == [0, 1, 2]
    assert s.kv.pool.num_free_blocks == 5
    assert not s.kv.release(RequestId("a"))  # another holder letting go does not free them
    assert s.kv.end_transfer(RequestId("a"))
    assert s.kv.held(RequestId("a")) == [] and s.kv.pool.num_free_blocks == 8
    assert not s.kv.end_transfer(RequestId("a"))


def test_an_aborted_request_keeps_its_blocks_while_the_transfer_runs(clock) -> None:
    s = make_scheduler(clock, num_blocks=8, block_size=4, budget=4)
    s.kv.begin_transfer(RequestId("a"))
    s.add_request(make_request("a", 10, clock))
    _step(s)  # one chunk of 4: block 0 is computed and may be read by the lane
    assert s.abort(RequestId("a"))
    assert s.kv.held(RequestId("a")) == [0]
    assert s.kv.end_transfer(RequestId("a"))
    assert s.kv.pool.num_free_blocks == 8


def test_a_preempted_request_keeps_its_pushed_blocks_off_the_pool(clock) -> None:
    s = make_scheduler(clock, num_blocks=4, block_size=4)
    r1, r2 = make_request("r1", 7, clock), make_request("r2", 7, clock)
    s.kv.begin_transfer(r2.request_id)
    s.add_request(r1)
    s.add_request(r2)
    _step(s)  # both prefill 7 tokens: r1 [0, 1], r2 [2, 3]
    _step(s)
    out = s.schedule()  # both need a third block; none free: r2 goes, and its blocks do not
    assert out.preempted_ids == ["r2", "r1"]  # come back, so r1 is preempted for its own
    assert s.kv.held(r2.request_id) == [2, 3] and r2.block_ids == []  # the lane may still read them
    assert all(b not in r1.block_ids for b in (2, 3))
    s.abort(r1.request_id)
    s.abort(r2.request_id)
    assert s.kv.pool.num_free_blocks == 2
    assert s.kv.end_transfer(r2.request_id)
    assert s.kv.pool.num_free_blocks == 4


def test_the_handed_off_blocks_of_a_finished_prefill_are_held_once(clock) -> None:
    s = make_scheduler(clock, num_blocks=8, block_size=4)
    r = make_request("a", 6, clock)
    s.kv.begin_transfer(r.request_id)
    s.add_request(r)
    _step(s)
    s.kv.hold(r)  # the prefill role's hand-off at the first token
    s.finish(r, FinishReason.PREFILL_DONE, keep_blocks=True)
    assert s.kv.held(r.request_id) == [0, 1]
    s.abort(r.request_id)  # the call ends meanwhile: nothing changes
    assert s.kv.held(r.request_id) == [0, 1] and s.kv.pool.num_free_blocks == 6
    assert s.kv.end_transfer(r.request_id) and s.kv.pool.num_free_blocks == 8
