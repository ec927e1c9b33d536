"""A mixture-of-experts layer on GPUs in Triton: one grouped GEMM per projection over the
experts a batch touches, with no host sync (so a CUDA graph can hold it).

    route (engine/model/moe.py: softmax in float32, top k, renormalised where the model says)
    align: the batch's (token, slot) pairs sorted by expert, each expert's run padded to
        BLOCK_M rows; `block_experts[b]` is the expert of rows [b BLOCK_M, (b+1) BLOCK_M)
        (-1: past the last run). The number of blocks is bounded by pairs / BLOCK_M +
        experts, known without reading the counts back to the host
    gate_up: per (block, column tile) a program loads its block's rows of x (by token) and
        its expert's weight tile and accumulates in float32 -> [pairs, 2 I]
    silu(gate) * up (engine/kernels/triton_pointwise.py)
    down: the same GEMM over the activations (by pair), scaled by each pair's routing
        weight -> [pairs, hidden]; summed over each token's k slots

FP8 experts (`MoEWeights.fp8`): the stacked weights are e4m3 (one byte: stored so on GPUs)
with a float32 scale per expert and output row. Each GEMM's inputs are quantized first as
an FP8 Linear's are (engine/model/fp8.py `quantize_input`): per token (`dynamic`; gate_up's
once per token, whichever experts it goes to; down's per pair), or by each pair's expert's
static scale (`static`, the rows gathered per pair first); the kernel multiplies e4m3 by e4m3
on the tensor cores (Hopper and later; upcast to float32 elsewhere, exact), accumulates in
float32 and scales each product by its row's input scale and its column's weight scale on
the way out. `weights_only` multiplies the 16-bit input by the widened weight.

The reference is `engine.model.moe.moe_forward` (one GEMM per expert touched, tokens grouped by
expert); they differ by float rounding (the order of the k terms of a token's sum; an FP8
product is rounded to the model's dtype before its scales there, after them here).
Checked under Triton's interpreter on CPU (tests/unit/test_triton_kernels.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import triton_compat, triton_pointwise
from engine.model.fp8 import E4M3, quantize_input, to_e4m3
from engine.model.model_config import MoEConfig
from engine.model.moe import Fp8Experts, MoEWeights, add_shared_expert, route

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """experts: [tokens, top_k] -> (sorted_pairs [blocks * block_m]: the pair index (token *
    top_k + slot) of each row, `pairs` for padding; block_experts [blocks]: each block's
    expert, -1 for blocks past the last run). Device ops only."""
    flat = experts.flatten()
    pairs = flat.numel()
    max_blocks = -(-pairs // block_m) + num_experts
    # (not bincount: on CUDA it reads its input's max back to the host, which a graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in `order`
    dest = starts[sorted_experts] + torch.arange(pairs, device=flat.device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((max_blocks * block_m,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[dest] = order
    block_start = torch.arange(max_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_start < ends[-1], block_experts, -1)
    return sorted_pairs, block_experts


def moe_forward(x: torch.Tensor, w: MoEWeights, config: MoEConfig) -> torch.Tensor:
    """x: [tokens, hidden] contiguous -> [tokens, hidden], as engine.model.moe.moe_forward."""
    tokens, hidden = x.shape
    weights, experts = route(x, w.router, config.top_k, config.norm_topk_prob)
    sorted_pairs, block_experts = align(experts, config.num_experts)
    pairs = tokens * config.top_k
    inter2 = w.gate_up.shape[1]
    q = w.fp8
    gate_up = x.new_empty(pairs, inter2)
    a, a_scale, rows_per_a = _fp8_inputs(x, q, q.gate_up_input, experts, config.top_k) if q is not None else \
        (x, None, config.top_k)
    _gemm(a, w.gate_up, gate_up, None, sorted_pairs, block_experts, pairs, rows_per_a,
          a_scale, None if q is None else q.gate_up)
    act = triton_pointwise.silu_mul(gate_up)  # [pairs, I]
    down = x.new_empty(pairs, hidden)
    a, a_scale, _ = _fp8_inputs(act, q, q.down_input, experts, 1) if q is not None else (act, None, 1)
    _gemm(a, w.down, down, weights.flatten().contiguous(), sorted_pairs, block_experts, pairs, 1,
          a_scale, None if q is None else q.down)
    out = down.view(tokens, config.top_k, hidden).sum(dim=1)
    add_shared_expert(out, x, w)
    return out


def _fp8_inputs(x: torch.Tensor, q: Fp8Experts, static: torch.Tensor | None, experts: torch.Tensor,
                rows_per_pair: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A GEMM's input as its FP8 experts take it: (the rows, e4m3 or as they are; each row's
    input scale, None for weights_only; how many pairs share a row). `x` has a row per token
    (`rows_per_pair` = top_k, gate_up) or per pair (1, down)."""
    if q.inputs == "weights_only":
        return x, None, rows_per_pair
    if q.inputs == "static" and static is not None:  # each pair's expert's scale: a row per pair
        rows = x if rows_per_pair == 1 else x.repeat_interleave(rows_per_pair, dim=0)
        scale = static.to(torch.float32)[experts.flatten()][:, None]
        return to_e4m3(rows.float() / scale).contiguous(), scale.flatten().contiguous(), 1
    xq, scale = quantize_input(x, None, q.scale_ub)
    return xq.contiguous(), scale.flatten().contiguous(), rows_per_pair


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor | None, sorted_pairs: torch.Tensor,
          block_experts: torch.Tensor, pairs: int, rows_per_a: int, a_scale: torch.Tensor | None = None,
          b_scale: torch.Tensor | None = None) -> None:
    """c[pair] = a[pair // rows_per_a] @ b[expert of pair]^T (times scale[pair]) for every pair;
    FP8 experts (`b_scale` [experts, N]): b's e4m3 values times b_scale, a's row times its
    `a_scale` where a is e4m3 (None: a 16-bit a)."""
    import triton

    n, k = b.shape[1], b.shape[2]
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()) or a.shape[1] != k:
        raise ValueError(f"moe gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must be contiguous and agree on K")
    if not pairs:
        return
    fp8 = b_scale is not None
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _kernels().gemm[grid](a, b, c, c if scale is None else scale, sorted_pairs, block_experts, n, k, pairs,
                          b.stride(0), b.stride(1), c if a_scale is None else a_scale,
                          c if b_scale is None else b_scale, ROWS_PER_A=rows_per_a, HAS_SCALE=scale is not None,
                          IEEE=c.dtype == torch.float32, FP8=fp8, A_FP8=a_scale is not None,
                          DOT8=a.dtype == b.dtype == E4M3 and _fp8_tensor_cores(a.device),
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def _fp8_tensor_cores(device: torch.device) -> bool:
    """Whether tl.dot takes e4m3 operands here: compute capability 8.9 (Ada) and later, and
    Triton's interpreter (which computes it exactly)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _gemm_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, pairs_ptr, experts_ptr, N, K, num_pairs, b_se, b_sn,
                        a_scale_ptr, b_scale_ptr,
                        ROWS_PER_A: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
                        FP8: tl.constexpr, A_FP8: tl.constexpr, DOT8: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(experts_ptr + block)
        if expert >= 0:
            m = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pairs_ptr + m)
            valid = pair < num_pairs
            row = tl.where(valid, pair // ROWS_PER_A, 0)
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + row[:, None] * K + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr + expert * b_se + n[None, :] * b_sn + kk[:, None],
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if DOT8:  # e4m3 x e4m3 on the tensor cores, float32 accumulation
                    acc += tl.dot(a, b)
                elif A_FP8:  # e4m3 x e4m3 widened: every product exact in float32
                    acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                elif IEEE:  # float32 models: no TF32 rounding of the inputs
                    acc += tl.dot(a, b.to(a.dtype), input_precision="ieee")
                else:
                    acc += tl.dot(a, b.to(a.dtype))
            if FP8:  # the product's scales: its column's weight scale, its row's input scale
                acc = acc * tl.load(b_scale_ptr + expert * N + n, mask=n_ok, other=0.0)[None, :]
                if A_FP8:
                    acc = acc * tl.load(a_scale_ptr + row, mask=valid, other=0.0)[:, None]
            if HAS_SCALE:
                acc = acc * tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
            out = c_ptr + tl.where(valid, pair, 0)[:, None] * N + n[None, :]
            tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
    return moe_gemm_kernel


class _Kernels:
    def __init__(self) -> None:
        triton_compat.patch_interpreter()
        self.gemm = _gemm_kernel()


@functools.cache
def _kernels() -> _Kernels:
    return _Kernels()
