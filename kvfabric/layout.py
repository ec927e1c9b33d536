"""What both sides must agree on before a byte moves, and how block lists become copies.

`FabricLayout` describes one block of a pool (the engine's block-major layout:
[num_layers, 2, block_size, num_kv_heads, head_dim] of `dtype`) plus the model it
belongs to. Its `compat_hash` is exchanged in the handshake; on mismatch
`first_mismatch` names the field. `coalesce` turns parallel source/destination block
lists into runs that are contiguous on both sides, so each run is one copy or one frame.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import msgpack

LAYOUT_NAME = "block_major_v1"  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class FabricLayout:
    model_id: str
    dtype: str
    """torch dtype name without the prefix: "bfloat16", "float32", ..."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    layout: str = LAYOUT_NAME

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"FabricLayout.{f} must be positive, got {getattr(self, f)}")

    @classmethod
    def of_pool(cls, model_id: str, pool_layout: Any) -> FabricLayout:
        """From any pool layout with num_layers, block_size, num_kv_heads, head_dim and a
        torch-style dtype (the engine's KVLayout), without importing it."""
        dtype = pool_layout.dtype
        return cls(model_id, str(dtype).removeprefix("torch."), pool_layout.num_layers, pool_layout.block_size,
                   pool_layout.num_kv_heads, pool_layout.head_dim, dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def to_wire(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> FabricLayout:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown layout fields {unknown}")
        return cls(**d)  # type: ignore[arg-type]

    @property
    def compat_hash(self) -> str:
        blob = msgpack.packb(sorted(self.to_wire().items()))
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    def first_mismatch(self, other: FabricLayout) -> str | None:
        """Name of the first field that differs, or None when compatible."""
        for f in fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None


class Run(NamedTuple):
    """`num_blocks` blocks from `src_block` (sender) to `dst_block` (receiver); `index` is
    the position of the first one in the reservation's block list."""

    index: int
    src_block: int
    dst_block: int
    num_blocks: int


def coalesce(src_block_ids: list[int], dst_block_ids: list[int], first_index: int = 0) -> list[Run]:
    """Group parallel block lists into runs adjacent on both sides (order kept)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks")
    runs: list[Run] = []
    start = 0  # position of the current run's first block
    for i in range(1, len(src_block_ids) + 1):
        if (i < len(src_block_ids) and src_block_ids[i] == src_block_ids[i - 1] + 1
                and dst_block_ids[i] == dst_block_ids[i - 1] + 1):
            continue
        runs.append(Run(first_index + start, src_block_ids[start], dst_block_ids[start], i - start))
        start = i
    return runs


def merge_spans(spans: list[list[int]], new: list[list[int]]) -> None:
    """Append [index, num_blocks] spans to `spans`, merging by reservation position: runs
    split only because source or destination ids jump are one span to the receiver."""
    for index, num_blocks in new:
        if spans and spans[-1][0] + spans[-1][1] == index:
            spans[-1][1] += num_blocks
        else:
            spans.append([index, num_blocks])
