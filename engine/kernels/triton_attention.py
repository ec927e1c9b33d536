"""Paged attention for short queries (decodes, speculative verification) on GPUs, in Triton,
split along the context (flash-decoding): it reads each request's K and V where they lie in
the block-major pool, so nothing is gathered or padded.

The same contract as the CPU's native kernel (`NativeKernels.paged_attention`): for each
token of `token_index`, attend its query heads over the first `ctx_lens` keys of its row of
`block_table`, writing `out[token]`. Two launches:
- `_partial`, one program per (token, KV head, split): the split's share of the context, a
  tile of `TILE` keys at a time (each key's block looked up in the table, so any block size
  works), q·K and P·V on the tensor cores (`tl.dot`, the KV head's query-head group padded
  to 16 rows), a running softmax in float32 (FlashAttention's rescaling). It writes the
  split's running max `m`, sum `l` and unnormalised output `acc` to float32 scratch.
- `_reduce`, one program per (token, query head): rescales the splits to their common max
  and writes `sum(acc) / sum(l)` in the output dtype. With one split (a large batch covers
  the GPU by itself) the first kernel writes the output and this one is not launched.
A batch of one over a long context is thus spread over many programs (`num_splits`, chosen
so the grid covers the GPU's multiprocessors twice), where one program per (token, KV head)
left 124 of an H100's 132 idle. A split with no keys (a short context, or a padded row of a
CUDA graph's bucket, ctx_len 0) leaves m = -inf, l = 0 and is weighed 0; a row with no keys
at all gets zeros. An FP8 pool (e4m3) is read as it is and widened to q's dtype in registers,
its layer's K scale folded into the score scale and its V scale into the output.

Optional: nothing here imports Triton until a kernel is launched (`load()` returns None
without it), and the torch forms in engine/model/attention.py stay the reference. Checked on CPU
under Triton's interpreter (`TRITON_INTERPRET=1`, tests/unit/test_triton_kernels.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import triton_compat

TILE = 64
"""Keys per iteration of a split (a power of two, at least 16 for `tl.dot`)."""
MAX_SPLITS = 64


def num_splits(num_tokens: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (token, KV head): enough programs to cover the multiprocessors twice, no
    more than the longest context has tiles, at least one."""
    want = -(-2 * num_sms // max(num_tokens * kv_heads, 1))
    return max(1, min(want, -(-max_context // TILE), MAX_SPLITS))


def paged_decode(q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                 token_index: torch.Tensor, rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                 out: torch.Tensor, splits: int, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
    """q, out: [num_tokens, heads, head_dim] (head_dim contiguous); pool: [blocks, layers, 2,
    block_size, kv_heads, head_dim] contiguous; block_table [rows, max_blocks]; token_index,
    rows, ctx_lens [n] int64 (a ctx_len of 0 gives zeros). With a `window`, each query attends
    to the last `window` of its keys (the table entries before those are not read); with a
    `softcap`, scores s become softcap * tanh(s / softcap). An e4m3 pool holds K / k_scale and
    V / v_scale (engine/model/kv_pool.py)."""
    import triton

    heads, head_dim = q.shape[1], q.shape[2]
    _, _, _, block_size, kv_heads, pool_head_dim = pool.shape
    if pool_head_dim != head_dim or heads % kv_heads or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not match pool {tuple(pool.shape)} with dense heads")
    if not pool.is_contiguous() or block_table.stride(1) != 1:
        raise ValueError("the pool must be contiguous and the block table's rows dense")
    n = token_index.numel()
    if n == 0:
        return
    group = heads // kv_heads
    if splits > 1:
        m = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(n, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    else:  # one split: the partial kernel writes the output itself, no scratch and no reduce
        m = l_sum = acc = out
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    kernels = _kernels()
    kernels.partial[(n, kv_heads, splits)](
        q, pool, block_table, token_index, rows, ctx_lens, m, l_sum, acc, out,
        layer, scale * k_scale, v_scale, window, softcap if softcap > 0 else 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
        block_table.stride(0),
        SPLITS=splits, GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2, TILE=TILE, IEEE=q.dtype == torch.float32, SOFTCAP=softcap > 0,
        KV_FP8=pool.dtype == torch.float8_e4m3fn,
    )
    if splits == 1:
        return
    kernels.reduce[(n, heads)](
        m, l_sum, acc, token_index, out, out.stride(0), out.stride(1),
        HEADS=heads, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2,
    )


def _partial() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def partial(q_ptr, pool_ptr, table_ptr, tokens_ptr, rows_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                layer, scale, v_scale, window, softcap,
                q_st, q_sh, o_st, o_sh,
                p_sb, p_sl, p_skv, p_st, p_sh,
                t_sr,
                SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
                SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
        i = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        token = tl.load(tokens_ptr + i)
        row = tl.load(rows_ptr + i)
        ctx = tl.load(ctx_ptr + i)
        first_key = tl.where((window > 0) & (ctx > window), ctx - window, 0)  # a sliding window's start
        lo_tile = first_key // TILE
        num_tiles = tl.cdiv(ctx, TILE)
        tiles_per_split = tl.cdiv(num_tiles - lo_tile, SPLITS)
        first_tile = lo_tile + split * tiles_per_split
        end = (first_tile + tiles_per_split) * TILE
        end = tl.where(end < ctx, end, ctx)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        t = tl.arange(0, TILE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + token * q_st + heads[:, None] * q_sh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D]
        m = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
        base = pool_ptr + layer * p_sl + kvh * p_sh
        for j in range(first_tile, tl.where(first_tile + tiles_per_split < num_tiles,
                                            first_tile + tiles_per_split, num_tiles)):
            pos = j * TILE + t
            ok = (pos < end) & (pos >= first_key)
            block = tl.load(table_ptr + row * t_sr + pos // BLOCK_SIZE, mask=ok, other=0)
            where = base + block[:, None] * p_sb + (pos % BLOCK_SIZE)[:, None] * p_st + d[None, :]
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(where, mask=kv_mask, other=0.0)  # [T, D]
            if KV_FP8:  # e4m3 widened in registers (the K scale is in `scale`)
                k = k.to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if SOFTCAP:  # softcap * tanh(s / softcap), tanh as 2 sigmoid(2 x) - 1
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
            s = tl.where(ok[None, :], s, float("-inf"))  # [G, T] float32
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(where + p_skv, mask=kv_mask, other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if KV_FP8:  # the V scale, once
            acc = acc * v_scale
        if SPLITS == 1:  # the whole context: normalise and write the output (no keys: zeros)
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(out_ptr + token * o_st + heads[:, None] * o_sh + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=g_ok[:, None] & d_ok[None, :])
        else:
            at = (i * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # [n, heads, splits]
            tl.store(m_ptr + at, m, mask=g_ok)
            tl.store(l_ptr + at, l_sum, mask=g_ok)
            tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    return partial


def _reduce() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def reduce(m_ptr, l_ptr, acc_ptr, tokens_ptr, out_ptr, o_st, o_sh,
               HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        s_ok = s < SPLITS
        d_ok = d < HEAD_DIM
        at = (i * HEADS + h) * SPLITS + s
        m = tl.load(m_ptr + at, mask=s_ok, other=float("-inf"))
        l_sum = tl.load(l_ptr + at, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # no keys anywhere: every weight is 0
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(w * l_sum, axis=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
        token = tl.load(tokens_ptr + i)
        tl.store(out_ptr + token * o_st + h * o_sh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    return reduce


class _Kernels:
    def __init__(self) -> None:
        triton_compat.patch_interpreter()
        self.partial = _partial()
        self.reduce = _reduce()


@functools.cache
def _kernels() -> _Kernels:
    """Built at first launch, so importing this module needs no Triton and a test's
    TRITON_INTERPRET, set before then, picks the interpreter."""
    return _Kernels()


def load() -> Any:
    """Whether Triton imports here: its version, or None."""
    try:
        import triton
    except Exception:  # absent, or broken: the torch forms serve
        return None
    return triton.__version__
