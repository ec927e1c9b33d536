"""What both sides must agree on before a byte moves, and how block lists become copies.

`FabricLayout` describes one block of a pool (the engine's block-major layout:
[num_layers, 2, block_size, num_kv_heads, head_dim] of `dtype`) plus the model it
belongs to. Its `compat_hash` is exchanged in the handshake; on mismatch
`first_mismatch` names the field. `coalesce` turns parallel source/destination block
lists into runs that are contiguous on both sides, so each run is one copy or one frame.

A tensor-parallel worker's pool is one pool per rank, each of `num_kv_heads` of the
model's `model_kv_heads` (`shards`: the first head of each rank's). Two workers of
different degrees agree on everything but the split; `head_pieces` says which sender
rank's heads fill which receiver rank's, as `HeadPiece`s:

    sender TP 2 (heads 0-1 | 2-3)   ->  receiver TP 1 (heads 0-3): two pieces, rank 0 and 1 -> rank 0
    sender TP 1 (heads 0-3)         ->  receiver TP 2: two pieces, rank 0 -> rank 0 and rank 1
    sender TP 2                     ->  receiver TP 4 (heads 0 | 1 | 2 | 3): four pieces, one per receiver rank

A piece of whole blocks on both sides (equal splits) moves as whole blocks; any other
is a strided copy of its heads (`head_view`), on transports that move host memory.
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
    model_kv_heads: int = 0
    """The model's KV heads (0: `num_kv_heads`, a pool of all of them)."""
    shards: tuple[int, ...] = (0,)
    """The first of the model's KV heads in each rank's pool, in rank order (one rank: (0,))."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"FabricLayout.{f} must be positive, got {getattr(self, f)}")
        object.__setattr__(self, "shards", tuple(self.shards))
        heads = self.total_kv_heads
        if not self.shards or any(not 0 <= s <= heads - self.num_kv_heads for s in self.shards) or \
                {h for s in self.shards for h in range(s, s + self.num_kv_heads)} != set(range(heads)):
            raise ValueError(f"shards {list(self.shards)} of {self.num_kv_heads} KV heads do not cover the model's "
                             f"{heads} exactly")

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads, all ranks' pools together."""
        return self.model_kv_heads or self.num_kv_heads

    @property
    def world(self) -> int:
        """Ranks (pools) a block of the model is split over."""
        return len(self.shards)

    @classmethod
    def of_pool(cls, model_id: str, pool_layout: Any, model_kv_heads: int = 0,
                shards: tuple[int, ...] = (0,)) -> FabricLayout:
        """From any pool layout with num_layers, block_size, num_kv_heads, head_dim and a
        torch-style dtype (the engine's KVLayout), without importing it; a tensor-parallel
        worker's rank pools each hold `num_kv_heads` of `model_kv_heads` from their `shards`."""
        dtype = pool_layout.dtype
        return cls(model_id, str(dtype).removeprefix("torch."), pool_layout.num_layers, pool_layout.block_size,
                   pool_layout.num_kv_heads, pool_layout.head_dim, dtype.itemsize, model_kv_heads=model_kv_heads,
                   shards=tuple(shards))

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def to_wire(self) -> dict[str, object]:
        d = asdict(self)
        d["shards"] = list(self.shards)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> FabricLayout:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown layout fields {unknown}")
        if not isinstance(d.get("shards", []), (list, tuple)) or len(d.get("shards", [])) > MAX_RANKS:  # type: ignore
            raise ValueError(f"a layout's shards are a list of at most {MAX_RANKS} heads")
        return cls(**d)  # type: ignore[arg-type]

    @property
    def compat_hash(self) -> str:
        blob = msgpack.packb(sorted(self.to_wire().items()))
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    def first_mismatch(self, other: FabricLayout) -> str | None:
        """Name of the first field that differs, or None when compatible. How the model's heads
        are split (`num_kv_heads` per pool, `shards`) may differ: `head_pieces` maps it."""
        for f in fields(self):
            if f.name == "num_kv_heads" and self.total_kv_heads != other.total_kv_heads:
                return f.name
            if f.name not in _SPLIT and getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None

    @property
    def head_bytes(self) -> int:
        """One head's bytes in one row (layer, K or V, token) of a block."""
        return self.head_dim * self.dtype_bytes


_SPLIT = ("num_kv_heads", "model_kv_heads", "shards")
MAX_RANKS = 256
"""The largest tensor-parallel degree a layout may describe."""


class HeadPiece(NamedTuple):
    """`num_heads` heads from the sender rank's pool (from its local head `src_head`) into the
    receiver rank's (from `dst_head`)."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    num_heads: int

    def whole(self, sender: FabricLayout, receiver: FabricLayout) -> bool:
        """Whole blocks on both sides: a plain block copy."""
        return self.num_heads == sender.num_kv_heads == receiver.num_kv_heads


def head_pieces(sender: FabricLayout, receiver: FabricLayout) -> list[HeadPiece]:
    """Each receiver rank's heads, in order, from the first sender rank that holds each;
    adjacent heads from one sender rank are one piece. ValueError when the two layouts
    describe different models' heads (`first_mismatch` covers the rest)."""
    if sender.total_kv_heads != receiver.total_kv_heads:
        raise ValueError(f"the sender's model has {sender.total_kv_heads} KV heads, the receiver's "
                         f"{receiver.total_kv_heads}")
    holder = {}
    for rank, first in enumerate(sender.shards):
        for h in range(first, first + sender.num_kv_heads):
            holder.setdefault(h, rank)
    pieces: list[HeadPiece] = []
    for dst_rank, first in enumerate(receiver.shards):
        for offset, h in enumerate(range(first, first + receiver.num_kv_heads)):
            src_rank = holder[h]
            src_head = h - sender.shards[src_rank]
            last = pieces[-1] if pieces else None
            if (last is not None and last.dst_rank == dst_rank and last.src_rank == src_rank
                    and last.dst_head + last.num_heads == offset and last.src_head + last.num_heads == src_head):
                pieces[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                pieces.append(HeadPiece(src_rank, src_head, dst_rank, offset, 1))
    return pieces


def head_view(blocks: Any, layout: FabricLayout, first_head: int, num_heads: int) -> Any:
    """Blocks of bytes ([n, block_bytes] uint8, numpy) as [n, rows, heads, head bytes], narrowed
    to `num_heads` heads from `first_head` (a strided view: no copy)."""
    rows = layout.num_layers * 2 * layout.block_size
    shaped = blocks.reshape(blocks.shape[0], rows, layout.num_kv_heads, layout.head_bytes)
    return shaped[:, :, first_head:first_head + num_heads]


@dataclass(frozen=True)
class HeadMap:
    """One sender's pools onto one receiver's: the pieces both sides compute alike."""

    sender: FabricLayout
    receiver: FabricLayout
    pieces: tuple[HeadPiece, ...]

    @classmethod
    def between(cls, sender: FabricLayout, receiver: FabricLayout) -> HeadMap:
        return cls(sender, receiver, tuple(head_pieces(sender, receiver)))

    @property
    def whole_blocks(self) -> bool:
        """One pool to one pool, block for block (the only map device transports move)."""
        return len(self.pieces) == 1 and self.pieces[0].whole(self.sender, self.receiver)

    def block_bytes(self) -> int:
        """What one block position carries, all pieces together (the receiver's ranks' blocks)."""
        return self.receiver.world * self.receiver.block_bytes

    def is_whole(self, piece: HeadPiece) -> bool:
        return piece.whole(self.sender, self.receiver)

    def source(self, piece: HeadPiece, blocks: Any) -> Any:
        """The piece's share of the sender rank's blocks ([n, block_bytes] uint8)."""
        return blocks if self.is_whole(piece) else head_view(blocks, self.sender, piece.src_head, piece.num_heads)

    def destination(self, piece: HeadPiece, blocks: Any) -> Any:
        return blocks if self.is_whole(piece) else head_view(blocks, self.receiver, piece.dst_head, piece.num_heads)


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
