"""The router's store hint to a worker with a KV tier (router/flow.py `_store_hint`): a store's
hit is priced by what the worker's heartbeat says it measured; a fetch no faster than
computing is not made (0 blocks: the worker does not look), except once every
`FETCH_PROBE_S`, so that a fresh measurement can price it back in."""
from __future__ import annotations

from control.heartbeat import FETCH_PROBE_S, TierSpeed
from engine.core.block_pool import KVEvent
from router.kv_index import KVIndex
from router.policy import RouteDecision
from tests.unit.helpers import heartbeat
from tests.unit.router_fakes import make_flow

HASHES = [bytes([i]) * 16 for i in range(1, 11)]
"""A prompt's 10 full blocks."""


def flow_with_store(speed: TierSpeed, now: list[float]):  # type: ignore[no-untyped-def]
    """A router whose decode worker d0 fetches from store s1, which holds the prompt's 10 blocks."""
    flow, _ = make_flow({"d0": lambda req: []}, mode="colocated")
    flow.clock = lambda: now[0]
    flow.stores = KVIndex(flow.clock)
    flow.stores.apply("s1", KVEvent(1, "stored", list(HASHES)))
    flow.members.update({"d0": heartbeat("d0", "decode", address="d0", model_id="m", block_size=16, vocab_size=1000,
                                         max_model_len=512, num_total_blocks=64, kv_store="s1", tier_speed=speed)})
    return flow


def hint(flow, pool: int = 0) -> int:  # type: ignore[no-untyped-def]
    return flow._store_hint(HASHES, RouteDecision("d0", None, pool, 0)).num_blocks


def test_a_fetch_the_worker_measured_faster_than_computing_is_hinted_every_time() -> None:
    """10 blocks fetch in 2 ms + 10 x 0.1 ms = 3 ms; computing them takes 160 x 0.05 ms = 8 ms."""
    now = [100.0]
    flow = flow_with_store(TierSpeed(5e-5, [2e-3, 1e-4], []), now)
    assert flow._stored(HASHES, ["d0"])["d0"].fetch_cost == 3e-3 / 8e-3
    assert [hint(flow) for _ in range(3)] == [10, 10, 10]
    unmeasured = flow_with_store(TierSpeed(), now)  # no fetch timed yet: the configured cost
    assert unmeasured._stored(HASHES, ["d0"])["d0"].fetch_cost == 0.1 and hint(unmeasured) == 10


def test_a_fetch_slower_than_computing_is_made_only_once_every_probe_period() -> None:
    """The same fetch against a prefill of 1 µs a token (0.16 ms for the 10 blocks)."""
    now = [100.0]
    flow = flow_with_store(TierSpeed(1e-6, [2e-3, 1e-4], []), now)
    hit = flow._stored(HASHES, ["d0"])["d0"]
    assert hit.fetch_cost == 1.0 and hit.saved == 0.0
    assert hint(flow) == 10  # the first: a probe
    assert hint(flow) == 0 and hint(flow, pool=4) == 0  # priced out until the period ends
    assert hint(flow, pool=10) == 10  # nothing past the pool's run to fetch: told as it is
    now[0] += FETCH_PROBE_S - 0.01
    assert hint(flow) == 0
    now[0] += 0.01
    assert hint(flow) == 10 and hint(flow) == 0  # the next probe
    # the worker's next heartbeat says its fetches got faster: hinted every time again
    flow.members.update({"d0": heartbeat("d0", "decode", address="d0", model_id="m", block_size=16, vocab_size=1000,
                                         max_model_len=512, num_total_blocks=64, kv_store="s1",
                                         tier_speed=TierSpeed(1e-6, [1e-5, 1e-6], []))})
    assert hint(flow) == 10 and hint(flow) == 10
