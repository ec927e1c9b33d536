"""Block memory as bytes: a pool seen as [num_blocks, block_bytes] uint8, and POSIX shared
memory to put a decode pool in.

A `BlockRegion` is a numpy view sharing memory with the pool tensor, so copies and
`recv_into` land straight in the blocks. `ShmSegment` is a file in /dev/shm (mode 0600)
with one header page (magic + nonce, so a sender proves it mapped the right segment)
followed by the pool's bytes; `ShmKVAllocator` is the engine's `KVAllocator` over one.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import secrets
import stat
import weakref
from collections.abc import Callable, Container
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is only needed to view a pool tensor; senders and receivers run without it
    import torch

CopyBytes = Callable[[int, int, int], None]
"""copy(dst address, src address, nbytes) for non-overlapping memory, the GIL released
(a ctypes function): `ctypes.memmove`, or one that streams past the cache (the engine's
`copy_stream`)."""

@dataclasses.dataclass(frozen=True)
class AgentRegion:
    """A further tensor-parallel rank's pool that this process cannot reach: private to the
    rank's own process (as a GPU rank's is) and registered with a NIXL agent of its own there
    (kvfabric/nixl_ranks.py `RankPool`). Only NIXL writes into it, through that agent."""

    num_blocks: int
    block_bytes: int
    metadata: bytes
    """The rank's agent's (`Agent.metadata`)."""
    pool: tuple[int, int, int]
    """Where the pool is registered there: (base address, bytes, device)."""
    post: str = ""
    """The rank's `RankPoster` (a Unix socket's abstract name), which posts writes from the pool."""
    token: str = ""
    """What the poster asks of a caller first."""

    @classmethod
    def from_export(cls, num_blocks: int, block_bytes: int, export: dict) -> AgentRegion:
        """From what the rank's `RankPool.export` gave."""
        base, nbytes, device = (int(x) for x in export["nixl_pool"])
        return cls(num_blocks, block_bytes, bytes(export["nixl"]), (base, nbytes, device),
                   export.get("nixl_post", ""), export.get("nixl_token", ""))


_SHM_DIR = Path("/dev/shm")
_HEADER_BYTES = mmap.PAGESIZE
_MAGIC = b"splitserve-kvfabric-v1\0"


class BlockRegion:
    def __init__(self, array: np.ndarray) -> None:
        if array.dtype != np.uint8 or array.ndim != 2 or not array.flags.c_contiguous:
            raise ValueError("a BlockRegion is a C-contiguous uint8 array [num_blocks, block_bytes]")
        self.array = array
        self._address = array.ctypes.data

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> BlockRegion:
        """A CPU pool tensor [num_blocks, ...] seen as bytes (no copy)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("BlockRegion.from_tensor needs a contiguous CPU tensor")
        import torch

        flat = tensor.reshape(tensor.shape[0], -1)
        return cls(flat.view(torch.uint8).numpy())

    @property
    def num_blocks(self) -> int:
        return self.array.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.array.shape[1]

    def blocks(self, first: int, num_blocks: int) -> np.ndarray:
        if first < 0 or num_blocks <= 0 or first + num_blocks > self.num_blocks:
            raise ValueError(f"blocks [{first}, {first + num_blocks}) outside the pool of {self.num_blocks}")
        return self.array[first:first + num_blocks]

    def copy_from(
        self, src: BlockRegion, src_block: int, dst_block: int, num_blocks: int, copy: CopyBytes = ctypes.memmove,
    ) -> None:
        """Copy a run of blocks with the GIL released (other threads keep going)."""
        for region, first in ((src, src_block), (self, dst_block)):
            if first < 0 or num_blocks <= 0 or first + num_blocks > region.num_blocks:
                raise ValueError(f"blocks [{first}, {first + num_blocks}) outside the pool of {region.num_blocks}")
        bb = self.block_bytes
        copy(self._address + dst_block * bb, src._address + src_block * bb, num_blocks * bb)


class ShmSegment:
    """A shared-memory file: created (and unlinked) by the receiver, mapped by senders."""

    def __init__(self, name: str, nonce: str, fd: int, nbytes: int, owner: bool) -> None:
        self.name, self.nonce, self.nbytes, self.owner = name, nonce, nbytes, owner
        flags = mmap.MAP_SHARED | (0 if owner else mmap.MAP_POPULATE)
        try:
            self.mmap = mmap.mmap(fd, _HEADER_BYTES + nbytes, flags=flags)
        finally:
            os.close(fd)
        self.data = np.frombuffer(self.mmap, dtype=np.uint8, count=nbytes, offset=_HEADER_BYTES)
        if owner:
            self._finalizer = weakref.finalize(self, _unlink, _SHM_DIR / name)

    @classmethod
    def create(cls, nbytes: int) -> ShmSegment:
        sweep_dead_segments()
        name = f"splitserve-kv-{os.getpid()}-{secrets.token_hex(6)}"
        nonce = secrets.token_hex(16)
        fd = os.open(_SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the pages now: a full /dev/shm must fail here, not SIGBUS on first touch
            os.posix_fallocate(fd, 0, _HEADER_BYTES + nbytes)
        except OSError:
            os.close(fd)
            _unlink(_SHM_DIR / name)
            raise
        seg = cls(name, nonce, fd, nbytes, owner=True)
        seg.mmap[: len(_MAGIC) + 32] = _MAGIC + nonce.encode()
        return seg

    @classmethod
    def open(cls, name: str, nonce: str, nbytes: int) -> ShmSegment:
        """Map a receiver's segment; raises OSError/ValueError if it is not the one announced."""
        if "/" in name or not name.startswith("splitserve-kv-"):
            raise ValueError(f"not a kvfabric segment name: {name!r}")
        fd = os.open(_SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)  # a link planted under the name is refused
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != _HEADER_BYTES + nbytes:
            os.close(fd)
            raise ValueError(f"segment {name} is not a file of the announced size")
        seg = cls(name, nonce, fd, nbytes, owner=False)
        if bytes(seg.mmap[: len(_MAGIC) + 32]) != _MAGIC + nonce.encode():
            seg.close()
            raise ValueError(f"segment {name} does not carry the announced nonce")
        return seg

    def close(self) -> None:
        """Unmap (and unlink, for the creator). Views into the data must be gone first."""
        self.data = None  # type: ignore[assignment]
        if self.owner:
            self._finalizer()
        try:
            self.mmap.close()
        except BufferError:
            pass  # a live view (e.g. the engine's pool tensor) keeps the mapping until it dies


def _segments() -> list[tuple[Path, int]]:
    """Every kvfabric segment on this host with its creator's pid (in its name)."""
    found = []
    for path in _SHM_DIR.glob("splitserve-kv-*-*"):
        try:
            found.append((path, int(path.name.split("-")[2])))
        except ValueError:
            continue
    return found


def segments_of(pids: set[int]) -> set[str]:
    """The names of the segments these processes created."""
    return {path.name for path, pid in _segments() if pid in pids}


def sweep_dead_segments(only: Container[str] | None = None) -> list[str]:
    """Unlink segments whose creating process is gone (killed before it could clean up); with
    `only`, just those of these names."""
    removed = []
    for path, pid in _segments():
        if (only is None or path.name in only) and not Path(f"/proc/{pid}").exists():
            _unlink(path)
            removed.append(path.name)
    return removed


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class ShmKVAllocator:
    """Engine `KVAllocator` that puts the pool in a fresh shared-memory segment."""

    def __init__(self) -> None:
        self.segment: ShmSegment | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"shared-memory KV pools live on the CPU, not {device}")
        if self.segment is not None:
            raise ValueError("a ShmKVAllocator backs exactly one pool")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        import torch

        self.segment = ShmSegment.create(nbytes)
        return torch.from_numpy(self.segment.data).view(dtype).view(shape)  # zero-filled by the kernel

    def export(self) -> dict[str, object]:
        """What another process of this host maps the pool by (`ShmSegment.open`)."""
        if self.segment is None:
            return {}
        return {"shm": self.segment.name, "nonce": self.segment.nonce, "bytes": self.segment.nbytes}

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
