"""gpu_check's prefill attention phase: a later chunk's attention over its context, the
lower-right causal call (one fused kernel, FlashAttention-2 on an H100) against the engine's
form (engine/model/attention.py `_chunk_over_context`: the context unmasked and the chunk square
causal, merged by log-sum-exp), and a whole prompt's square causal call for scale."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from benchmarks.gpu.gpu_check import Check, best_s
from engine.model.attention import attention_with_lse

SHAPES = ((2048, 2048), (2048, 6144), (8192, 0))
"""(chunk tokens, earlier context): the second and the last chunk of an 8,192-token prompt
in 2,048-token chunks, and the whole prompt as one chunk."""


def prefill_attention(c: Check, fl: dict[str, float], layers: int = 32, heads: int = 32, kv_heads: int = 8,
                      head_dim: int = 128) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = head_dim**-0.5
    for n, past in SHAPES:
        ctx = past + n
        q = torch.randn(1, heads, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, kv_heads, ctx, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))

        def lower_right() -> torch.Tensor:
            mask = causal_lower_right(n, ctx) if past else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not past, scale=scale,
                                                  enable_gqa=True)

        def merged() -> torch.Tensor:
            own, own_lse = attention_with_lse(q, k[:, :, past:], v[:, :, past:], True, scale)
            if not past:
                return own
            before, before_lse = attention_with_lse(q, k[:, :, :past], v[:, :, :past], False, scale)
            return torch.lerp(own.float(), before.float(), torch.sigmoid(before_lse - own_lse)[..., None]).bfloat16()

        flops = 4 * head_dim * heads * (n * past + n * n / 2) * layers
        arms = {"lower_right": lower_right, "merged": merged}
        ms = {name: best_s("cuda", fn) * layers * 1e3 for name, fn in arms.items()}
        err = (lower_right().float() - merged().float()).abs().max().item()
        c.emit("prefill_attention", chunk=n, context_before=past, layers=layers,
               ms={name: round(t, 2) for name, t in ms.items()},
               tflops={name: round(flops / (t / 1e3) / 1e12) for name, t in ms.items()},
               floor_ms=round(flops / (fl["gemm_tflops"] * 1e12) * 1e3, 2), max_abs_diff=round(err, 4),
               cudnn=bool(torch.backends.cuda.can_use_cudnn_attention(
                   torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True))))
