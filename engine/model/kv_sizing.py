"""How big a worker's KV pool is (torch-free, pure): a share of the device's memory, as vLLM sizes it.

On a GPU the engine reads the device's free memory before it loads anything, loads the
weights, runs one forward at the largest step the scheduler can form
(`max_num_batched_tokens` tokens) on a provisional pool, and releases that pool. What
this worker uses (`used_bytes`) is what left the free memory since it started (weights,
and the CUDA, NCCL and CuPy buffers torch does not count) plus the forward's transient
peak above what torch holds now, with the attention workspace (engine/model/attention.py) on
top (`transient_bytes`, which must stay free while serving).
The KV pool gets what is left of this worker's share, `utilization * total_bytes -
used_bytes`, and never more than is free now less the transient: a second worker on a GPU
another one already fills gets what is actually there, or a clear error, not a crash at its
first allocation. An explicit `kv_cache_bytes` overrides it.

On CPU the launcher (`splitserve serve`, `splitserve worker`) gives the workers on its host
`DEFAULT_CPU_KV_FRACTION` of the memory available there, in equal parts (`cpu_kv_bytes`);
the pool's pages are taken as requests write them (engine/model/kv_pool.py), so a large pool
costs what is used. An engine built without either (tests, library use) gets
`DEFAULT_CPU_KV_BYTES`.
"""
from __future__ import annotations

import os

DEFAULT_CPU_KV_BYTES = 256 * 2**20
DEFAULT_CPU_KV_FRACTION = 0.2
"""Of the host's available memory, what the KV pools of the CPU workers on it take in all."""


def available_memory_bytes() -> int:
    """The host's available memory (MemAvailable; free pages where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_bytes(available_bytes: int, fraction: float, num_workers: int) -> int:
    """Each of `num_workers` CPU workers' KV pool: its part of `fraction` of the available
    memory, never under `DEFAULT_CPU_KV_BYTES`."""
    if not 0.0 < fraction <= 0.9:
        raise ValueError(f"the CPU KV fraction must be in (0, 0.9], got {fraction}")
    return max(int(available_bytes * fraction / max(num_workers, 1)), DEFAULT_CPU_KV_BYTES)


def kv_pool_bytes(total_bytes: int, used_bytes: int, utilization: float, free_bytes: int | None = None,
                  transient_bytes: int = 0) -> int:
    """Bytes the KV pool may take; raises ValueError (with the figures) when nothing is left.
    `free_bytes`: the device's free memory now (None: not known, the share alone decides)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    gib = 2**30
    share = int(total_bytes * utilization) - used_bytes
    if share <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: this worker may use {utilization:.2f} of "
            f"{total_bytes / gib:.1f} GiB = {total_bytes * utilization / gib:.2f} GiB, and the weights and the "
            f"profiled forward already take {used_bytes / gib:.2f} GiB; raise --gpu-memory-utilization, lower "
            "max_num_batched_tokens, or use a smaller model or dtype")
    if free_bytes is None or free_bytes - transient_bytes >= share:
        return share
    room = free_bytes - transient_bytes
    if room <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {free_bytes / gib:.2f} GiB of {total_bytes / gib:.1f} GiB is free "
            f"and a step needs {transient_bytes / gib:.2f} GiB of it; other processes hold the rest. Give each "
            "worker sharing this GPU its part with --gpu-memory-utilization (two workers: 0.45 each)")
    return room


def num_blocks_for(pool_bytes: int, block_bytes: int) -> int:
    """Whole blocks in `pool_bytes` (at least one)."""
    return max(1, pool_bytes // block_bytes)
