"""FP8 weights: the checkpoint schemes read from config.json (and those refused, by name), the
e4m3 quantizers, and an FP8 projection against a float64 reference of its formula,
y = (x_q @ w_q.T) * x_scale * w_scale (+ bias), through every matmul form we have (the GPU's
`torch._scaled_mm` call included: torch runs it on CPU too)."""
from __future__ import annotations

import pytest
import torch

from engine.model.fp8 import (E4M3, E4M3_MAX, Fp8Weight, channel_scale, dequantize, quantize_input, quantize_weight,
                              to_e4m3)
from engine.model.linear import Linear
from engine.kernels.native import load as load_native
from engine.checkpoints.quant_config import Fp8Scheme, kv_model_id, served_name
from engine.types import UnsupportedModelError

CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                    "symmetric": True, "dynamic": False},
                                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                              "dynamic": True}}}}


def compressed(weights: dict | None = None, inputs: dict | None | str = "same", **extra: object) -> dict:
    group = dict(CT_FP8["config_groups"]["group_0"])
    if weights is not None:
        group["weights"] = {**group["weights"], **weights}
    if inputs != "same":
        group["input_activations"] = None if inputs is None else {**group["input_activations"], **inputs}
    return {**CT_FP8, "config_groups": {"group_0": group}, **extra}


@pytest.mark.parametrize("quant,want", [
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
     Fp8Scheme("fp8", "tensor", "static", ("lm_head",))),
    ({"quant_method": "fp8"}, Fp8Scheme("fp8", "tensor", "dynamic")),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
     Fp8Scheme("fbgemm_fp8", "channel", "dynamic", ("lm_head",), scale_ub=1200.0)),
    (CT_FP8, Fp8Scheme("compressed-tensors", "channel", "dynamic", ("lm_head",))),
    (compressed({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}),
     Fp8Scheme("compressed-tensors", "tensor", "static", ("lm_head",))),
    (compressed(inputs=None), Fp8Scheme("compressed-tensors", "channel", "weights_only", ("lm_head",))),
])
def test_the_fp8_schemes_hugging_face_writes_are_read(quant: dict, want: Fp8Scheme) -> None:
    assert Fp8Scheme.of(quant) == want


@pytest.mark.parametrize("quant,names", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
    ({"quant_method": "awq", "bits": 4}, r"\(awq\)"),
    ({"quant_method": "gptq"}, r"\(gptq\)"),
    (compressed({"type": "int", "num_bits": 8}), "int 8-bit weights"),
    (compressed({"strategy": "group", "group_size": 128}), "weight strategy 'group'"),
    (compressed(inputs={"strategy": "group"}), "input strategy 'group'"),
    (compressed(inputs={"type": "int"}), "int 8-bit inputs"),
    ({**CT_FP8, "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**CT_FP8, "config_groups": {}}, "without config_groups"),
    ({"quant_method": "fp8", "activation_scheme": "per-group"}, "activation_scheme 'per-group'"),
    ("fp8", "not a map"),
])
def test_other_schemes_are_refused_by_name(quant: object, names: str) -> None:
    with pytest.raises(UnsupportedModelError, match=names):
        Fp8Scheme.of(quant)


def test_ignored_modules_match_by_name_suffix_or_pattern() -> None:
    scheme = Fp8Scheme("compressed-tensors", "channel", "dynamic", ("lm_head", "re:.*\\.mlp\\.down_proj"))
    assert not scheme.covers("lm_head") and not scheme.covers("model.layers.3.mlp.down_proj")
    assert scheme.covers("model.layers.3.mlp.gate_proj") and scheme.covers("model.layers.0.self_attn.q_proj")
    assert kv_model_id("m", Fp8Scheme.loading()) == "m+fp8"  # quantized here: not the checkpoint's KV
    assert kv_model_id("m", scheme) == "m" and kv_model_id("m", None) == "m"
    assert kv_model_id("m", Fp8Scheme.loading(), "fp8") == "m+fp8+kv-fp8"
    assert served_name("m+fp8+kv-fp8") == served_name("m+kv-fp8") == served_name("m") == "m"  # clients ask for "m"


def test_quantized_values_are_e4m3_and_within_a_sixteenth() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    q = quantize_weight(w)
    assert q.values.dtype == E4M3 and q.scale.shape == (48,) and q.scale.dtype == torch.float32
    assert torch.equal(q.values.float().abs().amax(dim=1), torch.full((48,), E4M3_MAX))  # each row's largest: 448
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself (subnormals by 2^-10)
    err = (dequantize(q) - w).abs()
    assert bool((err <= w.abs() / 16 + q.scale[:, None] * 2.0**-9).all())
    x = torch.randn(5, 64, generator=g)
    x[2] = 0.0  # a zero row: zeros, not NaN
    xq, s = quantize_input(x)
    assert xq.dtype == E4M3 and s.shape == (5, 1) and torch.equal(xq[2].float(), torch.zeros(64))
    assert bool(((xq.float() * s - x).abs() <= x.abs() / 16 + s * 2.0**-9).all())
    xq, s = quantize_input(x * 100, static=0.01)  # a static scale saturates at +-448, never NaN
    assert float(xq.float().abs().max()) == E4M3_MAX and bool(torch.isfinite(xq.float()).all())
    _, s = quantize_input(x, ub=0.5)
    assert bool((s <= 0.5 / E4M3_MAX).all())
    assert torch.equal(to_e4m3(torch.tensor([1e9, -1e9])).float(), torch.tensor([E4M3_MAX, -E4M3_MAX]))
    assert torch.equal(channel_scale(torch.tensor(0.5), 3), torch.full((3,), 0.5))
    assert torch.equal(channel_scale(torch.tensor([[1.0], [2.0]]), 2), torch.tensor([1.0, 2.0]))
    with pytest.raises(UnsupportedModelError, match="3 values for 2 output channels"):
        channel_scale(torch.ones(3), 2)


def reference(x: torch.Tensor, q: Fp8Weight, inputs: str, bias: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    """The formula in float64, from first principles."""
    xd = x.double()
    if inputs == "weights_only":
        xs = xd
    else:
        s = (torch.full((x.shape[0], 1), q.input_scale, dtype=torch.float64) if inputs == "static"
             else (xd.abs().amax(dim=1, keepdim=True) / 448.0))
        xs = (xd / s).clamp(-448, 448).float().to(E4M3).double() * s
    y = xs @ (q.values.double() * q.scale.double()[:, None]).T
    if bias is not None:
        y = y + bias.double()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "onednn", "native", "scaled_mm"])
@pytest.mark.parametrize("inputs", ["dynamic", "static", "weights_only"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_an_fp8_projection_computes_its_formula_in_every_matmul_form(dtype: torch.dtype, form: str, inputs: str,
                                                                    swiglu: bool) -> None:
    kernels = load_native() if form == "native" else None
    if form == "native" and (kernels is None or not kernels.has_linear or dtype != torch.bfloat16):
        pytest.skip("the native matmul takes bfloat16 on CPUs with AVX-512 BF16")
    g = torch.Generator().manual_seed(1)
    out, inp, rows = 64, 96, 7
    q = quantize_weight(torch.randn(out, inp, generator=g) * 0.1)
    q.input_scale = 0.02 if inputs == "static" else None
    bias = torch.randn(out, generator=g).to(dtype)
    x = (torch.randn(rows, inp, generator=g) * 2).to(dtype)
    lin = Linear(q.values.to(dtype), bias, form != "plain", kernels, swiglu, Fp8Weight(q.values.to(dtype), q.scale,
                                                                                     q.input_scale), inputs)
    if form == "native":
        assert lin.tiles is not None
    if form == "scaled_mm":  # the GPU's call, as a CUDA device takes it (torch's CPU runs it too)
        if inputs == "weights_only" or dtype != torch.bfloat16:
            pytest.skip("the GPU path: FP8 inputs, bfloat16 out")
        lin.w8 = q.values
    want = reference(x, q, inputs, bias, swiglu)
    got = lin(x).double()
    assert got.shape == want.shape
    # the same e4m3 products summed in float32; in bfloat16 the product, its scaling and the bias
    # add are each rounded to 8 bits, in float16 to 11 (outputs here are of order 1; float16's
    # product of raw e4m3 values would overflow: fp8.FLOAT16_SHIFT)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("inputs", ["dynamic", "static", "weights_only"])
def test_fp8_experts_in_float16_do_not_overflow_and_give_the_float32_output(inputs: str) -> None:
    """The torch form of FP8 experts in float16: raw e4m3 products (up to 448 x 448 each) would
    pass float16's largest value; shifted (quantized inputs) or dequantized (weights_only) they
    do not."""
    from engine.model import moe
    from engine.model.model_config import MoEConfig

    g = torch.Generator().manual_seed(2)
    num, hidden, inter, tokens = 4, 256, 128, 9
    gate_up, down, parts = moe._quantized_stacked(torch.randn(num, 2 * inter, hidden, generator=g) * 0.05,
                                                 torch.randn(num, hidden, inter, generator=g) * 0.05)
    q = moe.Fp8Experts(gate_up=torch.stack([torch.cat([a.scale, b.scale]) for a, b, _ in parts]),
                       down=torch.stack([d.scale for _, _, d in parts]), inputs=inputs)
    if inputs == "static":
        q.gate_up_input, q.down_input = torch.full((num,), 0.01), torch.full((num,), 0.002)
    router, x = torch.randn(num, hidden, generator=g), torch.randn(tokens, hidden, generator=g) * 2
    config = MoEConfig(num, 2, inter, True, (0,), 0)
    out = {dtype: moe.moe_forward(x.to(dtype), moe.MoEWeights(router.to(dtype), gate_up.to(dtype), down.to(dtype),
                                                               fp8=q), config).float()
           for dtype in (torch.float32, torch.float16)}
    assert out[torch.float16].isfinite().all()
    # an input requantized to e4m3 may round the other way after float16's rounding upstream (a
    # step of 1/16): the mean and the largest difference are checked, not each element
    diff, size = (out[torch.float16] - out[torch.float32]).abs(), out[torch.float32].abs()
    assert (diff.mean() / size.mean()).item() < 0.03 and (diff.max() / size.max()).item() < 0.05


def test_the_grouped_gemm_takes_e4m3_operands_on_gpus_of_capability_8_9_and_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What only CUDA answers (the device's compute capability), injected: e4m3 x e4m3 in tl.dot
    on Ada and Hopper, widened to float32 on an A100; Triton's interpreter takes it on CPU."""
    from engine.kernels import triton_moe

    for capability, fp8_dot in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert triton_moe._fp8_tensor_cores(torch.device("cuda", 0)) is fp8_dot
    assert triton_moe._fp8_tensor_cores(torch.device("cpu"))
