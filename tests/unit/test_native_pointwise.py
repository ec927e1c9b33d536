"""The native per-token kernels (engine/kernels/csrc/pointwise.c) against the torch code they replace.

rotary_store must equal engine/model/rope.py's apply_rotary followed by KVPool.write bit for
bit, in float32 and bfloat16. silu_mul: float32 within 4 ulp of torch (its exponential
differs from torch's by up to 2 ulp); bfloat16 the same value except where that moves the
silu across a rounding boundary (then one step).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.kv_pool import KVLayout, KVPool
from engine.model.model_config import RopeConfig
from engine.model.rope import RotaryTable, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 16), (5, 40), (32, 2560)])
def test_silu_mul_matches_torch(kernels, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -88.5, -87.5, -1e-3, 0.0, 87.5, 100.0, 3.0]).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4 * 2**-23, atol=1e-30)
    else:
        off = got != want
        assert off.float().mean() < 0.001
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7)[off].all()


def test_silu_mul_keeps_torch_special_values(kernels):
    gate = torch.tensor([[float("-inf"), float("inf"), float("nan"), -1e30, 1e30, -0.0]])
    got = kernels.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    want = F.silu(gate)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_silu_mul_refuses_what_it_cannot_take(kernels):
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        kernels.silu_mul(torch.ones(4, 6).t())
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        kernels.silu_mul(torch.ones(2, 5))
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        kernels.silu_mul(torch.ones(2, 4, dtype=torch.float16))


def setup(dtype, heads, kv_heads, d, tokens, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * d
    qkv = (torch.randn(tokens, width + pad, generator=g) * 3).to(dtype)[:, :width]  # rows `pad` apart
    table = RotaryTable(RopeConfig(theta=10000.0), d, 256, "cpu")
    cos, sin = table.lookup(torch.randint(0, 256, (tokens,), generator=g), dtype)
    pool = KVPool(KVLayout(3, 4, kv_heads, d, dtype), 12, "cpu")
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=g))
    slots = torch.randperm(12 * 4, generator=g)[:tokens]
    return qkv, cos, sin, pool, slots // 4, slots % 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 8), (12, 4, 64), (8, 8, 16), (8, 1, 128)])
@pytest.mark.parametrize("pad", [0, 24])
def test_rotary_store_equals_apply_rotary_then_write_bit_for_bit(kernels, dtype, heads, kv_heads, d, pad):
    tokens = 7
    qkv, cos, sin, pool, blocks, offsets = setup(dtype, heads, kv_heads, d, tokens, pad)
    want_pool = KVPool(pool.layout, pool.num_blocks, "cpu")
    want_pool.tensor.copy_(pool.tensor)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos, sin)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    want_pool.write(2, blocks, offsets, qk[:, heads:], v)
    want_qk, want_v = qk.clone(), v.clone()

    kernels.rotary_store(qkv, heads, kv_heads, cos, sin, pool.tensor, 2, blocks, offsets)
    assert torch.equal(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), want_qk)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d), want_v)
    assert torch.equal(pool.tensor, want_pool.tensor)  # the slots written, every other byte untouched


def test_rotary_store_refuses_out_of_range_slots_before_writing(kernels):
    qkv, cos, sin, pool, blocks, offsets = setup(torch.float32, 4, 2, 8, 3)
    before_qkv, before_pool = qkv.clone(), pool.tensor.clone()
    for bad_blocks, bad_offsets in ((torch.tensor([0, 12, 1]), offsets), (blocks, torch.tensor([0, 4, 1])),
                                    (torch.tensor([0, -1, 1]), offsets)):
        with pytest.raises(ValueError, match="out of range"):
            kernels.rotary_store(qkv, 4, 2, cos, sin, pool.tensor, 0, bad_blocks, bad_offsets)
    assert torch.equal(qkv, before_qkv) and torch.equal(pool.tensor, before_pool)


def test_rotary_store_refuses_mismatched_tensors(kernels):
    qkv, cos, sin, pool, blocks, offsets = setup(torch.float32, 4, 2, 8, 3)
    with pytest.raises(ValueError, match="does not hold"):
        kernels.rotary_store(qkv, 5, 2, cos, sin, pool.tensor, 0, blocks, offsets)
    with pytest.raises(ValueError, match="cos must be"):
        kernels.rotary_store(qkv, 4, 2, cos[:2], sin, pool.tensor, 0, blocks, offsets)
    with pytest.raises(ValueError, match="layer 3"):
        kernels.rotary_store(qkv, 4, 2, cos, sin, pool.tensor, 3, blocks, offsets)
    with pytest.raises(ValueError, match="does not take"):
        kernels.rotary_store(qkv.bfloat16(), 4, 2, cos.bfloat16(), sin.bfloat16(), pool.tensor, 0, blocks, offsets)
    with pytest.raises(ValueError, match="slot_blocks must be contiguous int64"):
        kernels.rotary_store(qkv, 4, 2, cos, sin, pool.tensor, 0, blocks.int(), offsets)
