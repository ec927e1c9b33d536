"""The KV store's spill: blocks its memory evicts, kept in one preallocated file.

    KVStore evicts a block from memory -> `DiskTier.put(hash, bytes)`: a free slot of the
        file, or the least recently used one's (that block leaves the store) -> pwrite
    a lookup counts blocks here as held; a fetch reads them back into memory first
        (`take(hash)` -> pread into the memory slot, the disk slot freed)

The file is created in `directory` and unlinked at once: the kernel frees its blocks when
the store's process ends, however it ends. Buffered I/O by default (pwrite/pread): the page
cache keeps recently spilled blocks in memory the store does not count as its own, and the
kernel writes them back at its pace. `direct`: O_DIRECT, the device at every read and
write, no page cache (slots padded to `ALIGN`, a block whose memory is not aligned goes
through one aligned bounce buffer); benchmarks/kv/kv_tier_fetch.py reads both ways against `dd`
of the same bytes. Called under the store's lock, off any event loop.
"""
from __future__ import annotations

import mmap
import os
import secrets
from collections import OrderedDict
from pathlib import Path

import numpy as np

ALIGN = 4096
"""O_DIRECT's unit: offsets, lengths and buffer addresses are multiples of it (a page; every
logical block size Linux filesystems use divides it)."""


def slot_bytes(block_bytes: int, direct: bool) -> int:
    """Bytes a block's slot takes in the file (whole `ALIGN` units under O_DIRECT)."""
    return -(-block_bytes // ALIGN) * ALIGN if direct else block_bytes


MAX_RUN = 512
"""Most blocks one preadv reads (the kernel takes at most IOV_MAX, 1,024, buffers a call)."""


class DiskTier:
    def __init__(self, directory: str | Path, num_blocks: int, block_bytes: int, direct: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a disk tier holds at least one block, got {num_blocks}")
        self.direct = direct
        self.stride = slot_bytes(block_bytes, direct)
        """Bytes a slot takes in the file."""
        path = Path(directory) / f"splitserve-kvstore-{os.getpid()}-{secrets.token_hex(4)}.blocks"
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as e:
            if direct and e.errno == 22:  # EINVAL: a filesystem without O_DIRECT (older kernels' tmpfs)
                raise OSError(e.errno, f"{directory}'s filesystem does not take O_DIRECT: spill there buffered "
                                       "(without --kv-store-direct-io), or choose a directory on a disk") from e
            raise
        try:
            os.unlink(path)  # anonymous from here: freed with the process
            os.posix_fallocate(self.fd, 0, num_blocks * self.stride)  # a full disk fails now, not mid-write
        except OSError:
            os.close(self.fd)
            raise
        self.capacity, self.block_bytes = num_blocks, block_bytes
        self._bounce = mmap.mmap(-1, self.stride) if direct else None
        """Direct I/O of a block whose memory is not aligned goes through here (page-aligned)."""
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Hash -> slot of the file, least recently used first."""
        self._free = list(range(num_blocks - 1, -1, -1))
        self.num_written = self.num_read = self.num_dropped = 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:
        """A spill file is there even while it holds nothing (else `if store.disk` reads an
        empty one as none: the store's entry reported its capacity as 0 until a first spill)."""
        return True

    def put(self, block_hash: bytes, data: np.ndarray) -> bytes | None:
        """Keeps a block; returns the hash of one dropped to make room (None: none was)."""
        dropped = None
        if self._free:
            slot = self._free.pop()
        else:
            dropped, slot = self._index.popitem(last=False)
            self.num_dropped += 1
        view = memoryview(data).cast("B")
        if self._bounce is not None and not self._aligned(data):
            self._bounce[:self.block_bytes] = view
            view = memoryview(self._bounce)
        written = os.pwrite(self.fd, view, slot * self.stride)
        if written != len(view):
            raise OSError(f"short write to the KV store's spill file: {written} of {len(view)} bytes")
        self._index[block_hash] = slot
        self.num_written += 1
        return dropped

    def take(self, block_hash: bytes, into: np.ndarray) -> None:
        """Reads a block into `into` and lets go of it here (memory holds it from now on)."""
        slot = self._index.pop(block_hash)
        self._free.append(slot)
        view = memoryview(into).cast("B")
        bounce = self._bounce is not None and not self._aligned(into)
        n = os.preadv(self.fd, [memoryview(self._bounce) if bounce else view], slot * self.stride)
        if n != (self.stride if bounce else self.block_bytes):
            raise OSError(f"short read from the KV store's spill file: {n} of {self.block_bytes} bytes")
        if bounce:
            view[:] = memoryview(self._bounce)[:self.block_bytes]
        self.num_read += 1

    def take_many(self, hashes: list[bytes], intos: list[np.ndarray]) -> None:
        """`take` of each, the blocks in adjacent slots of the file read by one preadv each
        (a chain spilled together lies together: one request to the disk, not one a block)."""
        if self._bounce is not None and not all(self._aligned(a) for a in intos):
            for h, into in zip(hashes, intos, strict=True):
                self.take(h, into)
            return
        order = sorted(zip((self._index[h] for h in hashes), hashes, intos, strict=True), key=lambda t: t[0])
        run: list[tuple[int, bytes, np.ndarray]] = []
        for item in order:
            if run and (item[0] != run[-1][0] + 1 or len(run) == MAX_RUN):
                self._read_run(run)
                run = []
            run.append(item)
        if run:
            self._read_run(run)

    def _read_run(self, run: list[tuple[int, bytes, np.ndarray]]) -> None:
        """Adjacent slots into their blocks' memory, in one preadv."""
        want = len(run) * self.block_bytes
        n = os.preadv(self.fd, [memoryview(into).cast("B") for _, _, into in run], run[0][0] * self.stride)
        for slot, h, _ in run:
            del self._index[h]
            self._free.append(slot)
        if n != want:
            raise OSError(f"short read from the KV store's spill file: {n} of {want} bytes")
        self.num_read += len(run)

    def _aligned(self, data: np.ndarray) -> bool:
        """Direct I/O straight from or into `data`: its address and length are whole units."""
        return self.block_bytes == self.stride and data.ctypes.data % ALIGN == 0

    def touch(self, block_hash: bytes) -> None:
        self._index.move_to_end(block_hash)

    def check(self) -> None:
        if sorted([*self._free, *self._index.values()]) != list(range(self.capacity)):
            raise AssertionError(f"the spill file's {self.capacity} slots are not accounted for once each")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None
