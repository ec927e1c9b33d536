"""PoolGauge: what the autoscaler sees on one controller tick.

    controller's members (id, role, state) + workers' heartbeats (Redis) + routers' stats
        --> Snapshot (a PoolMetrics per pool, the routers' admission queue) --> autoscaler.decide

The prefill rate is measured between ticks from the heartbeats' cumulative uncached prompt
tokens, and kept while a pool is idle (the last rate it had work at).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


from control.autoscaler import PoolMetrics, Snapshot
from control.heartbeat import Heartbeat
from control.router_stats import RouterStats


class PoolGauge:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._rate: dict[str, tuple[float, int, float]] = {}
        """Per pool: (time, cumulative uncached prompt tokens, last measured tokens/s)."""

    def snapshot(self, members: list[tuple[str, str, str]], beats: dict[str, Heartbeat],
                 routers: dict[str, RouterStats]) -> Snapshot:
        """`members`: (worker id, role, state) of each worker the controller runs."""
        itls = [s.itl_p50_ms for s in routers.values() if s.itl_p50_ms is not None]
        admitted = [s.inflight_tokens / s.budget_tokens for s in routers.values() if s.budget_tokens > 0]
        decode = dataclasses.replace(self._pool("decode", members, beats), itl_ms=max(itls) if itls else None,
                                     admitted_fraction=max(admitted, default=0.0))
        return Snapshot(self._pool("prefill", members, beats), decode, sum(s.num_queued for s in routers.values()))

    def _pool(self, role: str, members: list[tuple[str, str, str]], beats: dict[str, Heartbeat]) -> PoolMetrics:
        mine = {worker_id: state for worker_id, r, state in members if r == role}
        own = [b for w, b in beats.items() if w in mine]
        # a prefill pool scaled to zero: the decode workers hold its queued prompts (local prefill)
        queued_from = own if mine or role == "decode" else [b for b in beats.values() if b.role == "decode"]
        prompt = sum(b.load.num_prompt_tokens - b.load.num_cached_tokens for b in own)
        now = self.clock()
        then, before, rate = self._rate.get(role, (now, prompt, 0.0))
        if now > then and prompt > before:  # measured while it had work
            rate = (prompt - before) / (now - then)
        self._rate[role] = (now, prompt, rate)
        states = list(mine.values())
        used = sum(b.load.num_total_blocks - b.load.num_free_blocks - b.load.num_cached_blocks for b in own)
        return PoolMetrics(states.count("serving"), states.count("starting"), states.count("draining"),
                           sum(b.load.queued_prefill_tokens for b in queued_from), rate, used,
                           sum(b.load.num_total_blocks for b in own), None,
                           sum(b.load.num_waiting for b in own), sum(b.load.num_running for b in own))


def removal_cost(worker_id: str, hb: Heartbeat | None) -> tuple[int, int, str]:
    """What removing this worker costs, the controller's order for a drain: its running
    requests, then its cached KV (then its id, for a stable choice)."""
    if hb is None:
        return (0, 0, worker_id)
    return (hb.load.num_running + hb.load.num_waiting, hb.load.num_cached_blocks, worker_id)
