"""The KV store's spill file (kvstore/disk.py), buffered and O_DIRECT: blocks come back byte
for byte, slots are reused least recently used first, and direct I/O moves whole aligned
units, straight from aligned memory or through its bounce buffer."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvstore.disk import ALIGN, DiskTier


def aligned(n: int, block_bytes: int) -> np.ndarray:
    """`n` blocks in page-aligned memory (as the store's shared-memory slots are)."""
    return np.frombuffer(mmap.mmap(-1, n * block_bytes), dtype=np.uint8).reshape(n, block_bytes)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("block_bytes", [2 * ALIGN, 3000], ids=["whole_units", "unaligned"])
def test_spilled_blocks_come_back_byte_for_byte(tmp_path, direct: bool, block_bytes: int) -> None:
    try:
        disk = DiskTier(tmp_path, 2, block_bytes, direct=direct)
    except OSError as e:  # a filesystem without O_DIRECT says so by name
        assert "O_DIRECT" in str(e)
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    assert disk.stride == (2 * ALIGN if direct and block_bytes == 2 * ALIGN else
                           ALIGN if direct else block_bytes)
    rng = np.random.default_rng(1)
    blocks = aligned(3, block_bytes)
    blocks[:] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
    want = blocks.copy()
    assert disk.put(b"a", blocks[0]) is None and disk.put(b"b", blocks[1]) is None
    disk.touch(b"a")
    assert disk.put(b"c", blocks[2]) == b"b"  # the least recently used slot is reused
    assert b"b" not in disk and len(disk) == 2 and disk.num_dropped == 1
    into = aligned(2, block_bytes)
    disk.take(b"a", into[0])
    disk.take(b"c", into[1])
    assert (into[0] == want[0]).all() and (into[1] == want[2]).all()
    assert len(disk) == 0 and disk.num_written == 3 and disk.num_read == 2
    disk.check()
    disk.close()


def test_direct_io_of_memory_that_is_not_aligned_goes_through_the_bounce_buffer(tmp_path) -> None:
    """A view one byte into a page: O_DIRECT would refuse it (EINVAL); it is bounced instead."""
    try:
        disk = DiskTier(tmp_path, 1, ALIGN, direct=True)
    except OSError:
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    buf = aligned(1, 2 * ALIGN).reshape(-1)
    block = buf[1:1 + ALIGN]
    block[:] = np.arange(ALIGN, dtype=np.uint64).astype(np.uint8)
    assert not disk._aligned(block)
    disk.put(b"x", block)
    into = buf[3:3 + ALIGN]
    want = block.copy()
    into[:] = 0
    disk.take(b"x", into)
    assert (into == want).all()
    disk.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_blocks_in_adjacent_slots_come_back_in_one_read_each_run(tmp_path, monkeypatch, direct: bool) -> None:
    """Slots 0-2 and 4 hold blocks taken together: two preadv calls (slots 0-2, then 4), each
    block's bytes where it belongs, whatever order they were asked in."""
    try:
        disk = DiskTier(tmp_path, 5, ALIGN, direct=direct)
    except OSError:
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    blocks = aligned(5, ALIGN)
    blocks[:] = np.random.default_rng(2).integers(0, 256, blocks.shape, dtype=np.uint8)
    for i in range(5):
        disk.put(bytes([i]), blocks[i])  # block i in slot i
    calls = []
    real = __import__("os").preadv

    def counted(fd, buffers, offset):
        calls.append((offset // ALIGN, len(buffers)))
        return real(fd, buffers, offset)
    monkeypatch.setattr("kvstore.disk.os.preadv", counted)
    into = aligned(4, ALIGN)
    disk.take_many([bytes([4]), bytes([2]), bytes([0]), bytes([1])], [into[0], into[1], into[2], into[3]])
    assert calls == [(0, 3), (4, 1)]
    for got, i in zip(into, (4, 2, 0, 1), strict=True):
        assert (got == blocks[i]).all()
    assert len(disk) == 1 and bytes([3]) in disk and disk.num_read == 4
    disk.check()
    disk.close()


def test_an_empty_spill_file_is_still_a_spill_file(tmp_path) -> None:
    disk = DiskTier(tmp_path, 3, ALIGN)
    assert len(disk) == 0 and disk and disk.capacity == 3
    disk.close()
