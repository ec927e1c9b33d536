"""The paged KV pool: one device tensor, block-major.

Layout: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], so one
block (all layers' K and V for block_size tokens) is one contiguous region and runs of
adjacent block ids are one contiguous range: what kvfabric copies. The memory comes from
a `KVAllocator` (plain tensor here; shared memory or CUDA IPC-exportable memory later).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.dtype.itemsize


class KVAllocator(Protocol):
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        """Return a tensor of `shape`; contents may be uninitialised."""
        ...


class TensorAllocator:
    """Plain device memory, zero-filled. On CPU a private anonymous mapping, which the kernel
    fills with zeros as it is first written (a pool sized from memory costs only what its
    requests have used), aligned to and advised for transparent huge pages: a 2 MiB block is
    then one page, not 512, for the engine's TLB and for a NIXL (CMA) write into it, which
    pins every destination page (benchmarks/kvfabric_bandwidth.py: 0.82-0.87 of memcpy into
    such a pool, 0.66-0.69 into shared memory, where this kernel gives no huge pages)."""

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        return host_pages(nbytes).view(dtype).view(shape)

    def close(self) -> None:
        """Nothing to release: the pool's tensor holds its mapping."""


HUGE_PAGE_BYTES = 2 << 20


def host_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of private, zero-filled host memory starting on a huge-page boundary, advised
    for transparent huge pages where the kernel offers them (uint8; the tensor keeps the
    mapping alive)."""
    buffer = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    skip = -flat.data_ptr() % HUGE_PAGE_BYTES
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE, skip, nbytes - nbytes % HUGE_PAGE_BYTES)
        except OSError:  # a kernel without transparent huge pages: small pages, as before
            pass
    return flat[skip:skip + nbytes]


class KVPool:
    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str, allocator: KVAllocator | None = None
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        self.tensor = (allocator or TensorAllocator()).allocate(shape, layout.dtype, device)
        if tuple(self.tensor.shape) != shape or not self.tensor.is_contiguous():
            raise ValueError(f"allocator returned {tuple(self.tensor.shape)}, wanted contiguous {shape}")

    def write(
        self, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        """Store K and V ([num_tokens, num_kv_heads, head_dim]) of one layer at token slots."""
        self.tensor[slot_blocks, layer, :, slot_offsets] = torch.stack((k, v), dim=1)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for a padded block table [batch, max_blocks].

        Returns two contiguous [batch, max_blocks * block_size, num_kv_heads, head_dim]
        tensors. One layer's K (or V) of one block is a contiguous run, so each is one
        `index_select` of whole runs (memcpy speed), not an element-wise gather.
        """
        b, nb = block_table.shape
        lay = self.layout
        flat = block_table.reshape(-1)
        shape = (b, nb * lay.block_size, lay.num_kv_heads, lay.head_dim)
        k = torch.index_select(self.tensor[:, layer, 0].reshape(self.num_blocks, -1), 0, flat)
        v = torch.index_select(self.tensor[:, layer, 1].reshape(self.num_blocks, -1), 0, flat)
        return k.view(shape), v.view(shape)
