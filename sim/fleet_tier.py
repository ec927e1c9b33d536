"""The shared KV tier in the simulator: one store per node, as kvstore/ keeps them.

    a worker's step ends -> its pool's `stored` events -> `offer`: into its node's store (LRU
        touched last block first, the real store's order; beyond capacity the least recently
        used go)
    a prompt about to be prefilled on a worker -> `before_add`: the blocks its node's store
        holds past the pool's run (unless fetching them is no faster than computing) are
        borrowed, filled and published in the pool (the engine's connector: `lend_new`,
        `publish`, as KVTier does), so the request finds them as a prefix hit; the fetch's
        time (`Hardware.store_s`, and `disk_s` for its spilled blocks) is added to its first step
    routing -> `stored`: each worker's node store's leading blocks, for the real policy, at the
        price a router gives a worker's measured fetches (the hardware's fetch against prefill)

A store's capacity is counted in blocks, in memory and in its spill (an SSD, as kvstore/disk.py):
what memory evicts is spilled while the spill has room, and a fetch reads its spilled blocks
back (`Hardware.disk_s`) before the push. Its events' delay is not modelled.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from control.heartbeat import Probes, fetch_share
from engine.types import BlockHash
from router.policy import StoreHit, tells_fetch
from sim.fleet_types import Hardware, Worker


class SimStores:
    def __init__(self, capacity_blocks: int, block_size: int, hardware: Hardware, prior: float,
                 clock: Callable[[], float], disk_blocks: int = 0) -> None:
        """`prior`: a fetch's cost as a share of computing where the hardware gives no time
        (RoutingConfig.store_fetch_cost); `clock`: the simulation's; `disk_blocks`: each
        store's spill (0: none)."""
        if capacity_blocks <= 0 or disk_blocks < 0:
            raise ValueError(f"a store holds at least one block in memory and none or more on disk, got "
                             f"{capacity_blocks} and {disk_blocks}")
        self.capacity, self.block_size, self.hw, self.prior = capacity_blocks, block_size, hardware, prior
        self.disk_capacity = disk_blocks
        self.stores: dict[int, OrderedDict[BlockHash, None]] = {}
        """Node -> the blocks its store holds in memory, least recently used first."""
        self.disks: dict[int, OrderedDict[BlockHash, None]] = {}
        """Node -> those its memory evicted into the spill, least recently spilled first."""
        self.num_fetched_blocks = 0
        self.num_evicted_blocks = 0
        """Dropped from the store (from memory without a spill, else from the spill)."""
        self.num_spilled_blocks = 0
        self.num_unspilled_blocks = 0
        """Read back from the spill by a fetch."""
        self.clock = clock
        self._probes = Probes()
        """When a worker priced out of fetching is told of a hit again (as the router's are)."""
        self._ids = itertools.count()
        self._shares: dict[tuple[int, int], float] = {}
        """A hit's fetch cost by its blocks and how many of them are spilled (the hardware's
        times are fixed)."""

    def offer(self, node: int, hashes: Sequence[BlockHash]) -> None:
        store = self.stores.setdefault(node, OrderedDict())
        disk = self.disks.setdefault(node, OrderedDict())
        for h in reversed(hashes):  # the chain's first block most recently used
            disk.pop(h, None)  # back in memory (a fetch reads a spilled block back first)
            store[h] = None
            store.move_to_end(h)
        while len(store) > self.capacity:
            h, _ = store.popitem(last=False)
            if self.disk_capacity:
                disk[h] = None
                self.num_spilled_blocks += 1
            else:
                self.num_evicted_blocks += 1
        while len(disk) > self.disk_capacity:
            disk.popitem(last=False)
            self.num_evicted_blocks += 1

    def held(self, node: int, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """The leading blocks the node's store holds, and how many of those are spilled."""
        store, disk = self.stores.get(node), self.disks.get(node, {})
        n = spilled = 0
        for h in hashes if store is not None else ():
            if h not in store:
                if h not in disk:
                    break
                spilled += 1
            n += 1
        return n, spilled

    def stored(self, hashes: Sequence[BlockHash], workers: dict[str, Worker], ids: list[str]) -> dict[str, StoreHit]:
        """Each worker's own node's store (a fetch from another node's is not modelled), priced
        as a router prices a worker's measured fetches: the fetch's time against computing the
        same tokens (control/heartbeat.py `fetch_share`)."""
        hits = {}
        for w in ids:
            n, spilled = self.held(workers[w].node, hashes)
            hits[w] = StoreHit(n, self.share(n, spilled), f"node-{workers[w].node}")
        return hits

    def share(self, num_blocks: int, num_spilled: int = 0) -> float:
        """A hit of `num_blocks` (`num_spilled` of them in the spill): its fetch's cost as a
        share of computing them (at most 1)."""
        share = self._shares.get((num_blocks, num_spilled))
        if share is None:
            tokens = num_blocks * self.block_size  # computed, against only the next token with them cached
            compute_s = self.hw.step_s([(tokens + 1, 0)], 1) - self.hw.step_s([(1, tokens)], 1)
            share = self._shares[num_blocks, num_spilled] = fetch_share(self.fetch_s(num_blocks, num_spilled),
                                                                        compute_s, self.prior)
        return share

    def fetch_s(self, num_blocks: int, num_spilled: int) -> float:
        """A fetch's time: the spilled blocks read back from the SSD, then all pushed."""
        return self.hw.store_s(num_blocks * self.block_size) + self.hw.disk_s(num_spilled * self.block_size)

    def before_add(self, w: Worker, request_id: str, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> int:
        """The store's blocks past the pool's run cached in `w`'s pool; returns how many."""
        limit = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        in_store, spilled = self.held(w.node, hashes[:limit])
        in_pool = w.engine.connector.cached_run(hashes[:in_store])
        n = in_store - in_pool
        hit = StoreHit(in_store, self.share(in_store, spilled))
        if n <= 0 or not tells_fetch(hit, in_pool, lambda: self._probes.due(w.worker_id, self.clock())):
            return 0
        fid = f"sim-fetch-{next(self._ids)}"
        if w.engine.connector.lend_new(fid, n) is None:
            return 0
        w.engine.connector.publish(fid, list(hashes[in_pool:in_store]), hashes[in_pool - 1] if in_pool else None)
        disk = self.disks.get(w.node, {})
        read_back = sum(h in disk for h in hashes[in_pool:in_store])  # of those the fetch reads, the spilled
        self.offer(w.node, hashes[:in_store])  # a fetch touches what it read (and reads the spilled back)
        w.engine.extra_s[request_id] = w.engine.extra_s.get(request_id, 0.0) + self.fetch_s(n, read_back)
        self.num_fetched_blocks += n
        self.num_unspilled_blocks += read_back
        return n
