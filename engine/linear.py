"""Linear layers with weights laid out once, at load time, for the device's fastest matmul.

On CPU the weight is reordered into oneDNN's blocked layout, so no step pays for the
layout conversion that `F.linear` does on every call: decode matmuls run about twice as
fast in bfloat16 and three times in float32 on this project's machines
(`benchmarks/engine_throughput.py`). Results equal `F.linear` up to float rounding
(bit-identical in bfloat16 here). Where oneDNN can't take the dtype on this CPU (float16
without AVX-512 FP16) or on other devices, the plain weight and `F.linear` are kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x @ weight.T + bias for x of shape [num_tokens, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()
        self.bias = bias
        self.packed = _prepack(weight) if prepack and weight.device.type == "cpu" else None
        self.weight = weight if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:  # this CPU's oneDNN has no kernel for the dtype
        return None
