"""A model whose every layer has a sliding window holds only its window's blocks: the blocks
the window has passed go back to the pool (after the prefix cache has them), their table
entries become the null block, and a decode worker reserves only the blocks its first query
reads (the prefill worker never pushes the rest)."""
from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from tests.unit.helpers import fake_step, make_request, make_scheduler


def test_blocks_go_back_as_the_window_passes(clock) -> None:
    """block_size 4, window 6: the query at p reads keys p - 5 .. p, so after computing n
    tokens the blocks wholly before n - 5 go back."""
    s = make_scheduler(clock, num_blocks=12, block_size=4, budget=8, window=6)
    kv = s.kv
    assert kv.null_block == 0 and kv.pool.num_free_blocks == 11  # the null block is the manager's
    r = make_request("a", 20, clock, max_tokens=12)
    s.add_request(r)
    fake_step(s)  # tokens 0-7
    assert r.block_ids == [1, 2] and r.num_slid_blocks == 0
    fake_step(s)  # 8-15: the next query (16) reads keys 11.. : blocks 0 and 1 passed
    assert r.block_ids == [0, 0, 3, 4] and r.num_slid_blocks == 2
    assert kv.pool.num_free_blocks == 11 - 2  # blocks 1 and 2 back, both still cached
    fake_step(s)  # 16-19 and the first token: query 20 reads keys 15.. : block 2 (8-11) passed
    assert r.block_ids == [0, 0, 0, 4, 5] and r.num_slid_blocks == 3
    for _ in range(7):  # decodes to 27 tokens: query 27 reads keys 22..: block 4 (16-19) passed
        fake_step(s)
    assert r.num_computed_tokens == 27 and r.block_ids == [0, 0, 0, 0, 0, 6, 7] and r.num_slid_blocks == 5
    assert kv.pool.num_free_blocks == 11 - 2
    while not r.is_finished:
        fake_step(s)
    assert kv.pool.num_free_blocks == 11 and s.check_invariants().num_in_use == 1  # the null block alone


def test_a_prefix_hit_claims_only_the_blocks_its_first_query_reads(clock) -> None:
    """The same 20-token prompt again: the 4 full blocks are cached; its first query is at 16
    (the last prompt token is computed), reading keys 11..: the hit claims blocks 2 and 3 only."""
    s = make_scheduler(clock, num_blocks=12, block_size=4, budget=32, window=6)
    prompt = list(range(100, 120))
    a = make_request("a", prompt, clock, max_tokens=1)
    s.add_request(a)
    fake_step(s)
    assert a.is_finished and s.kv.pool.num_free_blocks == 11
    b = make_request("b", prompt, clock, max_tokens=2)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 4 and b.num_computed_tokens == 16
    assert b.block_ids[:4] == [0, 0, 3, 4] and b.num_slid_blocks == 2  # blocks 1 and 2 stay cached, unclaimed
    assert s.kv.pool.ref_cnt(1) == s.kv.pool.ref_cnt(2) == 0 and s.kv.pool.lookup(b.block_hashes[0]) == 1
    s.update_after_step(out, {b.request_id: (7, None)})
    assert b.block_ids[:4] == [0, 0, 0, 4] and b.num_slid_blocks == 3  # query 20 reads keys 15..
    # a hit inside the window only: a prompt sharing the first 8 tokens computes the rest
    c = make_request("c", prompt[:8] + list(range(500, 512)), clock, max_tokens=1)
    s.add_request(c)
    fake_step(s)
    assert c.num_cached_tokens == 8
    while s.requests:
        fake_step(s)
    assert s.check_invariants().num_in_use == 1


def test_a_remote_prompt_reserves_from_its_first_decode_query_s_window(clock) -> None:
    """A decode worker reserves, for a 30-token prompt, the blocks query 30 reads (keys 25..:
    blocks 6 and 7); the 6 before are null and skipped by the sender."""
    s = make_scheduler(clock, num_blocks=12, block_size=4, window=6)
    r = make_request("r", 30, clock, max_tokens=3)
    assert s.add_remote_request(r)
    assert r.block_ids == [0] * 6 + [1, 2] and r.num_cached_blocks == 6 and r.num_slid_blocks == 6
    assert s.kv.pool.num_free_blocks == 11 - 2
    s.remote_kv_ready(r.request_id, 5)
    assert r.status is RequestStatus.WAITING
    while not r.is_finished:
        fake_step(s)
    assert s.kv.pool.num_free_blocks == 11


def test_no_window_keeps_every_block_and_no_null_block(clock) -> None:
    s = make_scheduler(clock, num_blocks=12, block_size=4, budget=8)
    assert s.kv.null_block is None
    r = make_request("a", 20, clock, max_tokens=1)
    s.add_request(r)
    for _ in range(3):
        fake_step(s)
    assert r.is_finished and s.kv.pool.usage().num_cached == 5


@pytest.mark.parametrize("window,budget,want", [(0, 8, 1024), (6, 8, 1024), (6, 64, 13 * 4 + 1)])
def test_a_window_lifts_the_pool_s_context_limit_when_a_window_and_a_step_fit(clock, window, budget, want) -> None:
    """A 14-block pool (13 free beside the null block) holds a window of 6 and a step of 8
    (blocks for 14 tokens, and one more), so a sequence runs to the model's context; a step
    of 64 does not fit, and the pool's limit stays. Without a window the pool is 14 blocks."""
    s = make_scheduler(clock, num_blocks=14 if window else 300, block_size=4, budget=budget, window=window)
    assert s.context_limit == want
