"""The autoscaler policy on scripted metric sequences: exact targets and reasons, tick by tick."""
from __future__ import annotations

import pytest

from control.autoscaler import AutoscaleConfig, AutoscaleState, Decision, PoolMetrics, Snapshot, decide

CONFIG = AutoscaleConfig(prefill_min=1, prefill_max=4, decode_min=1, decode_max=3, ttft_slo_ms=1000,
                         itl_slo_ms=100, up_delay_s=5, down_delay_s=20, cooldown_s=10)
RATE = 1000.0
"""The prefill pool's measured tokens/s: 500 queued tokens = 500 ms of queue."""


def snap(prefill: int = 1, queued: int = 0, decode: int = 1, used: int = 10, total: int = 100,
         itl: float | None = 20.0, starting_p: int = 0, draining_d: int = 0, admission: int = 0,
         waiting: int = 0, running: int = 0, admitted: float = 0.0) -> Snapshot:
    return Snapshot(PoolMetrics(prefill, starting_p, 0, queued, RATE if prefill else 0.0),
                    PoolMetrics(decode, 0, draining_d, 0, 0.0, used, total, itl, waiting, running, admitted), admission)


def run(script: list[tuple[float, Snapshot]], config: AutoscaleConfig = CONFIG) -> list[Decision]:
    state, out = AutoscaleState(), []
    for now, s in script:
        d = decide(s, state, now, config)
        out.append(d)
        state = d.state
    return out


def test_a_ramp_grows_prefill_by_its_deficit_once_the_signal_held() -> None:
    """800 ms of queue on 1 worker against a 500 ms threshold wants ceil(1.6) = 2 workers;
    1,300 ms on 2 wants ceil(2 x 2.6) = 6, which the pool's max holds to 4."""
    script = [(0.0, snap(queued=600)), (4.0, snap(queued=700)), (5.0, snap(queued=800)),
              (6.0, snap(prefill=2, queued=900)), (10.0, snap(prefill=2, queued=1200)),
              (15.0, snap(prefill=2, queued=1300))]
    got = run(script)
    assert [d.prefill_target for d in got] == [1, 1, 2, 2, 2, 4]
    assert got[0].reason.startswith("hold: prefill holds at 1: signal held 0 of 5 s; prefill queue 600 ms")
    assert got[2].reason == "prefill 1 -> 2: prefill queue 800 ms of a 1000 ms TTFT budget"
    assert "prefill holds at 2: signal held 4 of 5 s" in got[4].reason  # the clock restarted after the action
    assert got[5].reason == "prefill 2 -> 4: prefill queue 1300 ms of a 1000 ms TTFT budget"


def test_a_scale_up_is_sized_by_the_worst_decode_signal_within_max_step_and_a_scale_down_is_one() -> None:
    config = AutoscaleConfig(decode_min=1, decode_max=32, itl_slo_ms=100, up_delay_s=5, down_delay_s=20,
                             cooldown_s=10, max_step=5)
    # 4 workers: 64 running and 48 waiting want ceil(4 x 112 / 64) = 7; KV 0.9 of 0.85 and ITL 50 want less
    got = run([(0.0, snap(decode=4, used=90, itl=50.0, waiting=48, running=64)),
               (5.0, snap(decode=4, used=90, itl=50.0, waiting=48, running=64))], config)
    assert [d.decode_target for d in got] == [4, 7]
    # ITL 300 ms of 100 on 4 wants 12: held to max_step 5 more
    got = run([(0.0, snap(decode=4, itl=300.0)), (5.0, snap(decode=4, itl=300.0))], config)
    assert [d.decode_target for d in got] == [4, 9]
    assert got[1].reason == "decode 4 -> 9: KV pressure 0.10, ITL 300 ms of 100"
    # just past a threshold: one more; idle long enough: one fewer, never sized
    got = run([(0.0, snap(decode=8, used=86)), (5.0, snap(decode=8, used=86))], config)
    assert [d.decode_target for d in got] == [8, 9]
    got = run([(0.0, snap(decode=8, used=5, itl=10.0)), (20.0, snap(decode=8, used=5, itl=10.0))], config)
    assert [d.decode_target for d in got] == [8, 7]


def test_a_spike_shorter_than_the_up_delay_is_ridden_out() -> None:
    got = run([(0.0, snap(queued=900)), (3.0, snap(queued=900)), (4.0, snap(queued=0)), (8.0, snap(queued=900))])
    assert [d.prefill_target for d in got] == [1, 1, 1, 1]
    assert "signal held 0 of 5 s" in got[3].reason  # the clock restarted when the spike ended


def test_a_sawtooth_inside_the_hysteresis_band_never_moves_a_pool() -> None:
    # queue between 150 and 450 ms (the band is 100..500 ms), KV between 0.45 and 0.8 (band 0.4..0.85)
    script = [(t, snap(prefill=2, queued=150 + (300 if t % 20 < 10 else 0), decode=2,
                       used=45 + (35 if t % 20 < 10 else 0)))
              for t in range(0, 200, 2)]
    got = run(script)
    assert {(d.prefill_target, d.decode_target) for d in got} == {(2, 2)}


def test_no_new_action_while_the_last_one_is_pending() -> None:
    got = run([(0.0, snap(queued=900)), (5.0, snap(queued=900)),
               (30.0, snap(queued=5000, starting_p=1)), (31.0, snap(prefill=2, queued=5000))])
    assert [d.prefill_target for d in got] == [1, 2, 2, 2]
    assert "1 worker(s) still starting or draining" in got[2].reason
    assert got[2].prefill_target == 2  # serving 1 + starting 1: the starting one counts toward the target


def test_decode_grows_on_kv_pressure_or_itl_and_shrinks_only_when_both_are_low() -> None:
    got = run([(0.0, snap(used=90)), (5.0, snap(used=90)), (40.0, snap(decode=2, used=30, total=200, itl=40.0)),
               (60.0, snap(decode=2, used=30, total=200, itl=40.0)),
               (61.0, snap(decode=1, draining_d=1, used=30, total=100, itl=150))])
    assert [d.decode_target for d in got] == [1, 2, 2, 1, 1]
    assert "decode holds at 1: 1 worker(s) still starting or draining" in got[4].reason  # a draining one does not count
    assert got[1].reason == "decode 1 -> 2: KV pressure 0.90, ITL 20 ms of 100"
    assert got[3].reason == "decode 2 -> 1: KV pressure 0.15, ITL 40 ms of 100"
    itl_only = run([(0.0, snap(itl=150)), (5.0, snap(itl=150))])
    assert itl_only[1].decode_target == 2


def test_pools_stay_within_min_and_max() -> None:
    config = AutoscaleConfig(prefill_min=1, prefill_max=2, decode_min=2, decode_max=3, ttft_slo_ms=1000,
                             up_delay_s=0, down_delay_s=0, cooldown_s=0)
    got = run([(0.0, snap(prefill=2, queued=9000, decode=1)), (1.0, snap(prefill=2, queued=9000, decode=2)),
               (2.0, snap(prefill=5, queued=0, decode=2))], config)
    assert (got[0].prefill_target, got[0].decode_target) == (2, 2)
    assert got[0].reason == "decode 1 -> 2: outside [2, 3]"
    assert "prefill holds at 2: at its max 2" in got[1].reason
    assert got[2].prefill_target == 2 and "prefill 5 -> 2: outside [1, 2]" in got[2].reason


def test_auto_mode_scales_an_idle_prefill_pool_to_zero_and_back_on_queued_work() -> None:
    config = AutoscaleConfig(prefill_min=0, prefill_max=2, ttft_slo_ms=1000, up_delay_s=0, down_delay_s=10,
                             cooldown_s=0)
    got = run([(0.0, snap(queued=0)), (10.0, snap(queued=0)), (11.0, snap(prefill=0, queued=0)),
               (12.0, snap(prefill=0, queued=300))], config)
    assert [d.prefill_target for d in got] == [1, 0, 0, 1]
    assert got[3].reason == "prefill 0 -> 1: 300 prefill tokens queued with no prefill worker"


def test_bad_bands_are_refused() -> None:
    with pytest.raises(ValueError, match="hysteresis band"):
        AutoscaleConfig(kv_down=0.9, kv_up=0.8)
    with pytest.raises(ValueError, match="decode workers serve every request"):
        AutoscaleConfig(decode_min=0)


def test_decode_grows_when_requests_wait_for_a_batch_slot_with_kv_and_itl_in_band() -> None:
    """Full batches before full KV: 2 workers, KV at 60 %, ITL 20 ms; 2 requests waiting (one
    per worker) held past the delay grow the pool; 1 waiting is not a shortage and does not;
    nothing shrinks while anything waits."""
    script = [(0.0, snap(decode=2, used=60, waiting=2)), (5.0, snap(decode=2, used=60, waiting=3)),
              (20.0, snap(decode=3, used=60, waiting=1)), (40.0, snap(decode=3, used=20, itl=10.0, waiting=1)),
              (70.0, snap(decode=3, used=20, itl=10.0, waiting=1))]
    got = run(script)
    assert [d.decode_target for d in got] == [2, 3, 3, 3, 3]
    assert got[1].reason == "decode 2 -> 3: KV pressure 0.60, ITL 20 ms of 100, 3 requests waiting for a batch slot"
    assert "decode holds at 3: within its band" in got[2].reason
    assert "decode holds at 3: within its band" in got[4].reason  # low KV and ITL, but a request waits


def test_waiting_up_per_worker_must_be_positive() -> None:
    with pytest.raises(ValueError, match="waiting_up_per_worker must be positive"):
        AutoscaleConfig(waiting_up_per_worker=0)


def test_decode_grows_when_admission_has_its_budget_out_while_decode_kv_reads_low() -> None:
    """The budget is decode KV as admission counts it: requests still queued for prefill hold
    it before any decode block. 2 workers at KV 0.30 with 0.95 of the budget admitted want
    ceil(2 x 0.95 / 0.85) = 3; 0.6 of the budget admitted, inside the band, keeps it from shrinking."""
    got = run([(0.0, snap(decode=2, used=30, admitted=0.95)), (5.0, snap(decode=2, used=30, admitted=0.95))])
    assert [d.decode_target for d in got] == [2, 3]
    assert got[1].reason.startswith("decode 2 -> 3: KV pressure 0.30 (admitted 0.95 of the budget), ITL 20 ms")
    got = run([(0.0, snap(decode=3, used=10, itl=10.0, admitted=0.6)), (20.0, snap(decode=3, used=10, itl=10.0,
                                                                                   admitted=0.6))])
    assert [d.decode_target for d in got] == [3, 3]  # 0.6 admitted is inside the band: no shrink
