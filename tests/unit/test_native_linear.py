"""The native bfloat16 linear kernel (engine/kernels/csrc/linear.c) against a float64 reference.

Tolerance: the kernel multiplies bfloat16 pairs exactly, sums in float32 and rounds once,
so |y - ref| <= half a bfloat16 step of ref (2**-8 relative: 8 significant bits) plus
the float32 summation error (at most K * 2**-24 * sum |x w|), checked elementwise. It needs AVX-512 BF16: on
another CPU it must say so (`has_linear` False, `pack_linear` None) and Linear keeps oneDNN.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native
from engine.model.linear import Linear


@pytest.fixture(scope="module")
def linear_kernels(kernels: native.NativeKernels) -> native.NativeKernels:
    if not kernels.has_linear:
        assert kernels.pack_linear(torch.ones(16, 16, dtype=torch.bfloat16)) is None
        pytest.skip("this CPU has no AVX-512 BF16: the linear kernel is not used here")
    return kernels


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (bias.double() if bias is not None else 0)
    magnitude = x64.abs() @ w64.abs().T + (bias.double().abs() if bias is not None else 0)
    bound = ref.abs() * 2**-8 + magnitude * x.shape[1] * 2**-24 + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g} at {(err - bound).argmax().item()}"


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 32, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 30), (64, 768), (80, 64), (1280, 768), (768, 2560)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_float64_reference(linear_kernels, rows, n, k, with_bias):
    """Every row-block remainder (rows mod 8) and tile-group remainder (N / 16 mod 3),
    one to many row blocks (the prefetching path), K from one pair to 2560."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    y = linear_kernels.linear(x, linear_kernels.pack_linear(w), bias)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    check(y, x, w, bias)


@pytest.mark.parametrize("rows", [1, 9, 32, 130])
@pytest.mark.parametrize("after_n,after_k", [(48, 30), (1280, 768), (768, 2560), (16, 2)])
def test_prefetching_the_next_linear_changes_no_output(linear_kernels, rows, after_n, after_k):
    """`after` only prefetches: the same bits with it as without, for next weights larger,
    smaller and with fewer tile groups than threads."""
    g = torch.Generator().manual_seed(rows + after_n)
    x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
    packed = linear_kernels.pack_linear(torch.randn(1280, 768, generator=g).to(torch.bfloat16))
    after = linear_kernels.pack_linear(torch.randn(after_n, after_k, generator=g).to(torch.bfloat16))
    assert torch.equal(linear_kernels.linear(x, packed, None, after), linear_kernels.linear(x, packed, None))


def test_the_model_chains_its_linears_in_call_order(linear_kernels, tmp_path):
    from engine.model.decoder import LlamaForCausalLM
    from engine.model.model_config import ModelConfig
    from engine.model.tiny_model import make_tiny_model

    make_tiny_model(tmp_path, arch="llama", size="tiny", seed=0)
    m = LlamaForCausalLM.load(str(tmp_path), ModelConfig.from_dir(tmp_path), torch.bfloat16, "cpu",
                              kernels=linear_kernels)
    order = [x for layer in m.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]
    assert m.linears() == order
    assert all(x.tiles is not None for x in order)
    assert all(a.after is b.tiles for a, b in zip(order, order[1:])) and m.lm_head.after is None


def test_strided_rows_and_no_rows(linear_kernels):
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(20, 200, generator=g).to(torch.bfloat16)
    x = wide[:, 40:168]  # rows 200 apart, 128 dense columns
    w = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    packed = linear_kernels.pack_linear(w)
    check(linear_kernels.linear(x, packed, None), x, w, None)
    assert linear_kernels.linear(x[:0], packed, None).shape == (0, 96)


def test_agrees_with_f_linear_to_a_bfloat16_step(linear_kernels):
    """Against torch's own bfloat16 matmul: mostly the same value, else one step apart, or
    as far apart as two float32 sums in different orders can be before the rounding."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 768, generator=g).to(torch.bfloat16)
    w = (torch.randn(2560, 768, generator=g) * 768**-0.5).to(torch.bfloat16)
    got, want = linear_kernels.linear(x, linear_kernels.pack_linear(w), None).float(), F.linear(x, w).float()
    magnitude = x.float().abs() @ w.float().abs().T
    assert ((got - want).abs() <= want.abs() * 2**-7 + 2 * magnitude * 768 * 2**-24).all()
    assert (got == want).float().mean() > 0.9


def test_pack_linear_declines_what_the_kernel_cannot_take(linear_kernels):
    assert linear_kernels.pack_linear(torch.ones(24, 16, dtype=torch.bfloat16)) is None  # N not a multiple of 16
    assert linear_kernels.pack_linear(torch.ones(16, 15, dtype=torch.bfloat16)) is None  # K odd
    assert linear_kernels.pack_linear(torch.ones(16, 16)) is None  # float32 stays with oneDNN
    packed = linear_kernels.pack_linear(torch.arange(32 * 4, dtype=torch.bfloat16).reshape(32, 4))
    assert packed.shape == (2, 2, 16, 2)
    # tile 1, pair 1, column 3 holds W[16 + 3][2:4]
    assert packed[1, 1, 3].tolist() == [(19 * 4 + 2), (19 * 4 + 3)]


def test_linear_refuses_mismatched_inputs(linear_kernels):
    packed = linear_kernels.pack_linear(torch.ones(32, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[rows, 8\]"):
        linear_kernels.linear(torch.ones(2, 6, dtype=torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        linear_kernels.linear(torch.ones(2, 8), packed, None)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        linear_kernels.linear(torch.ones(8, 2, dtype=torch.bfloat16).t(), packed, None)
    with pytest.raises(ValueError, match=r"bias must be contiguous bfloat16 \[32\]"):
        linear_kernels.linear(torch.ones(2, 8, dtype=torch.bfloat16), packed, torch.ones(16, dtype=torch.bfloat16))


def test_the_model_linear_takes_the_kernel_for_bfloat16_only(linear_kernels):
    w = torch.randn(64, 32).to(torch.bfloat16)
    b = torch.randn(64).to(torch.bfloat16)
    lin = Linear(w, b, prepack=True, kernels=linear_kernels)
    assert lin.tiles is not None and lin.packed is None and lin.weight is None
    x = torch.randn(5, 32).to(torch.bfloat16)
    check(lin(x), x, w, b)
    f32 = Linear(w.float(), None, prepack=True, kernels=linear_kernels)
    assert f32.tiles is None
    odd = Linear(torch.randn(24, 32).to(torch.bfloat16), None, prepack=True, kernels=linear_kernels)
    assert odd.tiles is None  # oneDNN (or F.linear) instead


def test_swiglu_order_interleaves_gate_and_up_by_eight():
    t = torch.arange(32)  # gate rows 0-15, up rows 16-31
    assert native.swiglu_order(t).tolist() == [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    w = torch.arange(32 * 3).reshape(32, 3)
    assert torch.equal(native.swiglu_order(w), w[native.swiglu_order(t)])


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 33, 130])
@pytest.mark.parametrize("inter,k", [(8, 2), (24, 30), (40, 64), (2560, 768)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_epilogue_equals_silu_mul_of_the_plain_product(linear_kernels, rows, inter, k, with_bias):
    """The fused activation is bit for bit silu_mul of the plain layout's output: every
    row-block remainder, tile groups of 1 to 3 tiles (inter 8, 24, 40), with and without
    a bias, gates large enough to reach silu's saturated ends."""
    g = torch.Generator().manual_seed(rows * 7 + inter + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * inter, k, generator=g) * 8 * k**-0.5).to(torch.bfloat16)
    bias = (torch.randn(2 * inter, generator=g) * 4).to(torch.bfloat16) if with_bias else None
    want = linear_kernels.silu_mul(linear_kernels.linear(x, linear_kernels.pack_linear(w), bias))
    fused_bias = native.swiglu_order(bias).contiguous() if with_bias else None
    got = linear_kernels.linear(x, linear_kernels.pack_linear(w, swiglu=True), fused_bias, swiglu=True)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_a_swiglu_linear_returns_the_activation_on_every_path(linear_kernels):
    """Native tiles, plain F.linear with the native silu_mul, and torch alone all return
    silu(gate) * up of their own product."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=g) * 0.5).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    tiles = Linear(w, b, prepack=True, kernels=linear_kernels, swiglu=True)
    assert tiles.tiles is not None
    assert torch.equal(tiles(x), linear_kernels.silu_mul(linear_kernels.linear(x, linear_kernels.pack_linear(w), b)))
    assert torch.equal(Linear(w, b, prepack=False, kernels=linear_kernels, swiglu=True)(x),
                       linear_kernels.silu_mul(F.linear(x, w, b)))
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    assert torch.equal(Linear(w, b, prepack=False, kernels=None, swiglu=True)(x), F.silu(gate) * up)
