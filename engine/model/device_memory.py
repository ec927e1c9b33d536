"""What the engine asks a device about its memory, behind one small interface.

KV sizing on a GPU (engine/llm_engine.py `_profile_kv_bytes`, engine/model/kv_sizing.py) reads
free and reserved memory before and after a profiled forward. Only CUDA answers those
questions, so the path a GPU worker takes at start would otherwise run nowhere but on a
GPU: a bug on it (the first GPU run's `speculator` AttributeError) stays invisible to the
CPU suite. The engine therefore asks a `DeviceMemory`: `CudaMemory` on GPUs, and on CPU a
test passes figures of its own (`StatedMemory`), so the very same profile runs there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class DeviceMemory(Protocol):
    def free_and_total(self) -> tuple[int, int]:
        """Bytes free on the device now, and its total."""
        ...

    def reserved(self) -> int:
        """Bytes this process's allocator holds now."""
        ...

    def peak_reserved(self) -> int:
        """The most bytes the allocator held since `reset_peak`."""
        ...

    def reset_peak(self) -> None: ...

    def synchronize(self) -> None: ...

    def release_cached(self) -> None:
        """Return the allocator's unused cached memory to the device."""
        ...


class CudaMemory:
    """torch.cuda's answers for one device."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()


@dataclass
class StatedMemory:
    """A device whose figures are stated, not measured: the CPU suite runs the GPU's start-up
    path with it. `free_bytes` drops by what `take` is told the engine allocated."""

    total_bytes: int
    free_bytes: int
    reserved_bytes: int = 0
    peak_bytes: int = 0
    calls: list[str] = field(default_factory=list)

    def free_and_total(self) -> tuple[int, int]:
        self.calls.append("free_and_total")
        return self.free_bytes, self.total_bytes

    def reserved(self) -> int:
        return self.reserved_bytes

    def peak_reserved(self) -> int:
        return max(self.peak_bytes, self.reserved_bytes)

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")
        self.peak_bytes = self.reserved_bytes

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def release_cached(self) -> None:
        self.calls.append("release_cached")

    def take(self, num_bytes: int) -> None:
        """The engine allocated `num_bytes` (weights, say): less is free, more is reserved."""
        self.free_bytes -= num_bytes
        self.reserved_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.reserved_bytes)
