"""A worker's landing area for blocks fetched from a KV store: shared memory the store
writes into through kvfabric, copied into the engine's pool on its thread when the request
that wanted them is added.

    KVTier.fetch: `take(n)` slots -> the tier's receiver reserves them -> the store pushes
    engine thread: `copy_into(pools, slots, block ids)`: each rank's heads of each staged
        block into the pool's blocks (a store's blocks are whole: `HeadMap` cuts them for a
        tensor-parallel worker) -> `give` the slots back

A fetch never holds pool blocks while it waits on the network: the engine allocates them
only when they are filled, in the call that adds the request. A device pool's landing
copies the staged rows in through kvstore/pinned_rows.py instead (one rank, whole blocks).
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from kvfabric import BlockRegion, FabricLayout, ShmSegment
from kvfabric.layout import HeadMap
from kvfabric.pools import WorkerPools


class Staging:
    def __init__(self, pools: WorkerPools, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a staging area holds at least one block, got {num_blocks}")
        worker = pools.layout
        self.layout: FabricLayout = dataclasses.replace(worker, num_kv_heads=worker.total_kv_heads,
                                                        model_kv_heads=0, shards=(0,))
        """The store's layout: whole blocks, every KV head."""
        self.capacity = num_blocks
        self.segment = ShmSegment.create(num_blocks * self.layout.block_bytes)
        self.region = BlockRegion(self.segment.data.reshape(num_blocks, self.layout.block_bytes))
        self.heads = HeadMap.between(self.layout, worker)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` slots, or None when fewer are free (the fetch is skipped: the worker computes)."""
        with self._lock:
            if n > len(self._free):
                return None
            return [self._free.pop() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        """Back, so that they are taken again in ascending order: adjacent slots are one copy."""
        with self._lock:
            self._free.extend(sorted(slots, reverse=True))

    def copy_into(self, pools: WorkerPools, slots: list[int], block_ids: list[int]) -> None:
        """Engine thread: staged blocks into the pool's blocks, each rank its heads."""
        if len(slots) != len(block_ids):
            raise ValueError(f"{len(slots)} staged blocks for {len(block_ids)} pool blocks")
        src = self.region.array[slots]
        for p in self.heads.pieces:
            region = pools.regions[p.dst_rank]
            if not isinstance(region, BlockRegion):
                raise TypeError("staged blocks land in host-memory pools only (CPU workers)")
            dst = region.array
            if self.heads.is_whole(p):
                dst[block_ids] = src
                continue
            blocks = dst[block_ids]  # a copy (the ids need not be adjacent): its heads filled, written back
            np.copyto(self.heads.destination(p, blocks), self.heads.source(p, src))
            dst[block_ids] = blocks

    def close(self) -> None:
        self.segment.close()
