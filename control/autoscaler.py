"""The autoscaler policy: pool sizes from a metrics snapshot (pure: no torch, no Ray, no I/O).

`decide(snapshot, state, now) -> Decision` is called once per tick, live by the
controller and offline by a simulator, with the same inputs: what the pools report
(`Snapshot`) and what the policy remembers (`AutoscaleState`, which it returns updated
inside the decision). Signals:
- prefill: estimated queue time = queued uncached prefill tokens / the pool's measured
  prefill tokens per second, against the TTFT budget (`ttft_slo_ms`), and requests
  waiting in the routers' admission queues;
- decode: KV pressure = (used + reserved blocks) / total blocks, measured ITL against
  the ITL budget (`itl_slo_ms`), and requests waiting in its engines for a batch slot.
No thrash: a signal must hold past its band for `up_delay_s` (or `down_delay_s`) before it
acts (hysteresis: scale-up and scale-down bands do not touch); one step per pool per action,
a scale-up sized to the measured deficit (`wanted`: the pool times how far its worst signal
is past its threshold, as Kubernetes' HPA sizes replicas) and a scale-down of one worker,
each at most `max_step`; `cooldown_s` between actions on a pool; nothing
while a pool has a worker starting or draining (its last action is still pending); pools
stay within [min, max]. With `prefill_min` 0 (mode auto: decode workers prefill short
prompts themselves) an idle prefill pool scales to zero and comes back on queued work.

Two more, each off unless configured:
- `pd_ratio` (a plan's prefill workers per decode worker, `splitserve plan`): when one pool
  grows, the other grows to keep the ratio; when one shrinks, the other shrinks to it too,
  unless its own signal wants it larger.
- `predictive`: each pool's demand (prefill: the prompt tokens arriving per second, served
  plus queue growth; decode: the KV blocks in use) is forecast a start-up ahead (the launches'
  measured time to serving, `started`; `startup_s` before the first) by a trend
  (control/forecast.py), and a pool short for that load launches its workers now, so they
  serve when the load arrives rather than a start-up after it did. It never shrinks a pool,
  and a pool does not shrink below what its forecast needs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from control.forecast import Trend, observe

Pool = Literal["prefill", "decode"]


@dataclass(frozen=True)
class AutoscaleConfig:
    prefill_min: int = 1
    prefill_max: int = 4
    decode_min: int = 1
    decode_max: int = 4
    ttft_slo_ms: float = 2000.0
    """TTFT budget: prefill grows when the estimated queue time passes `queue_up_fraction` of it."""
    itl_slo_ms: float = 100.0
    """ITL budget: decode grows when the measured ITL passes it."""
    queue_up_fraction: float = 0.5
    queue_down_fraction: float = 0.1
    """Prefill shrinks when the queue time stays under this fraction of the TTFT budget."""
    kv_up: float = 0.85
    """Decode grows when KV pressure passes this..."""
    kv_down: float = 0.4
    """...and shrinks when it stays under this (with ITL well under budget and nothing waiting)."""
    waiting_up_per_worker: float = 1.0
    """Decode also grows when its engines hold this many requests per serving worker without a
    batch slot (held past `up_delay_s`: a request between two steps is not a shortage)."""
    up_delay_s: float = 5.0
    """How long a scale-up signal must hold before acting (a spike shorter than this is ridden out)."""
    down_delay_s: float = 30.0
    cooldown_s: float = 15.0
    """Least time between two actions on one pool."""
    max_step: int = 8
    """Most workers added or removed in one action (a scale-up is sized to the deficit, a
    scale-down is one worker)."""
    pd_ratio: float | None = None
    """Prefill workers per decode worker kept as the pools scale (None: each on its own signals)."""
    predictive: bool = False
    """Also launch workers for the load forecast a start-up ahead (off by default; `serve --plan`
    turns it on where the plan found it ahead on its trace)."""
    startup_s: float = 30.0
    """How long a launched worker takes to serve until one has been measured (`started`)."""
    forecast_alpha: float = 0.3
    forecast_beta: float = 0.1
    prefill_target_utilization: float = 0.8
    """Predictive prefill sizes the pool for its forecast at this share of a worker's measured
    throughput (what one worker prefilled per second while it had a queue)."""

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"{pool}_min"), getattr(self, f"{pool}_max")
            if not 0 <= lo <= hi:
                raise ValueError(f"{pool}: need 0 <= min <= max, got min {lo}, max {hi}")
        if self.decode_min < 1:
            raise ValueError("decode_min must be at least 1: decode workers serve every request")
        if not 0 <= self.queue_down_fraction < self.queue_up_fraction:
            raise ValueError("need 0 <= queue_down_fraction < queue_up_fraction (a hysteresis band)")
        if not 0 <= self.kv_down < self.kv_up <= 1:
            raise ValueError("need 0 <= kv_down < kv_up <= 1 (a hysteresis band)")
        if min(self.ttft_slo_ms, self.itl_slo_ms) <= 0 or self.max_step < 1:
            raise ValueError("ttft_slo_ms and itl_slo_ms must be positive and max_step >= 1")
        if self.waiting_up_per_worker <= 0:
            raise ValueError("waiting_up_per_worker must be positive")
        if min(self.up_delay_s, self.down_delay_s, self.cooldown_s) < 0:
            raise ValueError("up_delay_s, down_delay_s and cooldown_s must be >= 0")
        if self.pd_ratio is not None and not self.pd_ratio > 0:
            raise ValueError(f"pd_ratio must be positive (prefill workers per decode worker), got {self.pd_ratio}")
        if not (0 < self.forecast_alpha <= 1 and 0 < self.forecast_beta <= 1 and self.startup_s >= 0
                and 0 < self.prefill_target_utilization <= 1):
            raise ValueError("need 0 < forecast_alpha, forecast_beta, prefill_target_utilization <= 1 and "
                             "startup_s >= 0")


@dataclass(frozen=True)
class PoolMetrics:
    """One pool, summed over its workers (heartbeats) and the routers (stats)."""

    num_serving: int
    num_starting: int = 0
    """Added and not serving yet: they count toward the pool's size."""
    num_draining: int = 0
    """Being removed: they do not count. Starting or draining, the last action is still pending."""
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    """Measured over the last window; 0 when nothing was prefilled (no estimate)."""
    num_used_blocks: int = 0
    """KV blocks in use plus reserved for arriving KV."""
    num_total_blocks: int = 0
    itl_ms: float | None = None
    """Measured inter-token latency (p50 over the window); None without decode traffic."""
    num_waiting: int = 0
    """Requests the pool's engines hold that have no batch slot yet (summed over the workers)."""
    num_running: int = 0
    """Requests the pool's engines hold with a batch slot (summed over the workers)."""
    admitted_fraction: float = 0.0
    """Decode: the tokens a router has admitted over its budget (the highest router's). The
    budget is the decode pool's KV as admission counts it: requests still queued for prefill
    hold their share before any of it is a decode block."""

    @property
    def block_pressure(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def kv_pressure(self) -> float:
        """The higher of the blocks in use and the admitted share of the budget."""
        return max(self.block_pressure, self.admitted_fraction)

    @property
    def queue_ms(self) -> float:
        """Prefill: the queued tokens at the measured rate (0 with no rate or no queue)."""
        return self.queued_prefill_tokens / self.prefill_tokens_per_s * 1e3 if self.prefill_tokens_per_s > 0 else 0.0


@dataclass(frozen=True)
class Snapshot:
    prefill: PoolMetrics
    decode: PoolMetrics
    num_admission_queued: int = 0
    """Requests waiting in the routers' admission queues."""


@dataclass(frozen=True)
class AutoscaleState:
    """What the policy remembers between ticks (returned updated in each Decision)."""

    up_since: dict[str, float] = field(default_factory=dict)
    """Pool -> since when its scale-up signal has held."""
    down_since: dict[str, float] = field(default_factory=dict)
    last_action_at: dict[str, float] = field(default_factory=dict)
    demand: dict[str, Trend] = field(default_factory=dict)
    """Pool -> its demand's trend (predictive; not kept across a controller's restart)."""
    queued: tuple[float, int] | None = None
    """(when, prefill tokens queued) at the last tick: the queue's growth is demand not served."""
    worker_rate: float = 0.0
    """The most prompt tokens per second one prefill worker was seen serving with a queue."""
    startup_s: float | None = None
    """A launched worker's time to serving as measured (`started`), None before the first:
    how far ahead the forecast reads (`AutoscaleConfig.startup_s` until then)."""


STARTUP_WEIGHT = 0.5
"""Weight of the newest launch in the measured start-up time (`started`)."""


def started(state: AutoscaleState, seconds: float) -> AutoscaleState:
    """A launched worker served `seconds` after its launch: the measured start-up time moves
    toward it (the first launch sets it)."""
    if seconds < 0:
        return state
    known = state.startup_s
    measured = seconds if known is None else known + STARTUP_WEIGHT * (seconds - known)
    return dataclasses.replace(state, startup_s=measured)


@dataclass(frozen=True)
class Decision:
    prefill_target: int
    decode_target: int
    reason: str
    """What moved, and why; "hold: ..." when nothing did."""
    state: AutoscaleState

    def target(self, pool: Pool) -> int:
        return self.prefill_target if pool == "prefill" else self.decode_target


def prefill_signal(m: PoolMetrics, num_admission_queued: int, c: AutoscaleConfig) -> tuple[int, str]:
    """+1 (grow), -1 (shrink) or 0, and the figures behind it."""
    if m.num_serving == 0:  # scaled to zero: any queued work brings one back
        if m.queued_prefill_tokens > 0 or num_admission_queued > 0:
            return 1, f"{m.queued_prefill_tokens} prefill tokens queued with no prefill worker"
        return 0, "no prefill work"
    if m.queued_prefill_tokens and m.prefill_tokens_per_s <= 0:
        return 0, "prefill rate not measured yet"
    queue_ms = m.queue_ms
    figures = f"prefill queue {queue_ms:.0f} ms of a {c.ttft_slo_ms:.0f} ms TTFT budget"
    if queue_ms > c.queue_up_fraction * c.ttft_slo_ms or (num_admission_queued > 0 and queue_ms > 0):
        return 1, figures + (f", {num_admission_queued} waiting for admission" if num_admission_queued else "")
    if queue_ms < c.queue_down_fraction * c.ttft_slo_ms and num_admission_queued == 0:
        return -1, figures
    return 0, figures


def decode_signal(m: PoolMetrics, c: AutoscaleConfig) -> tuple[int, str]:
    """KV pressure and ITL, and requests waiting for a batch slot: a pool whose batches are
    full (`max_num_seqs`) before its KV is keeps ITL low and KV under `kv_up` while requests
    queue in its engines (seen in the simulator: 16 H100s, 2,304-token requests, 128 slots
    fill 69 % of a worker's KV, and decode never grew). KV pressure is the higher of the
    blocks used and the routers' admitted share of their budget (the decode pool's KV):
    with prefill behind, admission refused on a full budget while decode's blocks read 0.3
    (the same sinusoid: refusals 1,084 -> 135 one worker at a time, 396 -> 136 sized)."""
    pressure = m.kv_pressure
    figures = f"KV pressure {m.block_pressure:.2f}" + (f" (admitted {m.admitted_fraction:.2f} of the budget)"
                                                        if m.admitted_fraction > m.block_pressure else "")
    figures += f", ITL {m.itl_ms:.0f} ms of {c.itl_slo_ms:.0f}" if m.itl_ms else ""
    itl_over = m.itl_ms is not None and m.itl_ms > c.itl_slo_ms
    slots_short = m.num_serving > 0 and m.num_waiting >= c.waiting_up_per_worker * m.num_serving
    if slots_short:
        figures += f", {m.num_waiting} requests waiting for a batch slot"
    if pressure > c.kv_up or itl_over or slots_short:
        return 1, figures
    itl_low = m.itl_ms is None or m.itl_ms < 0.5 * c.itl_slo_ms
    if pressure < c.kv_down and itl_low and m.num_waiting == 0:
        return -1, figures
    return 0, figures


def wanted(pool: str, m: PoolMetrics, c: AutoscaleConfig) -> int:
    """The pool size its figures call for, read when its scale-up signal has held: the serving
    workers times how far the worst signal is past its threshold (the prefill queue time over
    its share of the TTFT budget; KV pressure over `kv_up`; ITL over its budget; requests
    with and without a batch slot over those with one), at least one more. One action then
    covers a measured deficit, where one worker per cooldown behind a 30 s start-up left
    pools short for minutes. In the simulator (16 H100s, a 20 rps +-80 % sinusoid of
    2,048+256-token requests; benchmarks/sim/sim_autoscale.py) SLO attainment went 0.71 -> 0.78
    at 8,024 GPU-s against 4,045 (fixed 6P:10D: 1.0, 14,433). The backlog overshoots
    (prefill reached 15 workers at the peak: it holds what piled up during the start-up);
    sizing on the queue's growth with the backlog capped at double measured as one at a
    time."""
    n = m.num_serving
    if n == 0:
        return 1
    if pool == "prefill":
        ratios = [m.queue_ms / (c.queue_up_fraction * c.ttft_slo_ms)]
    else:
        ratios = [m.kv_pressure / c.kv_up,
                  (m.itl_ms or 0.0) / c.itl_slo_ms,
                  (m.num_running + m.num_waiting) / m.num_running if m.num_running else 0.0]
    return max(n + 1, math.ceil(n * max(ratios) - 1e-9))


def decide(snapshot: Snapshot, state: AutoscaleState, now: float, config: AutoscaleConfig) -> Decision:
    """One tick: at most one bounded step per pool, each only once its signal has held long enough."""
    up, down, last = dict(state.up_since), dict(state.down_since), dict(state.last_action_at)
    targets: dict[str, int] = {}
    reasons: list[str] = []
    for pool, m, (signal, figures) in (
        ("prefill", snapshot.prefill, prefill_signal(snapshot.prefill, snapshot.num_admission_queued, config)),
        ("decode", snapshot.decode, decode_signal(snapshot.decode, config)),
    ):
        lo, hi = getattr(config, f"{pool}_min"), getattr(config, f"{pool}_max")
        current = m.num_serving + m.num_starting
        targets[pool] = min(max(current, lo), hi)  # clamps act at once
        if targets[pool] != current:
            reasons.append(f"{pool} {current} -> {targets[pool]}: outside [{lo}, {hi}]")
            last[pool] = now
            continue
        if signal > 0:
            up.setdefault(pool, now)
            down.pop(pool, None)
        elif signal < 0:
            down.setdefault(pool, now)
            up.pop(pool, None)
        else:
            up.pop(pool, None)
            down.pop(pool, None)
        need = wanted(pool, m, config) - current if signal > 0 else 1
        step = _step(pool, signal, m, up, down, last, now, config, current, lo, hi, need)
        if isinstance(step, str):
            reasons.append(f"{pool} holds at {current}: {step}; {figures}")
            continue
        targets[pool] = current + step
        last[pool] = now
        up.pop(pool, None)
        down.pop(pool, None)
        reasons.append(f"{pool} {current} -> {targets[pool]}: {figures}")
    state = dataclasses.replace(state, up_since=up, down_since=down, last_action_at=last)
    if config.predictive:
        state = _forecast(snapshot, state, now, config, targets, reasons)
    if config.pd_ratio is not None:
        _keep_ratio(snapshot, state, config, targets, reasons)
    for pool in ("prefill", "decode"):
        m = getattr(snapshot, pool)
        if targets[pool] != m.num_serving + m.num_starting:
            last[pool] = now
    moved = [r for r in reasons if "->" in r]
    reason = "; ".join(moved) if moved else "hold: " + "; ".join(reasons)
    return Decision(targets["prefill"], targets["decode"], reason, dataclasses.replace(state, last_action_at=last))


def _forecast(snapshot: Snapshot, state: AutoscaleState, now: float, c: AutoscaleConfig, targets: dict[str, int],
              reasons: list[str]) -> AutoscaleState:
    """Predictive: each pool's demand observed into its trend, and a pool short for the
    forecast a start-up ahead (the measured one, else `startup_s`) raised to it (a step of at
    most `max_step`; never lowered)."""
    p, d = snapshot.prefill, snapshot.decode
    arriving = p.prefill_tokens_per_s
    if state.queued is not None and now > state.queued[0]:
        arriving += max(0.0, (p.queued_prefill_tokens - state.queued[1]) / (now - state.queued[0]))
    worker_rate = state.worker_rate
    if p.num_serving and p.queued_prefill_tokens and p.prefill_tokens_per_s > 0:
        worker_rate = max(worker_rate, p.prefill_tokens_per_s / p.num_serving)
    demand = {"prefill": observe(state.demand.get("prefill"), arriving, now, c.forecast_alpha, c.forecast_beta),
              "decode": observe(state.demand.get("decode"), float(d.num_used_blocks), now, c.forecast_alpha,
                                c.forecast_beta)}
    horizon = state.startup_s if state.startup_s is not None else c.startup_s
    ahead = now + horizon
    need = {"prefill": math.ceil(demand["prefill"].at_time(ahead) / (worker_rate * c.prefill_target_utilization))
            if worker_rate > 0 else 0,
            "decode": math.ceil(demand["decode"].at_time(ahead) / (c.kv_up * d.num_total_blocks / d.num_serving))
            if d.num_serving and d.num_total_blocks else 0}
    for pool, m in (("prefill", p), ("decode", d)):
        current = m.num_serving + m.num_starting
        hi = getattr(c, f"{pool}_max")
        want = min(need[pool], hi, current + c.max_step)
        if targets[pool] < current and want > targets[pool]:  # no shrinking below the forecast's need
            reasons[:] = [r for r in reasons if not r.startswith(f"{pool} ")]
            reasons.append(f"{pool} holds at {current}: its forecast needs {min(need[pool], current)}")
            targets[pool] = current
            continue
        if want > max(targets[pool], current) and not m.num_draining:
            what = f"{demand[pool].at_time(ahead):.0f} prompt tokens/s" if pool == "prefill" else \
                f"{demand[pool].at_time(ahead):.0f} KV blocks"
            reasons[:] = [r for r in reasons if not r.startswith(f"{pool} ")]
            reasons.append(f"{pool} {current} -> {want}: forecast {what} in {horizon:.0f} s")
            targets[pool] = want
    return dataclasses.replace(state, demand=demand, queued=(now, p.queued_prefill_tokens), worker_rate=worker_rate)


def _keep_ratio(snapshot: Snapshot, state: AutoscaleState, c: AutoscaleConfig, targets: dict[str, int],
                reasons: list[str]) -> None:
    """`pd_ratio`: a pool that moved brings the other to the ratio, in the same direction (a
    pool shrinks to it only when its own signal does not want it larger, and neither moves
    while it has a worker starting or draining)."""
    assert c.pd_ratio is not None
    current = {pool: getattr(snapshot, pool).num_serving + getattr(snapshot, pool).num_starting
               for pool in ("prefill", "decode")}
    for pool, other in (("decode", "prefill"), ("prefill", "decode")):
        step = targets[pool] - current[pool]
        m = getattr(snapshot, other)
        if step == 0 or targets[other] != current[other] or m.num_starting or m.num_draining:
            continue
        at = targets[pool] * c.pd_ratio if other == "prefill" else targets[pool] / c.pd_ratio
        lo, hi = getattr(c, f"{other}_min"), getattr(c, f"{other}_max")
        want = min(max(round(at), lo, 1 if other == "decode" else 0), hi)
        if (step > 0 and want > current[other]) or (step < 0 and want < current[other]
                                                     and other not in state.up_since):
            targets[other] = want
            reasons.append(f"{other} {current[other]} -> {want}: keeps the P:D ratio {c.pd_ratio:g} with "
                           f"{pool} at {targets[pool]}")
            return


def _step(pool: str, signal: int, m: PoolMetrics, up: dict[str, float], down: dict[str, float],
          last: dict[str, float], now: float, c: AutoscaleConfig, current: int, lo: int, hi: int,
          need: int) -> int | str:
    """The step to take now (`need` workers, within `max_step` and the bounds), or why none is taken."""
    if signal == 0:
        return "within its band"
    if m.num_starting or m.num_draining:
        return f"{m.num_starting + m.num_draining} worker(s) still starting or draining"
    since = up.get(pool) if signal > 0 else down.get(pool)
    delay = c.up_delay_s if signal > 0 else c.down_delay_s
    assert since is not None
    if now - since < delay:
        return f"signal held {now - since:.0f} of {delay:.0f} s"
    if pool in last and now - last[pool] < c.cooldown_s:
        return f"cooling down ({now - last[pool]:.0f} of {c.cooldown_s:.0f} s)"
    if signal > 0 and current >= hi:
        return f"at its max {hi}"
    if signal < 0 and current <= lo:
        return f"at its min {lo}"
    step = min(max(need, 1), c.max_step)
    return min(step, hi - current) if signal > 0 else -min(step, current - lo)
