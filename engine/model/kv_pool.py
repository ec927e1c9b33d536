"""The paged KV pool: one device tensor, block-major.

Layout: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], so one
block (all layers' K and V for block_size tokens) is one contiguous region and runs of
adjacent block ids are one contiguous range: what kvfabric copies. The memory comes from
a `KVAllocator` (plain tensor here; shared memory or CUDA IPC-exportable memory later).

An FP8 pool (`KVLayout.dtype` e4m3) holds K / k_scale and V / v_scale rounded to e4m3, one
byte each, with one scale per layer for K and one for V (`KVPool.scales`); `write` divides
and rounds, `gather` multiplies back into the reader's dtype. Half a bfloat16 pool's bytes
per block: twice the tokens in the same memory, half the bytes every hand-off moves.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model.fp8 import E4M3, to_e4m3


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


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What a pool stores: the model's dtype ("auto"), or e4m3 ("fp8")."""
    return E4M3 if kv_cache_dtype == "fp8" else model_dtype


def _through_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 pool with this scale gives it back."""
    return (to_e4m3(x.float() / scale).float() * scale).to(x.dtype)


class KVAllocator(Protocol):
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        """Return a tensor of `shape`; contents may be uninitialised."""
        ...


class TensorAllocator:
    """Plain device memory, zero-filled. On CPU a private anonymous mapping, which the kernel
    fills with zeros as it is first written (a pool sized from memory costs only what its
    requests have used), aligned to and advised for transparent huge pages: a 2 MiB block is
    then one page, not 512, for the engine's TLB and for a NIXL (CMA) write into it, which
    pins every destination page (benchmarks/kv/kvfabric_bandwidth.py: 0.82-0.87 of memcpy into
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
        self, layout: KVLayout, num_blocks: int, device: str, allocator: KVAllocator | None = None,
        scales: torch.Tensor | None = None,
    ) -> None:
        """`scales`: an FP8 pool's [num_layers, 2] float32 K and V scales (None: all 1.0)."""
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        self.tensor = (allocator or TensorAllocator()).allocate(shape, layout.dtype, device)
        if tuple(self.tensor.shape) != shape or not self.tensor.is_contiguous():
            raise ValueError(f"allocator returned {tuple(self.tensor.shape)}, wanted contiguous {shape}")
        self.fp8 = layout.dtype == E4M3
        self.scales = None
        """FP8: [num_layers, 2] float32, what K and V were divided by before rounding to e4m3."""
        self.host_scales: list[tuple[float, float]] = []
        """The same as Python floats, read without a device sync (a CUDA graph captures none)."""
        if self.fp8:
            self.scales = (scales if scales is not None else torch.ones(layout.num_layers, 2)).float().to(device)
            if tuple(self.scales.shape) != (layout.num_layers, 2):
                raise ValueError(f"KV scales of shape {tuple(self.scales.shape)} for {layout.num_layers} layers")
            self.host_scales = [(float(k), float(v)) for k, v in self.scales.cpu().tolist()]

    def write(
        self, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        """Store K and V ([num_tokens, num_kv_heads, head_dim]) of one layer at token slots."""
        kv = torch.stack((k, v), dim=1)
        if self.scales is not None:
            kv = to_e4m3(kv.float() / self.scales[layer].view(1, 2, 1, 1))
        self.tensor[slot_blocks, layer, :, slot_offsets] = kv

    def rounded(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as this pool gives them back (FP8: through e4m3 and the scales)."""
        if self.scales is None:
            return k, v
        ks, vs = self.host_scales[layer]
        return _through_e4m3(k, ks), _through_e4m3(v, vs)

    def gather(self, layer: int, block_table: torch.Tensor,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for a padded block table [batch, max_blocks], in `dtype` (FP8:
        the reader's; None: the pool's).

        Returns two contiguous [batch, max_blocks * block_size, num_kv_heads, head_dim]
        tensors. One layer's K (or V) of one block is a contiguous run, so each is one
        `index_select` of whole runs (memcpy speed), not an element-wise gather.
        """
        b, nb = block_table.shape
        lay = self.layout
        flat = block_table.reshape(-1)
        shape = (b, nb * lay.block_size, lay.num_kv_heads, lay.head_dim)
        k = torch.index_select(self.tensor[:, layer, 0].reshape(self.num_blocks, -1), 0, flat).view(shape)
        v = torch.index_select(self.tensor[:, layer, 1].reshape(self.num_blocks, -1), 0, flat).view(shape)
        if self.scales is not None:
            ks, vs = self.host_scales[layer]
            out = dtype or torch.float32
            return (k.float() * ks).to(out), (v.float() * vs).to(out)
        return k, v
