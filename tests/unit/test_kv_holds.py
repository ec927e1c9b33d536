"""The KV cache manager holds a request's blocks for the transfer layer until released: the
one place that knows them (a prefill hand-off, a decode worker's quarantine)."""
from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.hashing import BlockHasher
from engine.core.roles import PrefillRole, Role, role_for
from tests.unit.helpers import SECRET, fake_step, make_request, make_scheduler


def test_held_blocks_stay_in_use_until_released(clock) -> None:
    pool = BlockPool(8, enable_caching=False)
    kv = KVCacheManager(pool, BlockHasher(SECRET, "m", 4))
    r = make_request("a", 10, clock)
    assert kv.allocate_slots(r, 10)
    assert r.block_ids == [0, 1, 2]
    assert kv.hold(r) == [0, 1, 2] and r.block_ids == []
    assert kv.num_held == 1 and kv.held(r.request_id) == [0, 1, 2]
    assert pool.num_free_blocks == 5
    assert kv.allocate_slots(r, 3) and r.block_ids == [3]  # a quarantine adds to what it holds
    assert kv.hold(r) == [0, 1, 2, 3]
    assert kv.release(r.request_id) and not kv.release(r.request_id)
    assert kv.num_held == 0 and pool.num_free_blocks == 8
    assert pool.allocate(8) == [0, 1, 2, 3, 4, 5, 6, 7]  # all back, in the pool's order
    pool.check_invariants()


class Recorder:
    def __init__(self) -> None:
        self.computed: list[str] = []
        self.finished: list[tuple[str, list[int], int]] = []

    def on_blocks_computed(self, request) -> None:
        self.computed.append(request.request_id)

    def on_prefill_finished(self, request, block_ids, first_token_id) -> None:
        self.finished.append((request.request_id, block_ids, first_token_id))


def test_the_prefill_role_holds_a_request_at_its_first_token_and_tells_the_handoff(clock) -> None:
    s = make_scheduler(clock, num_blocks=16, block_size=4, budget=8)
    r = make_request("p", 10, clock)
    s.add_request(r)
    handoff = Recorder()
    role = role_for("prefill", handoff)
    assert isinstance(role, PrefillRole) and type(role_for("decode")) is Role
    out = fake_step(s)  # 8 of 10 prompt tokens
    role.after_step(out.scheduled)
    out = fake_step(s, token=42)  # the last 2: sampled
    role.after_step(out.scheduled)
    assert handoff.computed == ["p", "p"]
    role.after_token(r, 42, s, s.kv)
    assert handoff.finished == [("p", [0, 1, 2], 42)]
    assert r.is_finished and "p" not in s.requests and s.kv.num_held == 1
    s.check_invariants()
    assert s.kv.release(r.request_id)
    assert s.check_invariants().num_in_use == 0
