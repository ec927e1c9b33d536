"""The admission wait forecast (router/wait_forecast.py) and honest admission under a burst
(router/admission.py's revise): scripted clock, no network."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core.step_model import StepShape
from router.admission import AdmissionConfig, AdmissionQueue, Refused
from router.wait_forecast import Queued, WaitForecast
from tests.conftest import FakeClock


def calibrate(f: WaitForecast, clock: FakeClock, first_s: float, token_s: float, n: int = 5) -> None:
    f.admitted("cal", 10, n)
    clock.advance(first_s)
    f.progress("cal", 1)
    for i in range(2, n + 1):
        clock.advance(token_s)
        f.progress("cal", i)
    f.finished("cal")


def test_nothing_is_forecast_before_a_request_streamed_two_tokens(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    assert f.admission_times([Queued("q", 10, 5)], 0, 100, 10) is None
    f.admitted("a", 10, 5)
    clock.advance(1.0)
    f.progress("a", 1)
    f.finished("a")  # one token: no time per token to learn
    assert not f.calibrated and f.admission_times([], 0, 100, 10) is None


def test_calibration_learns_first_token_time_per_token_and_output_fraction(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    calibrate(f, clock, first_s=0.5, token_s=0.1, n=5)
    assert f.calibrated and f.output_fraction == 1.0
    assert f.first_token_s(0) == pytest.approx(0.5) and f.token_s(1) == pytest.approx(0.1)
    f.admitted("short", 10, 10)  # stops after 5 of its 10 tokens (EOS)
    clock.advance(0.5)
    f.progress("short", 1)
    clock.advance(0.4)
    f.progress("short", 5)  # four tokens in one response: 0.1 s each
    f.finished("short")
    assert f.token_s(1) == pytest.approx(0.1)
    assert f.output_fraction == pytest.approx((1.0 + 0.5) / 2)  # the mean of its two samples


def test_the_output_fraction_is_the_mean_of_few_samples_then_a_moving_average(clock: FakeClock) -> None:
    """Chats charged the prior 256 tokens and stopping after a few: the fraction is what they
    generated, not the prior's 1 still weighing a third after five samples."""
    f = WaitForecast(clock)
    for i, n in enumerate((1, 8, 10, 30, 54)):
        f.admitted(f"r{i}", 300, 256)
        for k in range(1, n + 1):
            clock.advance(0.05)
            f.progress(f"r{i}", k)
        f.finished(f"r{i}")
    assert f.output_fraction == pytest.approx((1 + 8 + 10 + 30 + 54) / 5 / 256)
    before = f.output_fraction
    f.admitted("r5", 300, 256)
    for k in range(1, 257):
        clock.advance(0.05)
        f.progress("r5", k)
    f.finished("r5")  # the sixth: a moving average, weight 0.2
    assert f.output_fraction == pytest.approx(before + 0.2 * (1.0 - before))


def test_times_are_fitted_against_load_and_extrapolated_to_a_burst(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    for n in (1, 2, 4, 8):  # n requests decode together: 2 ms + 1 ms per request, per token
        for i in range(n):
            f.admitted(f"r{n}-{i}", 10, 3)
        clock.advance(0.2)
        for i in range(n):  # first tokens: 0.2 s after admission, whatever the queue ahead
            f.progress(f"r{n}-{i}", 1)
        for k in (2, 3):
            clock.advance(0.002 + 0.001 * n)
            for i in range(n):
                f.progress(f"r{n}-{i}", k)
        for i in range(n):
            f.finished(f"r{n}-{i}")
    assert f.token_s(57) == pytest.approx(0.002 + 0.001 * 57, rel=0.02)
    assert f.first_token_s(30) == pytest.approx(0.2)  # no slope seen: the mean


def test_running_requests_finish_by_their_remaining_tokens(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    calibrate(f, clock, first_s=1.0, token_s=0.1)
    f.admitted("new", 10, 11)
    f.admitted("streaming", 10, 11)
    clock.advance(1.0)
    f.progress("streaming", 1)
    clock.advance(0.3)
    f.progress("streaming", 4)
    now = clock()
    assert f.finish_at(f.running["streaming"], now) == pytest.approx(now + 7 * 0.1)
    clock.advance(3.0)  # later than its first token was due: from now, not in the past
    assert f.finish_at(f.running["new"], clock()) == pytest.approx(clock() + 10 * 0.1)


def test_the_replay_admits_the_queue_in_order_as_tokens_come_back(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    calibrate(f, clock, first_s=1.0, token_s=0.1)  # a request of 11 tokens takes 2 s
    for rid in ("r1", "r2"):
        f.admitted(rid, 50, 11)
    clock.advance(1.0)
    for rid in ("r1", "r2"):
        f.progress(rid, 1)  # they stream: one more second each
    now = clock()
    queue = [Queued("a", 50, 11), Queued("big", 100, 11), Queued("small", 10, 11), Queued("c", 50, 11)]
    times = f.admission_times(queue, 0, 100, 10)
    assert times == pytest.approx({"a": now + 1.0, "big": now + 3.0, "small": now + 5.0, "c": now + 5.0})
    # a request that cannot be admitted by its limit takes nothing: the ones behind move up
    queue[1] = Queued("big", 100, 11, admit_by=now + 2.0)
    times = f.admission_times(queue, 0, 100, 10)
    assert times["big"] > now + 2.0
    assert times == pytest.approx({"a": now + 1.0, "big": now + 3.0, "small": now + 1.0, "c": now + 3.0})
    assert f.admission_times([Queued("x", 10, 11)], 0, 100, 0)["x"] == pytest.approx(now + 1.0)  # a slot frees


@dataclass
class Live:
    """A request the scripted cluster runs: first token after `first_s`, then one per `token_s`."""

    rid: str
    started: float
    n: int = 0


class Burst:
    """A token budget of 100, requests of cost 50 with 10 output tokens, the queue's wait
    limit 10 s; the cluster is scripted (first token after 0.5 s, then one per `token_s`),
    the router's timer ticks every 0.1 s."""

    def __init__(self, clock: FakeClock, token_s: float = 0.1) -> None:
        self.clock, self.token_s = clock, token_s
        self.q = AdmissionQueue(AdmissionConfig(max_inflight_tokens=100, max_queue_wait_s=10.0,
                                                max_queued_per_priority=1000), clock)
        self.ratios: list[float] = []
        self.q.on_wait_estimate = self.ratios.append
        self.live: dict[str, Live] = {}
        self.arrived: dict[str, float] = {}
        self.refused: dict[str, tuple[str, float]] = {}
        """request -> (kind, seconds after arrival)."""
        self.admitted: set[str] = set()

    def offer(self, rid: str) -> None:
        self.arrived[rid] = self.clock()
        verdict = self.q.offer(rid, 0, 50, None, new_tokens=10)
        if isinstance(verdict, Refused):
            self.refused[rid] = (verdict.kind, 0.0)
        elif verdict:
            self.start(rid)

    def start(self, rid: str) -> None:
        self.admitted.add(rid)
        self.live[rid] = Live(rid, self.clock())

    def tick(self) -> None:
        self.clock.advance(0.1)
        now = self.clock()
        for r in list(self.live.values()):
            n = 0 if now - r.started < 0.5 else min(1 + int((now - r.started - 0.5) / self.token_s + 1e-9), 10)
            if n > r.n:
                r.n = n
                self.q.forecast.progress(r.rid, n)
            if r.n == 10:
                del self.live[r.rid]
                for rid in self.q.release(r.rid):
                    self.start(rid)
        for rid in self.q.expire():
            self.refused[rid] = ("timeout", now - self.arrived[rid])
        for rid, refusal in self.q.revise():
            self.refused[rid] = (refusal.kind, now - self.arrived[rid])
        # honest: nothing left queued is forecast past its limit
        for rid, at in self.q.queued_admission_times().items():
            assert at <= self.arrived[rid] + 10.0 + 1e-9, (rid, at - self.arrived[rid])


def test_a_burst_is_served_or_refused_at_arrival_and_the_estimates_hold(clock: FakeClock) -> None:
    b = Burst(clock)
    b.offer("warm")
    while b.live:  # one request measured: the forecast is calibrated
        b.tick()
    for i in range(40):
        b.offer(f"r{i}")
    while b.live or b.q.num_queued:
        b.tick()
    assert set(b.admitted) | set(b.refused) == {"warm", *(f"r{i}" for i in range(40))}
    assert {kind for kind, _ in b.refused.values()} == {"wait"}  # all at arrival, none timed out
    assert all(after == 0.0 for _, after in b.refused.values())
    # two at a time, 1.4 s each (first token 0.5 s, 9 more 0.1 s apart): 2 now, then 2 at
    # 1.4, 2.8, ... 9.8 s, within the 10 s limit
    assert len(b.admitted - {"warm"}) == 2 + 2 * 7
    assert len(b.ratios) == 14 and all(0.9 <= r <= 1.1 for r in b.ratios), b.ratios


def test_when_the_cluster_slows_queued_requests_are_refused_as_their_forecast_passes_the_limit(
        clock: FakeClock) -> None:
    b = Burst(clock)
    b.offer("warm")
    while b.live:
        b.tick()
    for i in range(16):  # what the forecast says fits in 10 s at 0.1 s per token
        b.offer(f"r{i}")
    assert not b.refused
    for _ in range(10):
        b.tick()
    b.token_s = 0.3  # the cluster slows to a third: tokens come 3x slower from now on
    while b.live or b.q.num_queued:
        b.tick()
    kinds = {rid: kind for rid, (kind, _) in b.refused.items()}
    assert kinds and set(kinds.values()) == {"revised"}  # none waited its limit out
    assert all(after < 10.0 for _, after in b.refused.values())
    assert len(b.admitted) + len(b.refused) == 17


def test_the_estimate_error_of_each_queued_request_admitted_is_exported(clock: FakeClock) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: "m")
    b = Burst(clock)
    b.q.on_wait_estimate = metrics.observe_wait_estimate
    b.offer("warm")
    while b.live:
        b.tick()
    for i in range(10):
        b.offer(f"r{i}")
    while b.live or b.q.num_queued:
        b.tick()
    text = generate_latest(metrics.registry).decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "splitserve:admission_wait_estimate_ratio"]
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    assert count == 8  # two admitted at once, eight queued then admitted
    assert buckets["0.9"] == 0 and buckets["1.1"] == 8  # each within 10 % of its estimate


def test_with_the_workers_step_model_a_burst_is_forecast_at_its_own_load(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    f.set_step_model(StepShape((0.0, 0.01, 0.0)), 1)  # a step takes 10 ms per request streaming
    calibrate(f, clock, first_s=0.5, token_s=0.02)  # alone, the router sees 20 ms a token: twice the model
    assert f.per_token_s(1, 0) == pytest.approx(0.02)
    assert f.per_token_s(57, 0) == pytest.approx(2 * 0.57)  # the model's shape, the router's scale
    f.set_step_model(StepShape((0.0, 0.01, 0.0)), 3)  # three decode workers share the requests
    assert f.per_token_s(57, 0) == pytest.approx(2 * 0.19)
    f.set_step_model(None, 3)  # no model reported: the router's own fit
    assert f.per_token_s(57, 0) == pytest.approx(0.02)


def test_the_scale_comes_from_requests_that_finished_before_the_model_and_ignores_one_slow(
        clock: FakeClock) -> None:
    f = WaitForecast(clock)
    for token_s in (0.02, 0.02, 0.02, 0.02, 0.5):  # alone; the last one was held up by something else
        calibrate(f, clock, first_s=0.1, token_s=token_s)
    assert f.per_token_s(1, 0) > 0.1  # no model yet: the router's own (mean) fit, pulled up by the slow one
    f.set_step_model(StepShape((0.0, 0.01, 0.0)), 1)  # the first model arrives after every request finished
    assert f.per_token_s(1, 0) == pytest.approx(0.02)  # scale 2, the median: the slow one does not count
    assert f.per_token_s(57, 0) == pytest.approx(2 * 0.57)
    f.set_step_model(StepShape((0.0, 0.005, 0.0)), 1)  # a faster model: the same samples, measured against it
    assert f.per_token_s(57, 0) == pytest.approx(4 * 0.285)


def test_a_model_that_says_a_step_takes_nothing_at_a_load_does_not_set_the_scale(clock: FakeClock) -> None:
    f = WaitForecast(clock)
    calibrate(f, clock, first_s=0.1, token_s=0.005)  # alone: 5 ms a token
    # a line fitted on steps of 2-4 requests: one request's step is 2 µs, two requests' 10 ms
    f.set_step_model(StepShape((-0.009998, 0.01, 0.0)), 1)
    assert f.model_scale is None  # 5 ms over 2 µs (2,500) is no scale: the router's own fit answers
    assert f.per_token_s(2, 0) == pytest.approx(0.005)
    f.set_step_model(StepShape((-0.05, 0.01, 0.0)), 1)  # under zero at one and two requests
    assert f.model_scale is None and f.per_token_s(2, 0) == pytest.approx(0.005)
    f.set_step_model(StepShape((-0.0099, 0.01, 0.0)), 1)  # 0.1 ms at one request: 50 times under what was seen
    assert f.model_scale is None and f.per_token_s(2, 0) == pytest.approx(0.005)
    calibrate(f, clock, first_s=0.1, token_s=0.02)
    f.set_step_model(StepShape((0.0, 0.01, 0.0)), 1)  # a model that describes one request: it scales
    assert f.model_scale == pytest.approx(1.25)  # the median of 5 ms and 20 ms over its 10 ms
    assert f.per_token_s(4, 0) == pytest.approx(1.25 * 0.04)


def test_a_queued_request_is_not_refused_for_a_model_that_goes_to_zero_at_its_load(clock: FakeClock) -> None:
    config = AdmissionConfig(max_inflight_tokens=1000, max_queued_per_priority=3, max_queue_wait_s=600.0)
    q = AdmissionQueue(config, clock)
    calibrate(q.forecast, clock, first_s=0.05, token_s=0.005)
    assert q.offer("a", 0, 410, None, new_tokens=400) is True
    assert q.offer("b", 0, 410, None, new_tokens=400) is True
    assert q.offer("c", 0, 410, None, new_tokens=400) is False  # queued behind them
    q.forecast.set_step_model(StepShape((-0.009998, 0.01, 0.0)), 1)
    assert q.revise() == []  # ~2 s of decode ahead of it, not thousands
    assert 0 < q.queued_admission_times()["c"] - clock() < 10
