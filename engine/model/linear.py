"""Linear layers with weights laid out once, at load time, for the device's fastest matmul.

On CPU, bfloat16 weights go to the native kernel's tile layout where the CPU has
AVX-512 BF16 (engine/kernels/csrc/linear.c: it overlaps the weight stream with compute, about
20 % faster than oneDNN at decode batch sizes, no slower at prefill sizes). Otherwise the
weight is reordered into oneDNN's blocked layout, so no step pays for the layout
conversion that `F.linear` does on every call: decode matmuls run about twice as fast in
bfloat16 and three times in float32 on this project's machines
(`benchmarks/engine/engine_throughput.py`). Results equal `F.linear` up to float rounding.
Where oneDNN can't take the dtype on this CPU (float16 without AVX-512 FP16) or on
other devices, the plain weight and `F.linear` are kept.

An FP8 projection (`fp8`, engine/model/fp8.py) quantizes its input to e4m3 and scales the
product by the input's and the weight's scales: one `torch._scaled_mm` on GPUs; on CPU the
e4m3 values, exact in the model's dtype, go through the matmul above, the scales after it
(and the bias and SwiGLU after them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.fp8 import E4M3, Fp8Weight, fp8_product, quantize_input
from engine.kernels.native import NativeKernels, swiglu_order


class Linear:
    """y = x @ weight.T + bias for x of shape [num_tokens, in_features].

    swiglu: weight (and bias) are an MLP's [gate; up] projections, 2 I rows, and a call
    returns the activation silu(gate) * up, [num_tokens, I]: in the native kernel's
    epilogue where the weight is in its tiles, else after the product (`silu_mul`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool,
                 kernels: NativeKernels | None = None, swiglu: bool = False, fp8: Fp8Weight | None = None,
                 fp8_inputs: str = "dynamic", scale_ub: float | None = None) -> None:
        """`fp8`: the weight is FP8 (`weight` its e4m3 values in the model's dtype; the scales
        here); `fp8_inputs`: dynamic, static (`fp8.input_scale`) or weights_only; `scale_ub`: a
        dynamic input scale's cap."""
        self.out_features, self.in_features = weight.shape
        self.fp8 = fp8
        self.fp8_inputs = fp8_inputs
        self.scale_ub = scale_ub
        self.w8: torch.Tensor | None = None
        """GPU: the FP8 weight as e4m3 [out, in], for `torch._scaled_mm`."""
        on_gpu = weight.device.type == "cuda"
        if fp8 is not None and fp8_inputs != "weights_only" and on_gpu and _scaled_mm_fits(weight):
            self.w8 = weight.to(E4M3)
        if fp8 is not None and fp8_inputs == "weights_only":  # 16-bit inputs: the weight dequantized once
            weight = (weight.float() * fp8.scale[:, None]).to(weight.dtype)
            self.fp8 = None
        self.nbytes = weight.numel() * weight.element_size() if self.w8 is None else self.w8.numel()
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()
        self.bias = bias
        self.kernels = kernels
        self.swiglu = swiglu
        fused = swiglu and self.fp8 is None  # FP8 scales the product first: SwiGLU comes after
        packable = prepack and kernels is not None and self.w8 is None
        self.tiles = kernels.pack_linear(weight, fused) if packable else None
        if self.tiles is not None and bias is not None and self.fp8 is None:
            self.bias = (swiglu_order(bias) if swiglu else bias).contiguous()
        on_cpu = prepack and weight.device.type == "cpu"
        self.packed = _prepack(weight) if self.tiles is None and on_cpu else None
        self.weight = weight if self.tiles is None and self.packed is None and self.w8 is None else None
        self.after: torch.Tensor | None = None
        """The tiles of the linear that runs after this one (see `runs_before`)."""

    def runs_before(self, other: Linear) -> None:
        """`other` is the next linear the model calls: this one's kernel prefetches the start
        of its weights while finishing (both must be native tile layouts)."""
        self.after = other.tiles if self.tiles is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self._fp8(x)
        if self.tiles is not None:
            assert self.kernels is not None
            return self.kernels.linear(x, self.tiles, self.bias, self.after, self.swiglu)
        y = self._product(x, self.bias)
        return self._silu_mul(y) if self.swiglu else y

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tiles is not None:
            assert self.kernels is not None
            return self.kernels.linear(x, self.tiles, bias, self.after)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        """(x_q @ w_q.T) * x_scale * w_scale (+ bias), then SwiGLU where fused."""
        fp8 = self.fp8
        assert fp8 is not None
        if self.w8 is not None:  # tensor cores: float32 accumulation, scaled on the way out
            static = fp8.input_scale if self.fp8_inputs == "static" else None
            xq, x_scale = quantize_input(x, static, self.scale_ub)
            y = torch._scaled_mm(xq, self.w8.t(), scale_a=x_scale, scale_b=fp8.scale[None, :], out_dtype=x.dtype)
        else:  # the same e4m3 values, upcast (exact), through the matmul: the GPU's reference
            y = fp8_product(x, lambda v: self._product(v, None), fp8.scale, self.fp8_inputs, fp8.input_scale,
                            self.scale_ub)
        if self.bias is not None:
            y = y + self.bias
        return self._silu_mul(y) if self.swiglu else y

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _scaled_mm_fits(weight: torch.Tensor) -> bool:
    """torch._scaled_mm's shape rule: both of the weight's sides multiples of 16."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:  # this CPU's oneDNN has no kernel for the dtype
        return None
