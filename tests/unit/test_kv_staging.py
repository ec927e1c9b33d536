"""A worker's staging area for fetched blocks: whole blocks (the store's layout) copied into
the pool's blocks, each tensor-parallel rank getting exactly its KV heads; slots come back
in ascending order so adjacent ones stay one copy."""
from __future__ import annotations

import numpy as np

from kvfabric import BlockRegion, FabricLayout
from kvfabric.pools import WorkerPools
from kvstore.staging import Staging

HEADS, LAYERS, BLOCK, DIM = 4, 2, 4, 8


def pools(world: int, num_blocks: int = 16) -> WorkerPools:
    local = max(HEADS // world, 1)
    layout = FabricLayout("staging-test", "float32", LAYERS, BLOCK, local, DIM, 4, model_kv_heads=HEADS,
                          shards=tuple(r * HEADS // world for r in range(world)))
    return WorkerPools(layout, [BlockRegion(np.zeros((num_blocks, layout.block_bytes), np.uint8))
                                for _ in range(world)])


def test_staged_blocks_land_as_each_rank_holds_its_heads() -> None:
    for world in (1, 2, 4):
        p = pools(world)
        staging = Staging(p, 8)
        try:
            assert staging.layout.num_kv_heads == HEADS and staging.layout.world == 1
            slots = staging.take(3)
            assert slots == [0, 1, 2]
            rng = np.random.default_rng(world)
            whole = rng.integers(0, 256, (3, LAYERS * 2 * BLOCK, HEADS, DIM * 4), dtype=np.uint8)
            staging.region.array[slots] = whole.reshape(3, -1)
            staging.copy_into(p, slots, [9, 2, 5])  # pool blocks need not be adjacent
            for rank, region in enumerate(p.regions):
                first, n = p.layout.shards[rank], p.layout.num_kv_heads
                want = np.ascontiguousarray(whole[:, :, first:first + n]).reshape(3, -1)
                assert np.array_equal(region.array[[9, 2, 5]], want), (world, rank)
                assert not region.array[[0, 1, 3, 4, 6, 7, 8]].any()
            staging.give([2, 0, 1])
            assert staging.take(3) == [0, 1, 2] and staging.take(6) is None  # 5 left
        finally:
            staging.close()
