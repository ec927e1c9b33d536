"""What a restarted controller does with the saved record and the actors Ray still has by name
(cluster/controller_state.py), and what the autoscaler sees each tick (control/pool_gauge.py)."""
from __future__ import annotations

import time

from cluster.controller_state import autoscale_in, autoscale_out, next_ids, plan
from control.autoscaler import AutoscaleState
from control.heartbeat import Heartbeat
from control.pool_gauge import PoolGauge
from control.router_stats import RouterStats
from tests.unit.helpers import heartbeat


def record(role: str, state: str) -> dict[str, object]:
    return {"role": role, "state": state, "info": {"address": f"{role}:1"}}


def test_each_saved_or_named_worker_gets_one_step() -> None:
    members = {"prefill-0": record("prefill", "serving"), "decode-0": record("decode", "serving"),
               "decode-1": record("decode", "draining"), "decode-2": record("decode", "starting"),
               "decode-3": record("decode", "serving"), "decode-4": record("decode", "draining"),
               "prefill-1": record("prefill", "starting")}
    live = {"prefill-0", "decode-0", "decode-1", "decode-2", "decode-5"}
    steps = {s.worker_id: s.action for s in plan(members, live)}
    assert steps == {
        "prefill-0": "keep", "decode-0": "keep",
        "decode-1": "finish_drain",   # the drain the dead controller began
        "decode-2": "finish_launch",  # created, maybe not started: start() again
        "decode-3": "dead",           # died while the controller was down
        "decode-4": "drained",        # its drain ended (the actor is gone)
        "prefill-1": "launch_lost",   # saved before its actor was created
        "decode-5": "finish_launch",  # live, its record lost: start() says how it is
    }
    assert [s.worker_id for s in plan(members, live)] == sorted(steps)
    [found] = [s for s in plan(members, live) if s.worker_id == "decode-5"]
    assert (found.role, found.state, found.info) == ("decode", "unknown", {})


def test_with_no_record_every_named_worker_is_adopted_and_none_is_dead() -> None:
    steps = plan({}, {"prefill-0", "decode-3"})
    assert [(s.worker_id, s.role, s.action) for s in steps] == [("decode-3", "decode", "finish_launch"),
                                                                ("prefill-0", "prefill", "finish_launch")]


def test_new_ids_never_take_a_saved_or_live_name() -> None:
    assert next_ids({"prefill": 2, "decode": 3}, ["decode-7", "prefill-0", "router-1"]) == \
        {"prefill": 2, "decode": 8, "router": 2}
    assert next_ids({}, []) == {}


def test_autoscaler_times_survive_the_trip_through_wall_time() -> None:
    now = time.monotonic()
    state = AutoscaleState(up_since={"decode": now - 12.5}, down_since={}, last_action_at={"prefill": now - 3.0})
    back = autoscale_in(autoscale_out(state))
    assert back.down_since == {}
    assert abs(back.up_since["decode"] - (now - 12.5)) < 0.05
    assert abs(back.last_action_at["prefill"] - (now - 3.0)) < 0.05


def beat(worker_id: str, role: str, prompt: int, cached: int = 0, **kw: int) -> Heartbeat:
    return heartbeat(worker_id, role, num_prompt_tokens=prompt, num_cached_tokens=cached,  # type: ignore[arg-type]
                     **kw)


def test_the_gauge_counts_states_measures_the_prefill_rate_and_keeps_it_while_idle() -> None:
    t = [100.0]
    gauge = PoolGauge(lambda: t[0])
    members = [("prefill-0", "prefill", "serving"), ("prefill-1", "prefill", "starting"),
               ("decode-0", "decode", "serving"), ("decode-1", "decode", "draining")]
    beats = {"prefill-0": beat("prefill-0", "prefill", 1000, queued_prefill_tokens=300),
             "decode-0": beat("decode-0", "decode", 0, num_total_blocks=100, num_free_blocks=60,
                              num_cached_blocks=10)}
    routers = {"router-0": RouterStats(router_id="router-0", address="a:1", itl_p50_ms=20.0, num_queued=2,
                                       inflight_tokens=450, budget_tokens=1000),
               "router-1": RouterStats(router_id="router-1", address="a:2", itl_p50_ms=35.0, num_queued=1,
                                       inflight_tokens=900, budget_tokens=1000)}
    first = gauge.snapshot(members, beats, routers)
    assert (first.prefill.num_serving, first.prefill.num_starting, first.prefill.queued_prefill_tokens) == (1, 1, 300)
    assert (first.decode.num_serving, first.decode.num_draining, first.decode.num_used_blocks,
            first.decode.num_total_blocks, first.decode.itl_ms) == (1, 1, 30, 100, 35.0)
    assert first.num_admission_queued == 3 and first.prefill.prefill_tokens_per_s == 0.0
    assert first.decode.admitted_fraction == 0.9  # the fuller router's
    t[0] = 102.0
    beats["prefill-0"] = beat("prefill-0", "prefill", 1800, cached=200)  # 600 uncached tokens in 2 s
    assert gauge.snapshot(members, beats, {}).prefill.prefill_tokens_per_s == 300.0
    t[0] = 104.0  # idle: the last rate is kept
    assert gauge.snapshot(members, beats, {}).prefill.prefill_tokens_per_s == 300.0


def test_a_prefill_pool_scaled_to_zero_sees_the_prompts_queued_on_decode_workers() -> None:
    snap = PoolGauge().snapshot([("decode-0", "decode", "serving")],
                                {"decode-0": beat("decode-0", "decode", 0, queued_prefill_tokens=77)}, {})
    assert (snap.prefill.num_serving, snap.prefill.queued_prefill_tokens) == (0, 77)
