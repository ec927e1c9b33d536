"""The shared KV tier in the simulator: one store per node, as kvstore/ keeps them.

    a worker's step ends -> its pool's `stored` events -> `offer`: into its node's store (LRU
        touched last block first, the real store's order; beyond capacity the least recently
        used go)
    a prompt about to be prefilled on a worker -> `before_add`: the blocks its node's store
        holds past the pool's run (unless fetching them is no faster than computing) are
        held, cached and released in the pool (the engine's own KVCacheManager.hold_new /
        cache_held, as KVTier does), so the request finds them as a prefix hit; the fetch's
        time (`Hardware.store_s`) is added to its first step
    routing -> `stored`: each worker's node store's leading blocks, for the real policy, at the
        price a router gives a worker's measured fetches (the hardware's fetch against prefill)

A store's capacity is counted in blocks; its spill and its events' delay are not modelled.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from engine.types import BlockHash, RequestId
from router.policy import StoreHit, fetch_share
from sim.fleet_types import Hardware, Worker


class SimStores:
    def __init__(self, capacity_blocks: int, block_size: int, hardware: Hardware, prior: float) -> None:
        """`prior`: a fetch's cost as a share of computing where the hardware gives no time
        (RoutingConfig.store_fetch_cost)."""
        if capacity_blocks <= 0:
            raise ValueError(f"a store holds at least one block, got {capacity_blocks}")
        self.capacity, self.block_size, self.hw, self.prior = capacity_blocks, block_size, hardware, prior
        self.stores: dict[int, OrderedDict[BlockHash, None]] = {}
        self.num_fetched_blocks = 0
        self.num_evicted_blocks = 0
        self._ids = itertools.count()
        self._shares: dict[int, float] = {}
        """A hit's fetch cost by its blocks (the hardware's times are fixed)."""

    def offer(self, node: int, hashes: Sequence[BlockHash]) -> None:
        store = self.stores.setdefault(node, OrderedDict())
        for h in reversed(hashes):  # the chain's first block most recently used
            store[h] = None
            store.move_to_end(h)
        while len(store) > self.capacity:
            store.popitem(last=False)
            self.num_evicted_blocks += 1

    def held(self, node: int, hashes: Sequence[BlockHash]) -> int:
        store = self.stores.get(node)
        n = 0
        while store is not None and n < len(hashes) and hashes[n] in store:
            n += 1
        return n

    def stored(self, hashes: Sequence[BlockHash], workers: dict[str, Worker], ids: list[str]) -> dict[str, StoreHit]:
        """Each worker's own node's store (a fetch from another node's is not modelled), priced
        as a router prices a worker's measured fetches: the fetch's time against computing the
        same tokens (router/policy.py `fetch_share`)."""
        hits = {}
        for w in ids:
            n = self.held(workers[w].node, hashes)
            hits[w] = StoreHit(n, self.share(n), f"node-{workers[w].node}")
        return hits

    def share(self, num_blocks: int) -> float:
        """A hit of `num_blocks`: its fetch's cost as a share of computing them (at most 1)."""
        share = self._shares.get(num_blocks)
        if share is None:
            tokens = num_blocks * self.block_size  # computed, against only the next token with them cached
            compute_s = self.hw.step_s([(tokens + 1, 0)], 1) - self.hw.step_s([(1, tokens)], 1)
            share = self._shares[num_blocks] = fetch_share(self.hw.store_s(tokens), compute_s, self.prior)
        return share

    def before_add(self, w: Worker, request_id: str, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> int:
        """The store's blocks past the pool's run cached in `w`'s pool; returns how many."""
        limit = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        in_store = self.held(w.node, hashes[:limit])
        in_pool = len(w.engine.pool.lookup_run(hashes[:in_store]))
        n = in_store - in_pool
        if n <= 0 or self.share(self.held(w.node, hashes)) >= 1.0:  # as the router's hint: no fetch that saves nothing
            return 0
        fid = RequestId(f"sim-fetch-{next(self._ids)}")
        if w.engine.kv.hold_new(fid, n) is None:
            return 0
        w.engine.kv.cache_held(fid, list(hashes[in_pool:in_store]), hashes[in_pool - 1] if in_pool else None)
        self.offer(w.node, hashes[:in_store])  # a fetch touches what it read
        w.engine.extra_s[request_id] = w.engine.extra_s.get(request_id, 0.0) + \
            self.hw.store_s(n * self.block_size)
        self.num_fetched_blocks += n
        return n
