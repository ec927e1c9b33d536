"""A GPU worker's KV pool, sized by profiling (the arithmetic is engine/model/kv_sizing.py's).

The engine reads the device's free memory before it loads anything (`memory_at_start`),
loads the weights, runs one forward at the largest step the scheduler can form on a
provisional pool (`run`), reads the peak, drops that pool (`drop`) and reads free memory
again. What this worker holds is what left the free memory since it started (weights, and
the CUDA, NCCL and CuPy buffers torch does not count); the step's transient is its peak
above what torch holds now, plus the attention workspace (engine/model/attention.py). The device
answers through `DeviceMemory` (engine/model/device_memory.py), so the CPU suite runs this too.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from engine.model.attention import ATTENTION_WORKSPACE_BYTES
from engine.model.device_memory import DeviceMemory
from engine.model.kv_sizing import kv_pool_bytes

logger = logging.getLogger(__name__)


def profiled_pool_bytes(memory: DeviceMemory, memory_at_start: tuple[int, int], provisional_bytes: int,
                        run: Callable[[], None], drop: Callable[[], None], utilization: float,
                        num_tokens: int) -> int:
    """Bytes the KV pool may take (ValueError, with the figures, when nothing is left).
    `memory_at_start`: (free, reserved) before the engine took any; `provisional_bytes`: the
    profile pool's size, which `run` allocates and `drop` releases."""
    memory.synchronize()
    memory.reset_peak()
    run()
    memory.synchronize()
    peak = memory.peak_reserved() - provisional_bytes
    drop()
    memory.release_cached()
    free, total = memory.free_and_total()
    free_at_start, reserved_at_start = memory_at_start
    reserved = memory.reserved()
    held = max(free_at_start - free, reserved - reserved_at_start)
    # the profiled step's activations, and what a decode batch's or a later chunk's
    # attention may materialise on top (engine/model/attention.py bounds it)
    transient = max(peak - reserved, 0) + ATTENTION_WORKSPACE_BYTES
    pool_bytes = kv_pool_bytes(total, held + transient, utilization, free, transient)
    logger.info("KV pool sized from memory: %.2f GiB (%.2f of %.1f GiB less %.2f GiB held by this worker and "
                "%.2f GiB of a %d-token forward's transient; %.2f GiB was free)", pool_bytes / 2**30, utilization,
                total / 2**30, held / 2**30, transient / 2**30, num_tokens, free / 2**30)
    return pool_bytes
