"""Which device a worker runs on, in which dtype, and how much of a GPU it asks for (torch-free, pure)."""
from __future__ import annotations

from engine.config import DType


def resolve_device(requested: str, num_gpus: int) -> str:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` without one is an error that says so."""
    if requested == "auto":
        return "cuda" if num_gpus > 0 else "cpu"
    if requested.split(":", 1)[0] == "cuda" and num_gpus == 0:
        raise ValueError("--device cuda, but torch sees no GPU (a CPU-only torch, or no driver): "
                         "install a CUDA build of torch, or use --device cpu")
    if requested.split(":", 1)[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    return requested


def default_dtype(device: str) -> DType:
    """bfloat16 on GPU (what checkpoints ship in), float32 on CPU (the reference path)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def default_gpus_per_worker(num_node_gpus: int, num_local_workers: int) -> float:
    """A whole GPU each on a multi-GPU node; on a one-GPU node its workers share it evenly
    (a prefill and a decode worker: 0.5 each)."""
    if num_node_gpus != 1:
        return 1.0
    return 1.0 / max(num_local_workers, 1)
