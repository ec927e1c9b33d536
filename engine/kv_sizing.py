"""How big a worker's KV pool is (torch-free, pure): a share of the device's memory, as vLLM sizes it.

On a GPU the engine loads the weights, runs one forward at the largest step the scheduler
can form (`max_num_batched_tokens` tokens) on a provisional pool, and measures the peak
memory that took (`used_bytes`: weights + activations + workspace, without the
provisional pool). The KV pool gets what is left of this worker's share:
`utilization * total_bytes - used_bytes`. An explicit `kv_cache_bytes` overrides it; on
CPU that is the only way (`DEFAULT_CPU_KV_BYTES` when unset).
"""
from __future__ import annotations

DEFAULT_CPU_KV_BYTES = 256 * 2**20


def kv_pool_bytes(total_bytes: int, used_bytes: int, utilization: float) -> int:
    """Bytes the KV pool may take; raises ValueError (with the figures) when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - used_bytes
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: this worker may use {utilization:.2f} of "
            f"{total_bytes / gib:.1f} GiB = {total_bytes * utilization / gib:.2f} GiB, and the weights and the "
            f"profiled forward already take {used_bytes / gib:.2f} GiB; raise --gpu-memory-utilization, lower "
            "max_num_batched_tokens, or use a smaller model or dtype")
    return budget


def num_blocks_for(pool_bytes: int, block_bytes: int) -> int:
    """Whole blocks in `pool_bytes` (at least one)."""
    return max(1, pool_bytes // block_bytes)
