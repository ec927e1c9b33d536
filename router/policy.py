"""Cache-aware P/D selection (torch-free, pure: loads and overlaps in, a decision out).

Lowest cost wins and ties are broken at random:
- decode worker D: `active * decode_weight_tokens + queued local prefill tokens
  + kv_pressure_weight_tokens * (used fraction after the request) - overlap credit`,
  where the overlap credit (cached prefix on D, in tokens) is capped at
  `affinity_bound_tokens`: a cache-hot worker stops winning once its load exceeds a
  cold one's by that bound. Workers without room for the request's KV are skipped.
- uncached part on D shorter than `local_prefill_tokens` (mode `auto`), or mode
  `colocated`: D prefills itself.
- prefill worker P: `max(prompt - P's cached prefix, 0) + queued prefill tokens`.

A worker's cached prefix counts its pool's leading blocks whole and, past them, those a KV
store holds (kvstore/) at `1 - fetch_cost` each: its own host's or another host's over the
network, whichever saves more: a pool hit is free, a store hit costs a copy, a remote one a
transfer, a miss a forward pass. A hit's `fetch_cost` is `hit_share` (control/heartbeat.py):
the fetch's time for its blocks as the worker measured its fetches, over the time the worker
takes to compute their tokens; until it has measured both, `store_fetch_cost` / `remote_store_fetch_cost`.
A fetch slower than computing saves nothing and is not made. What is booked on a worker
(its blocks) is its pool's hit only: blocks fetched from a store take room as computed ones do.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from control.heartbeat import hit_share
from engine.core.kv_cache_manager import held_blocks

Mode = Literal["disaggregated", "colocated", "auto"]
Policy = Literal["cache_aware", "round_robin"]


@dataclass(frozen=True)
class RoutingConfig:
    mode: Mode = "auto"
    """disaggregated: every prompt goes through a prefill worker; colocated: decode workers
    prefill everything themselves; auto: local prefill when the uncached part is short."""
    policy: Policy = "cache_aware"
    """round_robin ignores caches and load (the baseline benchmarks compare against)."""
    local_prefill_tokens: int = 256
    """auto mode: a decode worker prefills itself when fewer uncached prompt tokens remain."""
    affinity_bound_tokens: int = 1024
    """Most credit a cached prefix earns, in tokens of estimated wait."""
    decode_weight_tokens: int = 64
    """Estimated wait one running request adds on a decode worker, in prefill tokens."""
    kv_pressure_weight_tokens: int = 512
    """Cost of a full KV pool on a decode worker, in prefill tokens."""
    store_fetch_cost: float = 0.1
    """What fetching a block from the worker's host KV store costs, as a share of computing it
    (a memory-speed copy against a forward pass), until the worker has measured both."""
    remote_store_fetch_cost: float = 0.3
    """The same from another host's store (over the network)."""

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated", "auto"):
            raise ValueError(f"mode must be disaggregated, colocated or auto, got {self.mode!r}")
        if self.policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"policy must be cache_aware or round_robin, got {self.policy!r}")
        for name in ("local_prefill_tokens", "affinity_bound_tokens", "decode_weight_tokens",
                     "kv_pressure_weight_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("store_fetch_cost", "remote_store_fetch_cost"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    num_active: int = 0
    """Requests running or queued on the worker."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens sent to the worker and not yet prefilled."""
    num_free_blocks: int = 0
    """Blocks it can allocate (free + evictable), less what is promised to requests in flight."""
    num_total_blocks: int = 0


@dataclass(frozen=True)
class StoreHit:
    """The leading blocks of a prompt a KV store holds, and what fetching one costs a worker
    (a share of computing it)."""

    num_blocks: int
    fetch_cost: float
    store_id: str = ""

    @property
    def saved(self) -> float:
        return self.num_blocks * (1.0 - self.fetch_cost)


def store_hit(num_blocks: int, fetch_line: Sequence[float], token_s: float, block_size: int, prior: float,
              store_id: str) -> StoreHit:
    """A store's hit of `num_blocks` priced for one worker: its measured fetch line (a + b·blocks
    seconds; empty: none yet) against its seconds per computed token (0: not measured)."""
    return StoreHit(num_blocks, hit_share(num_blocks, fetch_line, token_s, block_size, prior), store_id)


def tells_fetch(hit: StoreHit, pool_blocks: int, probe_due: Callable[[], bool]) -> bool:
    """Whether the worker that prefills is told where a store's hit is (and so fetches the
    blocks past the `pool_blocks` its pool holds): when fetching them saves computing, or the
    pool holds them all; else only when `probe_due()` (`Probes`: once every FETCH_PROBE_S, a
    fresh measurement). The routers' rule (router/flow.py) and the simulator's."""
    return hit.saved > 0 or hit.num_blocks <= pool_blocks or probe_due()


@dataclass(frozen=True)
class RouteDecision:
    decode_worker: str
    prefill_worker: str | None
    """None: the decode worker prefills locally."""
    num_decode_cached_blocks: int
    num_prefill_cached_blocks: int

    @property
    def local_prefill(self) -> bool:
        return self.prefill_worker is None


def blocks_for(num_tokens: int, block_size: int, window: int = 0) -> int:
    """KV blocks a prompt of `num_tokens` needs once its first token is in (with a sliding
    `window` on every layer, those its first decode step reads)."""
    return held_blocks(num_tokens + 1, block_size, window)


def route(
    num_prompt_tokens: int,
    decodes: list[WorkerLoad],
    prefills: list[WorkerLoad],
    overlap: Callable[[list[str]], dict[str, int]],
    config: RoutingConfig,
    block_size: int,
    turn: int,
    rng: random.Random,
    window: int = 0,
    stored: Callable[[list[str]], dict[str, StoreHit]] | None = None,
) -> RouteDecision | None:
    """The router's choice for a prompt among these workers, by its configured policy (the
    flow and the simulator both decide here). `overlap(worker ids)`: the KV index's leading
    cached blocks for the prompt, read only when the policy looks at caches; `turn`: the
    round-robin counter; `window`: the model's sliding window on every layer (ModelFacts.kv_window);
    `stored(worker ids)`: the best KV store hit of each worker (None: no tier)."""
    blocks = blocks_for(num_prompt_tokens, block_size, window)
    if config.policy == "round_robin":
        return choose_round_robin(turn, num_prompt_tokens, blocks, decodes, prefills, config)
    ids = [w.worker_id for w in (*decodes, *prefills)]
    cached = overlap(ids)
    return choose_route(num_prompt_tokens, blocks, cached, decodes, prefills, config, block_size, rng,
                        stored(ids) if stored is not None else None)


def choose_route(
    num_prompt_tokens: int,
    num_new_blocks: int,
    overlap: dict[str, int],
    decodes: list[WorkerLoad],
    prefills: list[WorkerLoad],
    config: RoutingConfig,
    block_size: int,
    rng: random.Random,
    stored: dict[str, StoreHit] | None = None,
) -> RouteDecision | None:
    """Picks D (and P unless D prefills itself); None when no decode worker has room.

    `num_new_blocks`: blocks the request needs on D beyond a cached prefix of 0
    (prompt + output); `overlap`: leading cached blocks per worker id; `stored`: each worker's
    best KV store hit.
    """
    def cached_tokens(worker_id: str) -> float:
        """The prompt tokens a worker need not compute, a store's at their fetch's discount."""
        pool = overlap.get(worker_id, 0)
        hit = (stored or {}).get(worker_id)
        extra = max(hit.num_blocks - pool, 0) * (1.0 - hit.fetch_cost) if hit is not None else 0.0
        return min((pool + extra) * block_size, num_prompt_tokens)

    d = _pick_decode(num_prompt_tokens, num_new_blocks, overlap, decodes, config, rng, cached_tokens)
    if d is None:
        return None
    d_cached = overlap.get(d.worker_id, 0)
    uncached_on_d = max(num_prompt_tokens - cached_tokens(d.worker_id), 0)
    local = config.mode == "colocated" or not prefills or (
        config.mode == "auto" and uncached_on_d < config.local_prefill_tokens)
    if local:
        return RouteDecision(d.worker_id, None, d_cached, 0)
    p = _lowest(prefills, lambda w: max(num_prompt_tokens - cached_tokens(w.worker_id), 0) + w.queued_prefill_tokens,
                rng)
    return RouteDecision(d.worker_id, p.worker_id, d_cached, overlap.get(p.worker_id, 0))


def choose_round_robin(
    turn: int, num_prompt_tokens: int, num_new_blocks: int, decodes: list[WorkerLoad], prefills: list[WorkerLoad],
    config: RoutingConfig,
) -> RouteDecision | None:
    """The baseline: the `turn`-th worker of each pool in order (skipping decode workers without room)."""
    fits = [w for w in decodes if num_new_blocks <= w.num_free_blocks]
    if not fits:
        return None
    d = fits[turn % len(fits)]
    local = config.mode == "colocated" or not prefills or (
        config.mode == "auto" and num_prompt_tokens < config.local_prefill_tokens)
    p = None if local else prefills[turn % len(prefills)].worker_id
    return RouteDecision(d.worker_id, p, 0, 0)


def _pick_decode(
    num_prompt_tokens: int, num_new_blocks: int, overlap: dict[str, int], decodes: list[WorkerLoad],
    config: RoutingConfig, rng: random.Random, cached_tokens: Callable[[str], float],
) -> WorkerLoad | None:
    def needed(w: WorkerLoad) -> int:
        return max(num_new_blocks - overlap.get(w.worker_id, 0), 0)

    fits = [w for w in decodes if needed(w) <= w.num_free_blocks]
    if not fits:
        return None

    def cost(w: WorkerLoad) -> float:
        credit = min(cached_tokens(w.worker_id), config.affinity_bound_tokens)
        used_after = 1.0 - (w.num_free_blocks - needed(w)) / max(w.num_total_blocks, 1)
        return (w.num_active * config.decode_weight_tokens + w.queued_prefill_tokens
                + config.kv_pressure_weight_tokens * used_after - credit)

    return _lowest(fits, cost, rng)


def _lowest(workers: list[WorkerLoad], cost, rng: random.Random) -> WorkerLoad:  # type: ignore[no-untyped-def]
    costs = [(cost(w), w) for w in workers]
    best = min(c for c, _ in costs)
    return rng.choice([w for c, w in costs if c <= best + 1e-9])
