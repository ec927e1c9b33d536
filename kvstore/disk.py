"""The KV store's spill: blocks its memory evicts, kept in one preallocated file.

    KVStore evicts a block from memory -> `DiskTier.put(hash, bytes)`: a free slot of the
        file, or the least recently used one's (that block leaves the store) -> pwrite
    a lookup counts blocks here as held; a fetch reads them back into memory first
        (`take(hash)` -> pread into the memory slot, the disk slot freed)

The file is created in `directory` and unlinked at once: the kernel frees its blocks when
the store's process ends, however it ends. Plain buffered I/O (pwrite/pread): the page
cache keeps recently spilled blocks in memory the store does not count as its own, and the
kernel writes them back at its pace; benchmarks/kv_tier_disk.py measures reads against
`dd` of the same bytes. Called under the store's lock, off any event loop.
"""
from __future__ import annotations

import os
import secrets
from collections import OrderedDict
from pathlib import Path

import numpy as np


class DiskTier:
    def __init__(self, directory: str | Path, num_blocks: int, block_bytes: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a disk tier holds at least one block, got {num_blocks}")
        path = Path(directory) / f"splitserve-kvstore-{os.getpid()}-{secrets.token_hex(4)}.blocks"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)  # anonymous from here: freed with the process
            os.posix_fallocate(self.fd, 0, num_blocks * block_bytes)  # a full disk fails now, not mid-write
        except OSError:
            os.close(self.fd)
            raise
        self.capacity, self.block_bytes = num_blocks, block_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Hash -> slot of the file, least recently used first."""
        self._free = list(range(num_blocks - 1, -1, -1))
        self.num_written = self.num_read = self.num_dropped = 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, block_hash: bytes, data: np.ndarray) -> bytes | None:
        """Keeps a block; returns the hash of one dropped to make room (None: none was)."""
        dropped = None
        if self._free:
            slot = self._free.pop()
        else:
            dropped, slot = self._index.popitem(last=False)
            self.num_dropped += 1
        written = os.pwrite(self.fd, memoryview(data).cast("B"), slot * self.block_bytes)
        if written != self.block_bytes:
            raise OSError(f"short write to the KV store's spill file: {written} of {self.block_bytes} bytes")
        self._index[block_hash] = slot
        self.num_written += 1
        return dropped

    def take(self, block_hash: bytes, into: np.ndarray) -> None:
        """Reads a block into `into` and lets go of it here (memory holds it from now on)."""
        slot = self._index.pop(block_hash)
        n = os.preadv(self.fd, [memoryview(into).cast("B")], slot * self.block_bytes)
        self._free.append(slot)
        if n != self.block_bytes:
            raise OSError(f"short read from the KV store's spill file: {n} of {self.block_bytes} bytes")
        self.num_read += 1

    def touch(self, block_hash: bytes) -> None:
        self._index.move_to_end(block_hash)

    def check(self) -> None:
        if sorted([*self._free, *self._index.values()]) != list(range(self.capacity)):
            raise AssertionError(f"the spill file's {self.capacity} slots are not accounted for once each")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
