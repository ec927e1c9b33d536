"""Paged attention for short queries (decodes) on GPUs, in Triton: it reads each request's K
and V where they lie in the block-major pool, so nothing is gathered or padded.

The same contract as the CPU's native kernel (`NativeKernels.paged_attention`): for each
token of `token_index`, attend its query heads over the first `ctx_lens` keys of its row of
`block_table`, writing `out[token]`. One program per (token, KV head): the program loads
that KV head's group of query heads once, walks the context a block at a time (one block
of K and one of V per iteration, straight from the pool) and keeps a running softmax in
float32 (FlashAttention's rescaling), so memory traffic is the context read once per KV
head. Long contexts at small batch are few programs (no split of the context yet): what
that costs, and whether a split pays, is for a GPU run to show (benchmarks/gpu_check.py).

Optional: None of this is imported without Triton (`load()` returns None), and the torch
forms in engine/attention.py stay the reference. Checked on CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, tests/unit/test_triton_attention.py) where Triton is installed.
"""
from __future__ import annotations

from typing import Any

import torch


def load() -> Any:
    """The kernel's launcher (`paged_attention`), or None where Triton cannot be imported."""
    try:
        import triton
    except Exception:  # absent, or broken: the torch forms serve
        return None
    return TritonKernels(triton.__version__)


class TritonKernels:
    def __init__(self, version: str) -> None:
        self.version = version

    def paged_attention(self, q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                        token_index: torch.Tensor, rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                        out: torch.Tensor) -> None:
        """q, out: [num_tokens, heads, head_dim] (head_dim contiguous); pool: [blocks, layers, 2,
        block_size, kv_heads, head_dim] contiguous; block_table [rows, max_blocks], token_index,
        rows, ctx_lens [n] int64 (every ctx_len >= 1)."""
        _launch(q, pool, layer, block_table, token_index, rows, ctx_lens, scale, out)


def _launch(q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor, token_index: torch.Tensor,
            rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    import triton

    heads, head_dim = q.shape[1], q.shape[2]
    _, _, _, block_size, kv_heads, pool_head_dim = pool.shape
    if pool_head_dim != head_dim or heads % kv_heads or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not match pool {tuple(pool.shape)} with dense heads")
    if not pool.is_contiguous() or block_table.dtype != torch.int64:
        raise ValueError("the pool must be contiguous and the block table int64")
    group = heads // kv_heads
    n = token_index.numel()
    if n == 0:
        return
    _paged_decode[(n, kv_heads)](
        q, pool, block_table, token_index, rows, ctx_lens, out,
        layer, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
        block_table.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), BLOCK_SIZE=block_size,
        BLOCK_SIZE_P2=triton.next_power_of_2(block_size), HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
    )


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(q_ptr, pool_ptr, table_ptr, tokens_ptr, rows_ptr, ctx_ptr, out_ptr,
                     layer, scale,
                     q_st, q_sh, o_st, o_sh,
                     p_sb, p_sl, p_skv, p_st, p_sh,
                     t_sr,
                     GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_SIZE_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
        i = tl.program_id(0)
        kvh = tl.program_id(1)
        token = tl.load(tokens_ptr + i)
        row = tl.load(rows_ptr + i)
        ctx = tl.load(ctx_ptr + i)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        t = tl.arange(0, BLOCK_SIZE_P2)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + token * q_st + heads[:, None] * q_sh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
        m = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
        base = pool_ptr + layer * p_sl + kvh * p_sh
        for j in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
            block = tl.load(table_ptr + row * t_sr + j)
            keys_ok = (t < BLOCK_SIZE) & (j * BLOCK_SIZE + t < ctx)
            where = base + block * p_sb + t[:, None] * p_st + d[None, :]
            kv_mask = keys_ok[:, None] & d_ok[None, :]
            k = tl.load(where, mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
            v = tl.load(where + p_skv, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, T]
            s = tl.where(keys_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        o = acc / l_sum[:, None]
        tl.store(out_ptr + token * o_st + heads[:, None] * o_sh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])

    return paged_decode


class _Lazy:
    """The jitted kernel, built at first launch (so importing this module needs no Triton)."""

    fn: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if _Lazy.fn is None:
            _Lazy.fn = _kernel()
        return _Lazy.fn[grid]


_paged_decode = _Lazy()
