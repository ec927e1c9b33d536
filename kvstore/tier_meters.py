"""What a worker's KV tier (kvstore/tier.py) counts and times: its counters (metrics) and its
fetches' times (heartbeats: routers price its store hits by them)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from control.heartbeat import Probes, hit_share
from engine.core.fit import LinearFit

FETCH_DECAY = 0.95
"""Per fetch: about the last twenty count (a store's speed changes with its load and its spill)."""


@dataclass
class TierCounters:
    num_fetches: int = 0
    num_fetched_blocks: int = 0
    """Blocks that landed in the pool from the store."""
    num_far_fetched_blocks: int = 0
    """Of those, blocks fetched from another host's store (the router's hint), over tcp."""
    num_skipped_lookups: int = 0
    """Prompts the router said no store held: not looked up."""
    num_fetch_failures: int = 0
    """Fetches that fell back to computing (store down, evicted, refused, timed out)."""
    num_staging_full: int = 0
    """Fetches skipped: every staging slot was waiting for the engine."""
    num_fetches_priced_out: int = 0
    """Fetches skipped: the worker's newest measurements price them no faster than computing."""
    num_offered_blocks: int = 0
    num_offloaded_blocks: int = 0
    """Blocks pushed into the store."""
    num_offload_failures: int = 0
    num_offload_skipped: int = 0
    """Blocks not offered because the lane was behind (`max_offload_blocks` held already)."""


class FetchTimes:
    """How long this worker's fetches took, from the lookup to the blocks in staging, against
    their blocks (a + b·blocks seconds): from its host's store and, apart, from other hosts'.
    Heartbeats carry the lines to routers, which weigh a hit's fetch against computing its
    tokens (router/policy.py `fetch_share`). Each line is swapped whole (read from the
    heartbeat's thread)."""

    def __init__(self) -> None:
        self._fits = (LinearFit(FETCH_DECAY), LinearFit(FETCH_DECAY))
        self.lines: list[tuple[float, float] | None] = [None, None]
        """[its host's store, other hosts'] (None: no fetch landed from there yet)."""

    def observe(self, far: bool, num_blocks: int, seconds: float) -> None:
        fit = self._fits[far]
        fit.add(num_blocks, seconds)
        line = fit.line()
        if line is not None and all(math.isfinite(x) for x in line):  # a heartbeat carries no other
            self.lines[far] = (max(line[0], 0.0), line[1])  # the slope is never negative; the intercept may fit so


class FetchGate:
    """Whether a fetch a router hinted goes ahead: the router priced the hit with the times the
    worker's last heartbeat carried; the gate prices it again with the worker's newest (a fetch
    no faster than computing, `hit_share` 1, is skipped). Unmeasured it fetches, to measure,
    and a fetch priced out still goes once every `FETCH_PROBE_S`, as the router lets it."""

    def __init__(self, times: FetchTimes, token_s: Callable[[], float], block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`token_s`: the engine's seconds per computed prompt token now (0: not measured)."""
        self.times, self.token_s, self.block_size, self.clock = times, token_s, block_size, clock
        self._probes = Probes()
        """By store (its host's, other hosts'): when a fetch priced out is let through again."""

    def pays(self, far: bool, num_blocks: int) -> bool:
        share = hit_share(num_blocks, self.times.lines[far] or (), self.token_s(), self.block_size, prior=0.0)
        return share < 1.0 or self._probes.due(far, self.clock())
