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

The reference is `engine.model.moe.moe_forward` (one GEMM per expert touched, tokens grouped by
expert); they differ by float rounding (the order of the k terms of a token's sum).
Checked under Triton's interpreter on CPU (tests/unit/test_triton_kernels.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import triton_compat, triton_pointwise
from engine.model.model_config import MoEConfig
from engine.model.moe import MoEWeights, add_shared_expert, route

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
    gate_up = x.new_empty(pairs, inter2)
    _gemm(x, w.gate_up, gate_up, None, sorted_pairs, block_experts, pairs, config.top_k)
    act = triton_pointwise.silu_mul(gate_up)  # [pairs, I]
    down = x.new_empty(pairs, hidden)
    _gemm(act, w.down, down, weights.flatten().contiguous(), sorted_pairs, block_experts, pairs, 1)
    out = down.view(tokens, config.top_k, hidden).sum(dim=1)
    add_shared_expert(out, x, w)
    return out


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor | None, sorted_pairs: torch.Tensor,
          block_experts: torch.Tensor, pairs: int, rows_per_a: int) -> None:
    """c[pair] = a[pair // rows_per_a] @ b[expert of pair]^T (times scale[pair]) for every pair."""
    import triton

    n, k = b.shape[1], b.shape[2]
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()) or a.shape[1] != k:
        raise ValueError(f"moe gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must be contiguous and agree on K")
    if not pairs:
        return
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _kernels().gemm[grid](a, b, c, c if scale is None else scale, sorted_pairs, block_experts, n, k, pairs,
                          b.stride(0), b.stride(1), ROWS_PER_A=rows_per_a, HAS_SCALE=scale is not None,
                          IEEE=a.dtype == torch.float32,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def _gemm_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, pairs_ptr, experts_ptr, N, K, num_pairs, b_se, b_sn,
                        ROWS_PER_A: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
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
                if IEEE:  # float32 models: no TF32 rounding of the inputs
                    acc += tl.dot(a, b, input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
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
