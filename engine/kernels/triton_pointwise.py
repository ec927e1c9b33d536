"""The layer's elementwise passes on GPUs, in Triton, each one launch where the torch forms
take several (RMSNorm was pow/mean/rsqrt/mul and casts; rope slice/cat/mul/add, then an
`index_put_` into the pool):
- `add_rms_norm`: h += delta in place, then RMSNorm(h) * weight, one program per token;
- `rotary_store`: q and k rotated in place in the fused qkv, k and v written to their pool
  slots, one program per (token, head); a slot whose block is negative (a padded row of a
  CUDA graph's bucket) is not written;
- `silu_mul`: silu(gate) * up of the fused [gate | up] projection.
Each rounds where its torch form (engine/model/decoder.py `rms_norm`, engine/model/rope.py `apply_rotary`,
`F.silu(gate) * up`) rounds, so in float32 they agree to float rounding and in bfloat16
to a unit in the last place. Built at first launch (no Triton import before), checked
under Triton's interpreter on CPU (tests/unit/test_triton_kernels.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import triton_compat


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h, delta: [rows, dim] contiguous; weight [dim]. h += delta, returns RMSNorm(h) * weight."""
    import triton

    rows, dim = h.shape
    for name, t in (("h", h), ("delta", delta)):
        if t is not None and (not t.is_contiguous() or t.shape != h.shape or t.dtype != h.dtype):
            raise ValueError(f"{name} must be contiguous {h.dtype} {tuple(h.shape)}, got {t.dtype} {tuple(t.shape)}")
    out = torch.empty_like(h)
    if rows:
        block = triton.next_power_of_2(dim)
        _kernels().add_rms_norm[(rows,)](h, h if delta is None else delta, weight, out, dim, eps,
                                         HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block))
    return out


def rotary_store(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                 pool: torch.Tensor, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """qkv [tokens, (heads + 2 kv_heads) head_dim] (rows may be strided, columns dense); cos,
    signed_sin [tokens, 1, head_dim]; pool [blocks, layers, 2, block_size, kv_heads, head_dim]
    contiguous; slot_blocks, slot_offsets [tokens] (a negative block: no store)."""
    import triton

    tokens = qkv.shape[0]
    d = pool.shape[-1]
    if qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * d or pool.shape[-2] != kv_heads or d % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {heads} + 2 x {kv_heads} heads of the pool's {d}")
    if not pool.is_contiguous() or pool.dtype != qkv.dtype or cos.stride(2) != 1 or signed_sin.stride() != cos.stride():
        raise ValueError("the pool must be contiguous and of qkv's dtype, cos and sin dense alike")
    if tokens:
        _kernels().rotary_store[(tokens, heads + kv_heads)](
            qkv, cos, signed_sin, pool, slot_blocks, slot_offsets, qkv.stride(0), cos.stride(0),
            layer * pool.stride(1), pool.stride(0), pool.stride(2), pool.stride(3),
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, HALF_P2=triton.next_power_of_2(d // 2))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [rows, 2 I] contiguous; returns [rows, I]."""
    rows, two_i = gate_up.shape
    if not gate_up.is_contiguous() or two_i % 2:
        raise ValueError(f"gate_up must be contiguous [rows, 2 I], got {tuple(gate_up.shape)} strides {gate_up.stride()}")
    half = two_i // 2
    out = gate_up.new_empty(rows, half)
    if rows:
        block = 1024
        _kernels().silu_mul[(rows, -(-half // block))](gate_up, out, half, BLOCK=block)
    return out


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _add_rms_norm_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, out_ptr, dim, eps,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < dim
        at = row * dim + c
        h = tl.load(h_ptr + at, mask=ok, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(delta_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
            tl.store(h_ptr + at, h, mask=ok)
        x = h.to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
        y = (w.to(tl.float32) * x.to(h.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + at, y, mask=ok)
    return add_rms_norm_kernel


def _rotary_store_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pool_ptr, blocks_ptr, offsets_ptr, qkv_st, cos_st,
                            p_layer, p_sb, p_skv, p_st,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HALF_P2: tl.constexpr):
        t = tl.program_id(0)
        j = tl.program_id(1)  # q heads first, then kv heads
        half = HEAD_DIM // 2
        c = tl.arange(0, HALF_P2)
        ok = c < half
        head = qkv_ptr + t * qkv_st + j * HEAD_DIM
        x1 = tl.load(head + c, mask=ok, other=0.0)
        x2 = tl.load(head + half + c, mask=ok, other=0.0)
        dt = x1.dtype
        trig = t * cos_st
        cos1 = tl.load(cos_ptr + trig + c, mask=ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + trig + half + c, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + trig + c, mask=ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + trig + half + c, mask=ok, other=0.0).to(tl.float32)
        # x * cos + swapped * signed_sin, each product and the sum rounded to the dtype as torch does
        y1 = ((x1.to(tl.float32) * cos1).to(dt).to(tl.float32) + (x2.to(tl.float32) * sin1).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2.to(tl.float32) * cos2).to(dt).to(tl.float32) + (x1.to(tl.float32) * sin2).to(dt).to(tl.float32)).to(dt)
        tl.store(head + c, y1, mask=ok)
        tl.store(head + half + c, y2, mask=ok)
        if j >= HEADS:
            block = tl.load(blocks_ptr + t)
            if block >= 0:
                kvh = j - HEADS
                slot = pool_ptr + block * p_sb + p_layer + tl.load(offsets_ptr + t) * p_st + kvh * HEAD_DIM
                tl.store(slot + c, y1, mask=ok)
                tl.store(slot + half + c, y2, mask=ok)
                v = qkv_ptr + t * qkv_st + (HEADS + KV_HEADS + kvh) * HEAD_DIM
                tl.store(slot + p_skv + c, tl.load(v + c, mask=ok, other=0.0), mask=ok)
                tl.store(slot + p_skv + half + c, tl.load(v + half + c, mask=ok, other=0.0), mask=ok)
    return rotary_store_kernel


def _silu_mul_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < half
        g = tl.load(gu_ptr + row * 2 * half + c, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * 2 * half + half + c, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * half + c, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)
    return silu_mul_kernel


class _Kernels:
    def __init__(self) -> None:
        triton_compat.patch_interpreter()
        self.add_rms_norm = _add_rms_norm_kernel()
        self.rotary_store = _rotary_store_kernel()
        self.silu_mul = _silu_mul_kernel()


@functools.cache
def _kernels() -> _Kernels:
    return _Kernels()
