"""The autoscaler ahead of the load (control/forecast.py, `predictive`) and at a plan's P:D
ratio (`pd_ratio`): pure functions on an injected clock, as the policy's other tests."""
from __future__ import annotations

import pytest

from control.autoscaler import AutoscaleConfig, AutoscaleState, PoolMetrics, Snapshot, decide, started
from control.forecast import Trend, observe

STARTUP_S = 30.0


def test_a_trend_follows_a_line_and_reads_it_ahead() -> None:
    t: Trend | None = None
    for s in range(60):
        t = observe(t, 5.0 + 2.0 * s, float(s), 0.3, 0.1)
    assert t is not None and t.trend == pytest.approx(2.0, rel=0.05)
    assert t.at_time(59 + 30) == pytest.approx(5 + 2 * 89, rel=0.03)
    assert observe(t, 1.0, 59.0, 0.3, 0.1) is t  # no time passed: nothing learned
    assert Trend(10.0, -1.0, 0.0).at_time(20.0) == 0.0  # a demand never forecasts below 0


class Fleet:
    """Pools whose launched workers serve STARTUP_S after the decision (as the controller's do)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.serving = {"prefill": prefill, "decode": decode}
        self.starting: dict[str, list[float]] = {"prefill": [], "decode": []}
        self.launched: dict[str, list[float]] = {"prefill": [], "decode": []}

    def tick(self, now: float) -> None:
        for pool, ready in self.starting.items():
            self.serving[pool] += sum(1 for t in ready if t <= now)
            self.starting[pool] = [t for t in ready if t > now]

    def apply(self, now: float, prefill: int, decode: int) -> None:
        for pool, target in (("prefill", prefill), ("decode", decode)):
            more = target - self.serving[pool] - len(self.starting[pool])
            self.starting[pool] += [now + STARTUP_S] * max(more, 0)
            self.launched[pool] += [now] * max(more, 0)
            if more < 0:
                self.serving[pool] += more


def decode_ramp(predictive: bool) -> tuple[list[float], float]:
    """KV blocks in use rising 10 a second over 2 decode workers of 1,000 blocks each: when the
    first decode worker was launched, and when pressure first passed kv_up (0.85)."""
    c = AutoscaleConfig(prefill_min=1, prefill_max=1, decode_min=1, decode_max=8, predictive=predictive,
                        startup_s=STARTUP_S)
    fleet, state, crossed = Fleet(1, 2), AutoscaleState(), None
    for s in range(400):
        now = float(s)
        fleet.tick(now)
        used = 10 * s
        total = 1000 * fleet.serving["decode"]
        if crossed is None and used > 0.85 * total:
            crossed = now
        snap = Snapshot(PoolMetrics(fleet.serving["prefill"]),
                        PoolMetrics(fleet.serving["decode"], num_starting=len(fleet.starting["decode"]),
                                    num_used_blocks=used, num_total_blocks=total))
        d = decide(snap, state, now, c)
        state = d.state
        fleet.apply(now, d.prefill_target, d.decode_target)
    return fleet.launched["decode"], crossed if crossed is not None else float("inf")


def test_a_decode_ramp_launches_ahead_and_its_worker_serves_before_the_pool_fills() -> None:
    reactive, reactive_crossed = decode_ramp(predictive=False)
    ahead, ahead_crossed = decode_ramp(predictive=True)
    assert reactive[0] >= reactive_crossed  # reacts once KV passed kv_up (the idle pool shrank to one first)
    # launched a start-up ahead of the crossing, it serves before it: KV never passes kv_up
    assert ahead[0] + STARTUP_S <= reactive_crossed and ahead_crossed == float("inf")


def test_a_prefill_ramp_launches_before_its_queue_builds() -> None:
    """Prompt tokens arriving 100/s more each second at two prefill workers that serve 5,000/s
    each (what the policy learned of them earlier, in its state): the queue builds once the
    arrivals pass 10,000/s."""
    def run(predictive: bool) -> tuple[float, float]:
        c = AutoscaleConfig(prefill_min=2, prefill_max=8, decode_min=1, decode_max=1, predictive=predictive,
                            startup_s=STARTUP_S, ttft_slo_ms=2000.0)
        fleet, state, queue, first_queue = Fleet(2, 1), AutoscaleState(worker_rate=5000.0), 0.0, None
        for s in range(200):
            now = float(s)
            fleet.tick(now)
            served = min(100.0 * s + queue, 5000.0 * fleet.serving["prefill"])
            queue += 100.0 * s - served
            if first_queue is None and queue > 0:
                first_queue = now
            snap = Snapshot(PoolMetrics(fleet.serving["prefill"], num_starting=len(fleet.starting["prefill"]),
                                        queued_prefill_tokens=int(queue), prefill_tokens_per_s=served),
                            PoolMetrics(1, num_used_blocks=10, num_total_blocks=1000))
            d = decide(snap, state, now, c)
            state = d.state
            fleet.apply(now, d.prefill_target, d.decode_target)
        launched = fleet.launched["prefill"]
        return (launched[0] if launched else float("inf")), (first_queue if first_queue is not None else float("inf"))

    reactive_launch, reactive_queue = run(False)
    ahead_launch, ahead_queue = run(True)
    assert reactive_queue == 101.0 and reactive_launch > reactive_queue  # reactive: the queue first
    assert ahead_launch + STARTUP_S <= reactive_queue and ahead_queue > reactive_queue


def test_the_pools_keep_a_plan_s_ratio_as_one_grows_or_shrinks() -> None:
    c = AutoscaleConfig(prefill_min=1, prefill_max=8, decode_min=1, decode_max=12, pd_ratio=0.5, up_delay_s=0,
                        down_delay_s=0, cooldown_s=0)
    within = {"queued_prefill_tokens": 5000, "prefill_tokens_per_s": 10_000.0}  # 500 ms queued: in its band
    full = Snapshot(PoolMetrics(2, **within), PoolMetrics(5, num_used_blocks=1000, num_total_blocks=1000))
    d = decide(full, AutoscaleState(), 0.0, c)
    assert (d.prefill_target, d.decode_target) == (3, 6) and "keeps the P:D ratio 0.5 with decode at 6" in d.reason
    idle = Snapshot(PoolMetrics(3, **within), PoolMetrics(6, num_used_blocks=10, num_total_blocks=1000))
    d = decide(idle, AutoscaleState(), 0.0, c)
    assert d.decode_target == 5 and d.prefill_target == 2  # decode one down, prefill with it (round(2.5))
    busy = Snapshot(PoolMetrics(3, queued_prefill_tokens=2_000_000, prefill_tokens_per_s=10_000),
                    PoolMetrics(6, num_used_blocks=10, num_total_blocks=1000))
    d = decide(busy, AutoscaleState(), 0.0, c)
    assert d.prefill_target > 3  # its own signal wants it larger: it grows, the ratio does not shrink it
    with pytest.raises(ValueError, match="pd_ratio must be positive"):
        AutoscaleConfig(pd_ratio=0.0)


def test_the_forecast_reads_as_far_ahead_as_launches_measured_take() -> None:
    assert started(AutoscaleState(), 80.0).startup_s == 80.0  # the first launch sets it
    assert started(started(AutoscaleState(), 80.0), 40.0).startup_s == 60.0  # then an average of the launches
    assert started(AutoscaleState(), -1.0).startup_s is None  # a clock step back says nothing
    # the decode ramp of 10 blocks a second over 2 x 1,000: with the 30 s configured the first
    # launch comes later than with 90 s measured, which reads three times as far ahead
    c = AutoscaleConfig(prefill_min=1, prefill_max=1, decode_min=1, decode_max=8, predictive=True, startup_s=30.0)

    def first_launch(state: AutoscaleState) -> float:
        for s in range(400):
            snap = Snapshot(PoolMetrics(1), PoolMetrics(2, num_used_blocks=10 * s, num_total_blocks=2000))
            d = decide(snap, state, float(s), c)
            state = d.state
            if d.decode_target > 2:
                return float(s)
        return float("inf")

    configured, measured = first_launch(AutoscaleState()), first_launch(started(AutoscaleState(), 90.0))
    assert measured + 50 <= configured < float("inf")
