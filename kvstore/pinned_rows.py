"""A device pool's blocks through host memory, for the KV tier: its store and staging are host
memory and kvfabric's host transports move them, so a GPU worker's blocks cross PCIe on
their way out and in.

    offload lane   `download(block ids)`: the pool's blocks into pinned host rows (a copy
                   stream of its own, waited for), which the tier's sender pushes from; a
                   batch larger than the rows goes in turns (a push has read its rows when
                   it returns)
    engine thread  `upload(staged rows, block ids)`: host to device on the engine's stream,
                   so the step after the call that lands them reads them after the copy

The blocks an offload reads are held and full: no step writes them while the lane copies.
On CPU the same code runs on host tensors (`KVTier(through_host=True)`), so the CPU suite
takes the path a GPU worker takes, less the streams and the pinning.
"""
from __future__ import annotations

import numpy as np
import torch

from kvfabric import BlockRegion


class HostCopies:
    def __init__(self, pool: torch.Tensor, num_rows: int) -> None:
        """`pool`: the engine's KV pool tensor, blocks first; `num_rows`: host rows for offloads."""
        if num_rows <= 0:
            raise ValueError(f"at least one host row, got {num_rows}")
        n = pool.shape[0]
        self.blocks = pool.view(torch.uint8).reshape(n, -1)
        """The pool as bytes, [num_blocks, block_bytes]: a view, written through."""
        on_device = pool.device.type == "cuda"
        self.rows = torch.empty((num_rows, self.blocks.shape[1]), dtype=torch.uint8, pin_memory=on_device)
        self.region = BlockRegion(self.rows.numpy())
        """What the tier's sender pushes from."""
        self.stream = torch.cuda.Stream(pool.device) if on_device else None

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def download(self, block_ids: list[int]) -> None:
        """Offload lane: the pool's blocks into rows [0, len(block_ids)); returns once they are there."""
        if len(block_ids) > self.capacity:
            raise ValueError(f"{len(block_ids)} blocks for {self.capacity} host rows")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device)
        rows = self.rows[:len(block_ids)]
        if self.stream is None:
            torch.index_select(self.blocks, 0, idx, out=rows)
            return
        with torch.cuda.stream(self.stream):
            rows.copy_(self.blocks.index_select(0, idx), non_blocking=True)
        self.stream.synchronize()

    def upload(self, staged: np.ndarray, block_ids: list[int]) -> None:
        """Engine thread: staged host rows into the pool's blocks (the engine's stream)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device)
        self.blocks.index_copy_(0, idx, torch.from_numpy(staged).to(self.blocks.device))
