from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.types import BlockHash, InvariantError


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


def test_allocates_lowest_ids_first_and_refuses_shortage() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [3]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_freed_blocks_without_a_hash_are_taken_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    pool.free(reversed(a))  # a request frees its tail first; nothing cached, so each goes to the front
    b = pool.allocate(2)
    assert b == [0, 1]
    pool.cache_blocks(b, [h(1), h(2)], None)
    pool.free(reversed(b))
    assert pool.allocate(4) == [2, 3, 4, 5] and pool.lookup(h(1)) == 0  # cached blocks wait behind the empty ones
    assert pool.allocate(2) == [1, 0] and pool.lookup(h(1)) is None


def test_a_reused_prefix_outlives_one_off_blocks() -> None:
    """SLRU: blocks hit again after they were stored survive a stream of one-off cached blocks."""
    pool = BlockPool(8, protected_fraction=0.25)  # protected holds at most 2
    prefix = pool.allocate(2)
    pool.cache_blocks(prefix, [h(1), h(2)], None)
    pool.free(reversed(prefix))
    pool.touch(prefix)  # a second request hits the prefix
    pool.free(reversed(prefix))
    for i in range(10):  # one-off prompts, each caching a block never asked for again
        b = pool.allocate(1)
        pool.cache_blocks(b, [h(10 + i)], None)
        pool.free(b)
    assert pool.lookup(h(1)) == 0 and pool.lookup(h(2)) == 1
    assert pool.allocate(7) is not None  # all of probation first, then protected's oldest
    assert pool.lookup(h(2)) is None and pool.lookup(h(1)) == 0
    pool.check_invariants()


def test_protected_is_capped_and_its_oldest_drop_back() -> None:
    """The eviction order is what `allocate` takes, front first."""
    def hit_three() -> BlockPool:
        pool = BlockPool(8, protected_fraction=0.25)
        blocks = pool.allocate(3)
        pool.cache_blocks(blocks, [h(1), h(2), h(3)], None)
        pool.free(blocks)
        pool.touch(blocks)
        pool.free(blocks)  # 0, 1, 2 protected in that order: 0 drops back to probation's tail
        return pool

    assert hit_three().allocate(8) == [3, 4, 5, 6, 7, 0, 1, 2]
    pool = hit_three()
    pool.touch([0])
    pool.free([0])  # hit again: protected once more, pushing out 1
    assert pool.check_invariants().num_cached == 3
    assert pool.allocate(8) == [3, 4, 5, 6, 7, 1, 2, 0]


def test_eviction_order_is_lru_and_emits_removed() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, [h(0), h(1), h(2), h(3)], None)
    pool.free(reversed(blocks))  # free queue: 3, 2, 1, 0
    usage = pool.check_invariants()
    assert (usage.num_free, usage.num_cached, usage.num_in_use) == (0, 4, 0)
    pool.take_events()
    assert pool.allocate(2) == [3, 2]
    events = pool.take_events()
    assert [(e.kind, e.block_hashes) for e in events] == [("removed", [h(3), h(2)])]
    assert pool.lookup(h(3)) is None and pool.lookup(h(1)) == 1


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(3)
    b = pool.allocate(1)
    pool.cache_blocks(b, [h(9)], None)
    pool.free(b)
    assert pool.lookup(h(9)) == 0 and pool.ref_cnt(0) == 0
    pool.touch([0])
    assert pool.ref_cnt(0) == 1 and pool.check_invariants().num_in_use == 1
    pool.touch([0])
    pool.free([0])
    pool.free([0])
    pool.check_invariants()
    assert pool.allocate(3) == [1, 2, 0]  # back in the free queue, behind the empty blocks


def test_events_are_numbered_without_gaps_and_carry_parents() -> None:
    pool = BlockPool(4)
    b = pool.allocate(2)
    pool.cache_blocks(b, [h(1), h(2)], None)
    c = pool.allocate(1)
    pool.cache_blocks(c, [h(3)], h(2))
    events = pool.take_events()
    assert [e.event_id for e in events] == [0, 1]
    assert events[1].parent_block_hash == h(2)
    pool.free(b + c)
    assert pool.allocate(4) is not None  # the three cached blocks evicted, in the order they were freed
    assert [(e.event_id, e.kind, e.block_hashes) for e in pool.take_events()] == [(2, "removed", [h(1), h(2), h(3)])]


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, [h(5)], None)
    pool.cache_blocks(b, [h(5)], None)
    assert pool.lookup(h(5)) == a[0] and pool.block_hash(b[0]) is None
    assert len(pool.take_events()) == 1


def test_double_free_is_a_bug() -> None:
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(InvariantError):
        pool.free(b)


def test_caching_disabled_stores_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    b = pool.allocate(1)
    pool.cache_blocks(b, [h(1)], None)
    assert pool.lookup(h(1)) is None and pool.take_events() == []


def test_holder_check_catches_a_block_nobody_holds() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(1)
    assert pool.check_holders([a, b]).num_in_use == 3
    with pytest.raises(InvariantError, match="block 2: ref_cnt 1 but 0 holders"):
        pool.check_holders([a])  # b's table was lost: a leak
    pool.touch(b)
    with pytest.raises(InvariantError, match="ref_cnt 2 but 1 holders"):
        pool.check_holders([a, b])


def test_lookup_run_stops_at_the_first_miss_and_counts_block_zero() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    pool.cache_blocks(blocks, [h(1), h(2), h(3)], None)
    assert pool.lookup_run([h(1), h(2), h(3)]) == [0, 1, 2]
    assert pool.lookup_run([h(1), h(9), h(3)]) == [0]  # block 3 is cached too, but after a miss
    assert pool.lookup_run([h(9), h(1)]) == [] and pool.lookup_run([]) == []
