"""Which kernels a model runs with, chosen once at start: the native C kernels on CPU, the
Triton kernels on GPUs, or none (the torch forms, engine/model/attention.py and engine/model/decoder.py,
which stay the reference for both).

`GpuKernels` offers the native kernels' interface (engine/kernels/native.py: `paged_attention`,
`add_rms_norm`, `rotary_store`, `silu_mul`, `pack_linear`), so the model calls either the
same way; its matmuls stay cuBLAS (`pack_linear` returns None), and a mixture of experts
runs as grouped GEMMs (`moe`; the native kernels have none: the torch form, engine/model/moe.py). On CPU it runs under
Triton's interpreter only: the tests check it there against the torch forms.
"""
from __future__ import annotations

from typing import Union

import torch

from engine.kernels import native, triton_attention, triton_moe, triton_pointwise
from engine.model.model_config import MoEConfig
from engine.model.moe import MoEWeights
from engine.kernels.triton_compat import interpreting

Kernels = Union["native.NativeKernels", "GpuKernels"]


class GpuKernels:
    reads_fp8_kv = True
    """`paged_attention` reads an e4m3 pool (its layer's scales given); the native kernels do not yet."""

    def __init__(self, device_type: str, num_sms: int, version: str) -> None:
        self.device_type = device_type
        self.num_sms = num_sms
        """The device's multiprocessors: decode attention splits a context to cover them."""
        self.version = version

    def supports(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        return torch.device(device).type == self.device_type and dtype in (torch.float32, torch.bfloat16,
                                                                             torch.float16)

    def pack_linear(self, weight: torch.Tensor, swiglu: bool = False) -> None:
        return None  # matmuls stay cuBLAS

    def paged_attention(self, q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                        token_index: torch.Tensor, rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                        out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
        """As `NativeKernels.paged_attention`; a ctx_len of 0 gives zeros. The splits follow the
        table's width, so a CUDA graph, which reads it whole, captures one number of them. An
        FP8 pool's layer scales: `k_scale`, `v_scale`."""
        splits = triton_attention.num_splits(
            token_index.numel(), pool.shape[4], block_table.shape[1] * pool.shape[3], self.num_sms)
        triton_attention.paged_decode(q, pool, layer, block_table, token_index, rows, ctx_lens, scale, out, splits,
                                      window, softcap, k_scale, v_scale)

    def add_rms_norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return triton_pointwise.add_rms_norm(h, residual, weight, eps)

    def rotary_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                     pool: torch.Tensor, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        triton_pointwise.rotary_store(qkv, heads, kv_heads, cos, signed_sin, pool, layer, slot_blocks, slot_offsets)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_pointwise.silu_mul(gate_up)

    def moe(self, x: torch.Tensor, weights: MoEWeights, config: MoEConfig) -> torch.Tensor:
        """A mixture-of-experts MLP as grouped GEMMs (engine/kernels/triton_moe.py)."""
        return triton_moe.moe_forward(x, weights, config)


def num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def select_kernels(device: str, enabled: bool, triton_version: str | None = None,
                   sms: int | None = None) -> Kernels | None:
    """CPU: the native kernels (None without a C compiler). CUDA: the Triton kernels (None
    without Triton). `enabled` False: None, the torch forms. `triton_version` and `sms`
    stand in for what only an installed Triton and a GPU answer (tests)."""
    if not enabled:
        return None
    kind = torch.device(device).type
    if kind == "cpu" and not interpreting():
        return native.load()
    version = triton_version or triton_attention.load()
    if version is None:
        return None
    return GpuKernels(kind, sms if sms is not None else num_sms(device) if kind == "cuda" else 1, version)


