"""FP8 (e4m3) weights: quantizing them, and the numerics of a product with them.

A projection in FP8 holds its weight as e4m3 values with a float32 scale per output channel
(a per-tensor scale is the same scale on every channel), and its input is quantized to
e4m3 too, per token from the row's largest magnitude (`dynamic`) or with the checkpoint's
one `input_scale` (`static`); `weights_only` leaves the input as it is. The product is
then y = (x_q @ w_q.T) * x_scale * w_scale: on GPUs one `torch._scaled_mm` on tensor
cores, on CPU the same e4m3 values upcast (every e4m3 value is exact in bfloat16 and
float32) through the ordinary matmul, which accumulates in float32 as the GPU's does. So the
CPU path is the GPU's reference, not a faster path.

The schemes (which projections, which scales) are engine/checkpoints/quant_config.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.types import UnsupportedModelError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite e4m3 (fn) value."""
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)
"""The smallest dynamic scale: a row of zeros (or of denormal noise) quantizes to zeros."""
FLOAT16_SHIFT = 2.0**-14
"""What quantized inputs are multiplied by before a float16 product (and the product's scale
divided by): every e4m3 value times it is still exact in float16 (2**-23 is its smallest,
a float16 subnormal), and the e4m3 products, up to 448 x 448 each, no longer overflow
float16's 65,504 when summed."""


@dataclass
class Fp8Weight:
    """A projection's FP8 weight as loaded: e4m3 `values` (in any dtype that holds them
    exactly), the float32 `scale` per output row, the static input scale (None: per token)."""

    values: torch.Tensor
    scale: torch.Tensor
    input_scale: float | None = None


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Per-channel e4m3 of a 16/32-bit weight [out, in]: each row scaled so its largest
    magnitude is E4M3_MAX."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=MIN_SCALE)
    return Fp8Weight(to_e4m3(w / scale[:, None]), scale)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Rounded to the nearest e4m3, saturating at +-E4M3_MAX (a cast alone would give NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_input(x: torch.Tensor, static: float | None = None,
                   ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] as e4m3 values and the float32 scale of each row [tokens, 1]: `static`,
    or the row's largest magnitude / E4M3_MAX (that magnitude capped at `ub`)."""
    xf = x.float()
    if static is not None:
        scale = torch.full((x.shape[0], 1), static, dtype=torch.float32, device=x.device)
    else:
        amax = xf.abs().amax(dim=1, keepdim=True)
        if ub is not None:
            amax = amax.clamp(max=ub)
        scale = (amax / E4M3_MAX).clamp(min=MIN_SCALE)
    return to_e4m3(xf / scale), scale


def fp8_product(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], w_scale: torch.Tensor,
                inputs: str = "dynamic", static: float | None = None, ub: float | None = None) -> torch.Tensor:
    """(x_q @ w_q.T) * x_scale * w_scale in x's dtype, `product` the matmul over the weight's
    e4m3 values (upcast: exact) and `w_scale` their scale per output row: x quantized first as
    `inputs` says (dynamic per token, `static`, or weights_only: x as it is). The upcast form
    of an FP8 projection (engine/model/linear.py) and of an FP8 expert (engine/model/moe.py)."""
    if inputs == "weights_only":
        return (product(x).float() * w_scale).to(x.dtype)
    xq, x_scale = quantize_input(x, static if inputs == "static" else None, ub)
    shift = FLOAT16_SHIFT if x.dtype == torch.float16 else 1.0
    return (product((xq.float() * shift).to(x.dtype)).float() * (x_scale / shift) * w_scale).to(x.dtype)


def channel_scale(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A checkpoint's weight scale (a scalar, [1], [out] or [out, 1]) as float32 [out]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(out_features).contiguous()
    if s.numel() != out_features:
        raise UnsupportedModelError(f"a weight scale of {s.numel()} values for {out_features} output channels")
    return s


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 one stands for (the reference's)."""
    return (w.values.float() * w.scale[:, None]).to(dtype)
