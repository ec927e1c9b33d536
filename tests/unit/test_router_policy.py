from __future__ import annotations

import random

import pytest

from control.heartbeat import fetch_share
from router.policy import (
    RoutingConfig,
    StoreHit,
    WorkerLoad,
    choose_round_robin,
    choose_route,
    store_hit,
)

BS = 16


def d(wid: str, active: int = 0, free: int = 100, total: int = 100, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(wid, num_active=active, num_free_blocks=free, num_total_blocks=total, queued_prefill_tokens=queued)


def hit(num_blocks: int, fetch_cost: float = 0.1) -> StoreHit:
    return StoreHit(num_blocks, fetch_cost)


def route(prompt: int, overlap: dict[str, int], decodes, prefills, **cfg):  # type: ignore[no-untyped-def]
    blocks = -(-(prompt + 16) // BS)
    return choose_route(prompt, blocks, overlap, decodes, prefills, RoutingConfig(**cfg), BS, random.Random(0))


def test_cached_prefix_wins_among_equal_loads() -> None:
    r = route(640, {"d1": 30, "p1": 20}, [d("d0"), d("d1")], [d("p0"), d("p1")], mode="disaggregated")
    assert (r.decode_worker, r.prefill_worker) == ("d1", "p1")
    assert (r.num_decode_cached_blocks, r.num_prefill_cached_blocks) == (30, 20)


def test_affinity_yields_to_load() -> None:
    # d1 holds 40 blocks (640 tokens) but the credit is capped at 256 tokens of wait.
    cfg = dict(mode="disaggregated", affinity_bound_tokens=256, decode_weight_tokens=64, kv_pressure_weight_tokens=0)
    assert route(640, {"d1": 40}, [d("d0", active=3), d("d1", active=6)], [d("p0")], **cfg).decode_worker == "d1"
    assert route(640, {"d1": 40}, [d("d0", active=0), d("d1", active=5)], [d("p0")], **cfg).decode_worker == "d0"


def test_prefill_cost_counts_queued_tokens() -> None:
    r = route(512, {"p0": 32}, [d("d0")], [d("p0", queued=600), d("p1", queued=0)], mode="disaggregated")
    assert r.prefill_worker == "p1"  # p0: 0 + 600 > p1: 512 + 0
    r = route(512, {"p0": 32}, [d("d0")], [d("p0", queued=400), d("p1", queued=0)], mode="disaggregated")
    assert r.prefill_worker == "p0"


def test_local_prefill_when_uncached_part_is_short() -> None:
    r = route(100, {"d0": 5}, [d("d0")], [d("p0")], mode="auto", local_prefill_tokens=32)
    assert r.local_prefill and r.prefill_worker is None  # 100 - 80 = 20 < 32
    r = route(100, {}, [d("d0")], [d("p0")], mode="auto", local_prefill_tokens=32)
    assert r.prefill_worker == "p0"
    assert route(5000, {}, [d("d0", free=1000, total=1000)], [d("p0")], mode="colocated").local_prefill
    assert route(100, {}, [d("d0")], [], mode="disaggregated").local_prefill


def test_decode_without_room_is_skipped_and_none_when_all_full() -> None:
    r = route(320, {}, [d("d0", free=10), d("d1", free=30, active=9)], [d("p0")], mode="disaggregated")
    assert r.decode_worker == "d1"  # 21 blocks needed
    assert route(320, {"d0": 15}, [d("d0", free=10)], [d("p0")]).decode_worker == "d0"  # 6 new blocks
    assert route(320, {}, [d("d0", free=10)], [d("p0")]) is None


def test_ties_break_at_random() -> None:
    picks = {choose_route(64, 5, {}, [d("d0"), d("d1")], [d("p0")], RoutingConfig(), BS, random.Random(s)).decode_worker
             for s in range(20)}
    assert picks == {"d0", "d1"}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="mode"):
        RoutingConfig(mode="split")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        RoutingConfig(local_prefill_tokens=-1)


def test_round_robin_ignores_caches_and_skips_full_workers() -> None:
    cfg = RoutingConfig(policy="round_robin", mode="auto", local_prefill_tokens=32)
    ds, ps = [d("d0"), d("d1", free=2), d("d2")], [d("p0"), d("p1")]
    picks = [choose_round_robin(t, 100, 7, ds, ps, cfg) for t in range(4)]
    assert [(r.decode_worker, r.prefill_worker) for r in picks] == [
        ("d0", "p0"), ("d2", "p1"), ("d0", "p0"), ("d2", "p1")]
    assert choose_round_robin(0, 10, 1, ds, ps, cfg).local_prefill
    assert choose_round_robin(0, 100, 200, ds, ps, cfg) is None


def test_a_pool_hit_beats_a_store_hit_which_beats_a_miss() -> None:
    """Prefill workers p0 (its pool holds 20 blocks), p1 (its host's store holds 32), p2 (nothing):
    at a fetch cost of 0.1 a block, p1's uncached cost is 512 - 32 * 16 * 0.9 = 51 tokens, p0's
    512 - 320 = 192, p2's 512. A store's blocks past a pool hit add at their discount."""
    prefills = [d("p0"), d("p1"), d("p2")]
    cfg = RoutingConfig(mode="disaggregated")
    pick = choose_route(512, 33, {"p0": 20}, [d("d0")], prefills, cfg, BS, random.Random(0), {"p1": hit(32)})
    assert pick.prefill_worker == "p1" and pick.num_prefill_cached_blocks == 0  # booked: its pool's hit only
    pick = choose_route(512, 33, {"p0": 20}, [d("d0")], prefills, cfg, BS, random.Random(0), {"p1": hit(12)})
    assert pick.prefill_worker == "p0"  # 512 - 12 * 16 * 0.9 = 339 > 192
    pick = choose_route(512, 33, {"p0": 20}, [d("d0")], prefills, cfg, BS, random.Random(0),
                        {"p0": hit(32), "p1": hit(30)})
    assert pick.prefill_worker == "p0"  # 512 - (20 + 12 * 0.9) * 16 = 19 < 512 - 30 * 16 * 0.9 = 80
    # another host's store, at 0.3 a block: p1's 32 there (512 - 32 * 16 * 0.7 = 154) beat p0's pool (192)
    pick = choose_route(512, 33, {"p0": 20}, [d("d0")], prefills, cfg, BS, random.Random(0), {"p1": hit(32, 0.3)})
    assert pick.prefill_worker == "p1"
    pick = choose_route(512, 33, {"p0": 20}, [d("d0")], prefills, cfg, BS, random.Random(0), {"p1": hit(24, 0.3)})
    assert pick.prefill_worker == "p0"  # 512 - 24 * 16 * 0.7 = 243 > 192
    free = RoutingConfig(mode="disaggregated", store_fetch_cost=1.0)  # a fetch as dear as computing: no credit
    assert choose_route(512, 33, {}, [d("d0")], [d("p0", queued=1), d("p1")], free, BS, random.Random(0),
                        {"p0": hit(32, 1.0)}).prefill_worker == "p1"


def test_a_store_hit_is_priced_by_the_workers_measured_fetch_against_its_prefill() -> None:
    """A fetch of n blocks took 2 ms + 0.1 ms a block; computing a token takes 0.05 ms (0.8 ms a
    block of 16): 32 blocks fetch in 5.2 ms against 25.6 ms computed, a share of 0.203125."""
    assert fetch_share(5.2e-3, 25.6e-3, 0.1) == pytest.approx(0.203125)
    assert fetch_share(0.0, 25.6e-3, 0.1) == 0.1 and fetch_share(5.2e-3, 0.0, 0.3) == 0.3  # unmeasured: the prior
    assert fetch_share(30e-3, 25.6e-3, 0.1) == 1.0  # slower than computing: saves nothing
    assert store_hit(32, [2e-3, 1e-4], 5e-5, BS, 0.1, "s").fetch_cost == pytest.approx(0.203125)
    assert store_hit(32, [], 5e-5, BS, 0.1, "s").fetch_cost == 0.1  # no fetch measured yet
    assert store_hit(32, [2e-3, 1e-4], 0.0, BS, 0.1, "s").fetch_cost == 0.1  # no prefill measured yet
    assert store_hit(0, [2e-3, 1e-4], 5e-5, BS, 0.1, "s").fetch_cost == 0.1  # nothing held: nothing to price
    # a small hit pays the fixed cost over few blocks: 2 blocks take 2.2 ms against 1.6 ms computed
    slow = store_hit(2, [2e-3, 1e-4], 5e-5, BS, 0.1, "s")
    assert slow.fetch_cost == 1.0 and slow.saved == 0.0
    # p0's store holds 32 blocks: at its measured share it is cheaper than p1 computing; at a
    # share of 1 (a tiny model whose prefill outruns the fetch) p0 earns no credit and p1's
    # shorter queue wins
    prefills = [d("p0", queued=100), d("p1")]
    cfg = RoutingConfig(mode="disaggregated")
    assert choose_route(512, 33, {}, [d("d0")], prefills, cfg, BS, random.Random(0),
                        {"p0": store_hit(32, [2e-3, 1e-4], 5e-5, BS, 0.1, "s")}).prefill_worker == "p0"
    assert choose_route(512, 33, {}, [d("d0")], prefills, cfg, BS, random.Random(0),
                        {"p0": store_hit(32, [2e-3, 1e-4], 1e-6, BS, 0.1, "s")}).prefill_worker == "p1"


def test_auto_mode_prefills_on_the_decode_worker_what_its_store_holds() -> None:
    """300 uncached tokens on d0 are past the 256 of local prefill; its host's store holding the
    prompt's 18 blocks leaves 300 - 18 * 16 * 0.9 = 41: d0 prefills it itself."""
    cfg = RoutingConfig(mode="auto", local_prefill_tokens=256)
    assert choose_route(300, 20, {}, [d("d0")], [d("p0")], cfg, BS, random.Random(0)).prefill_worker == "p0"
    assert choose_route(300, 20, {}, [d("d0")], [d("p0")], cfg, BS, random.Random(0), {"d0": hit(18)}).local_prefill
    with pytest.raises(ValueError, match="store_fetch_cost must be in"):
        RoutingConfig(store_fetch_cost=1.5)
