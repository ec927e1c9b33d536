"""Long random operation sequences never break block accounting, and never leak: requests
added (locally or for remote KV), stepped, aborted, given their remote KV, and transfers
begun and ended on them (the push lane's and the quarantine's reference)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.request import RequestStatus
from engine.types import InvalidRequestError, RequestId
from tests.conftest import FakeClock
from tests.unit.helpers import fake_step, make_request, make_scheduler

# Prompts from a tiny alphabet with shared stems, so prefix hits and evictions happen.
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
    st.lists(st.integers(0, 3), min_size=1, max_size=14),
)
ops = st.one_of(
    st.tuples(st.just("add"), prompts, st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("add_remote"), prompts, st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(0, 20)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("kv_ready"), st.integers(0, 40)),
    st.tuples(st.just("begin_transfer"), st.integers(0, 40)),
    st.tuples(st.just("end_transfer"), st.integers(0, 40)),
    st.tuples(st.just("tick"), st.floats(0, 30)),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=1, max_size=60),
    st.integers(4, 24),
    st.sampled_from([2, 4]),
    st.integers(3, 16),
    st.booleans(),
)
def test_random_operations_keep_invariants(ops_, num_blocks, block_size, budget, chunked) -> None:
    clock = FakeClock()
    s = make_scheduler(clock, num_blocks=num_blocks, block_size=block_size, budget=budget,
                       chunked=chunked, max_seqs=4, aging_s=5.0)
    added = 0
    for op in ops_:
        kind = op[0]
        if kind in ("add", "add_remote"):
            r = make_request(f"r{added}", op[1], clock, max_tokens=op[3], priority=op[2])
            added += 1
            add = s.add_request if kind == "add" else s.add_remote_request
            too_long = s.kv.blocks_needed(r.num_prompt_tokens + 1) > num_blocks or \
                (not chunked and r.num_prompt_tokens > budget)
            if too_long:  # refused at admission, nothing kept
                with pytest.raises(InvalidRequestError, match="more than"):
                    add(r)
            else:
                add(r)
        elif kind == "step":
            fake_step(s, token=op[1])
        elif kind == "abort":
            s.abort(RequestId(f"r{op[1]}"))
        elif kind == "kv_ready":
            r = s.requests.get(RequestId(f"r{op[1]}"))
            if r is not None and r.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                s.remote_kv_ready(r.request_id, 5)
        elif kind == "begin_transfer":
            s.kv.begin_transfer(RequestId(f"r{op[1]}"))
        elif kind == "end_transfer":
            s.kv.end_transfer(RequestId(f"r{op[1]}"))
        else:
            clock.advance(op[1])
        s.check_invariants()
    for rid in list(s.requests):
        s.abort(rid)
    for i in range(added):
        s.kv.end_transfer(RequestId(f"r{i}"))
    u = s.check_invariants()
    assert u.num_in_use == 0 and u.num_free + u.num_cached == num_blocks
    assert s.waiting == [] and s.running == []


@settings(max_examples=100, deadline=None)
@given(st.lists(prompts, min_size=1, max_size=8), st.integers(6, 20))
def test_everything_finishes_without_aborts(prompt_list, num_blocks) -> None:
    """With room for any single request, every request completes (no livelock) and no leak."""
    clock = FakeClock()
    s = make_scheduler(clock, num_blocks=num_blocks, block_size=4, budget=8, max_seqs=4)
    reqs = [make_request(f"r{i}", p, clock, max_tokens=3) for i, p in enumerate(prompt_list)]
    for r in reqs:
        s.add_request(r)
    for _ in range(500):
        if not s.requests:
            break
        fake_step(s)
        clock.advance(1.0)
    assert all(r.is_finished and len(r.output_token_ids) == 3 for r in reqs)
    assert s.check_invariants().num_in_use == 0
