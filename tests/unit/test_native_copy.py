"""copy_stream (engine/kernels/csrc/copy.c): the bytes of memcpy, for every alignment of source and
destination and every length around the 64-byte lines it streams, and not one byte outside
[dst, dst + n)."""
from __future__ import annotations

import numpy as np
import pytest

GUARD = 128


def copy_into(kernels, src: np.ndarray, n: int, src_off: int, dst_off: int) -> np.ndarray:
    """A guarded destination buffer after copy_stream of src[src_off:src_off + n] to dst_off."""
    dst = np.full(GUARD + dst_off + n + GUARD, 0xA5, np.uint8)
    kernels.copy_stream(dst.ctypes.data + GUARD + dst_off, src.ctypes.data + src_off, n)
    return dst


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096, 196608 + 17])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (0, 1), (7, 0), (13, 63), (64, 32), (1, 61)])
def test_copy_stream_copies_exactly_the_bytes_asked(kernels, n, src_off, dst_off):
    src = np.random.default_rng(n * 131 + src_off).integers(0, 256, src_off + n + 64, dtype=np.uint8)
    dst = copy_into(kernels, src, n, src_off, dst_off)
    start = GUARD + dst_off
    assert np.array_equal(dst[start:start + n], src[src_off:src_off + n])
    assert (dst[:start] == 0xA5).all() and (dst[start + n:] == 0xA5).all()


def test_copy_stream_moves_a_run_of_kv_blocks_between_regions(kernels):
    """As kvfabric's shm push uses it: a run of blocks into another region's blocks."""
    from kvfabric import BlockRegion

    bb = 3 * 4096 + 192  # not a multiple of 64: runs start at every alignment
    src = BlockRegion(np.random.default_rng(5).integers(0, 256, (9, bb), dtype=np.uint8))
    dst = BlockRegion(np.zeros((12, bb), np.uint8))
    dst.copy_from(src, 2, 5, 4, kernels.copy_stream)
    assert np.array_equal(dst.array[5:9], src.array[2:6])
    assert not dst.array[:5].any() and not dst.array[9:].any()
