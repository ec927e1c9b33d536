"""Linear layers with weights laid out once, at load time, for the device's fastest matmul.

On CPU, bfloat16 weights go to the native kernel's tile layout where the CPU has
AVX-512 BF16 (engine/csrc/linear.c: it overlaps the weight stream with compute, about
20 % faster than oneDNN at decode batch sizes, no slower at prefill sizes). Otherwise the
weight is reordered into oneDNN's blocked layout, so no step pays for the layout
conversion that `F.linear` does on every call: decode matmuls run about twice as fast in
bfloat16 and three times in float32 on this project's machines
(`benchmarks/engine_throughput.py`). Results equal `F.linear` up to float rounding.
Where oneDNN can't take the dtype on this CPU (float16 without AVX-512 FP16) or on
other devices, the plain weight and `F.linear` are kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.native import NativeKernels, swiglu_order


class Linear:
    """y = x @ weight.T + bias for x of shape [num_tokens, in_features].

    swiglu: weight (and bias) are an MLP's [gate; up] projections, 2 I rows, and a call
    returns the activation silu(gate) * up, [num_tokens, I]: in the native kernel's
    epilogue where the weight is in its tiles, else after the product (`silu_mul`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool,
                 kernels: NativeKernels | None = None, swiglu: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()
        self.bias = bias
        self.kernels = kernels
        self.swiglu = swiglu
        self.tiles = kernels.pack_linear(weight, swiglu) if prepack and kernels is not None else None
        if self.tiles is not None and bias is not None:
            self.bias = (swiglu_order(bias) if swiglu else bias).contiguous()
        on_cpu = prepack and weight.device.type == "cpu"
        self.packed = _prepack(weight) if self.tiles is None and on_cpu else None
        self.weight = weight if self.tiles is None and self.packed is None else None
        self.after: torch.Tensor | None = None
        """The tiles of the linear that runs after this one (see `runs_before`)."""

    def runs_before(self, other: Linear) -> None:
        """`other` is the next linear the model calls: this one's kernel prefetches the start
        of its weights while finishing (both must be native tile layouts)."""
        self.after = other.tiles if self.tiles is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            assert self.kernels is not None
            return self.kernels.linear(x, self.tiles, self.bias, self.after, self.swiglu)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return self._silu_mul(y) if self.swiglu else y

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:  # this CPU's oneDNN has no kernel for the dtype
        return None
