"""A worker's KV tier prices a hinted fetch again with its newest measurements (kvstore/tier_meters.py
`FetchGate`): a fetch no faster than computing is skipped, except one probe every `FETCH_PROBE_S`
(the tiny model's 8 ms fetch against 0.05 ms of compute per block made the tier slow its TTFT)."""
from __future__ import annotations

from control.heartbeat import FETCH_PROBE_S
from kvstore.tier_meters import FetchGate, FetchTimes
from tests.conftest import FakeClock

BLOCK = 16


def measured(fixed_s: float, per_block_s: float) -> FetchTimes:
    times = FetchTimes()
    for n in (2, 4, 8, 16):
        times.observe(False, n, fixed_s + per_block_s * n)
    return times


def test_unmeasured_fetches_go_ahead_to_measure(clock: FakeClock) -> None:
    assert FetchGate(FetchTimes(), lambda: 1e-4, BLOCK, clock).pays(False, 4)
    assert FetchGate(measured(8e-3, 0.0), lambda: 0.0, BLOCK, clock).pays(False, 4)  # no prefill measured yet


def test_a_fetch_faster_than_computing_goes_ahead_every_time(clock: FakeClock) -> None:
    gate = FetchGate(measured(2e-3, 0.1e-3), lambda: 1e-4, BLOCK, clock)  # 10 blocks: 3 ms against 16 ms
    assert all(gate.pays(False, 10) for _ in range(5))


def test_a_fetch_priced_out_is_skipped_but_probed_once_every_probe_interval(clock: FakeClock) -> None:
    gate = FetchGate(measured(8e-3, 0.0), lambda: 3e-6, BLOCK, clock)  # 10 blocks: 8 ms against 0.48 ms
    assert gate.pays(False, 10)  # the first probe
    assert not gate.pays(False, 10) and not gate.pays(False, 100)
    assert gate.pays(False, 200)  # 200 blocks: 9.6 ms of compute, more than the fetch
    clock.advance(FETCH_PROBE_S - 0.01)
    assert not gate.pays(False, 10)
    clock.advance(0.02)
    assert gate.pays(False, 10) and not gate.pays(False, 10)
    assert gate.pays(True, 10)  # another host's store: unmeasured there, its own probe clock
