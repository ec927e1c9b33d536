"""gpu_check's FP8 phases (benchmarks/gpu/gpu_check.py runs them after the bfloat16 engine is
gone): the FP8 GEMM's rate (`torch._scaled_mm`, per-row and per-column scales, as the
engine's FP8 projections call it), then an engine of the same checkpoint with
`--quantization fp8`: its decode steps against the FP8 floor (the projections' weights at
one byte) and as a ratio to the bfloat16 engine's steps of the same run, and its prefill
against the FP8 GEMM floor; last, with the time left, one with FP8 KV as well
(`--kv-cache-dtype fp8`: the Triton decode kernel over an e4m3 pool, its KV bytes halved in
the floor), at the longer context. On CPU the same phases run briefly (the script is checked
there; `_scaled_mm` is a GPU's, so the floor is the bfloat16 GEMM's)."""
from __future__ import annotations

import gc
from typing import Any

import torch

from benchmarks.gpu.gpu_check import Check, best_s, build_engine, decode_shape, prefill
from engine.model.fp8 import E4M3, quantize_input, quantize_weight


def fp8_gemm_tflops(c: Check) -> dict[str, Any]:
    """The FP8 GEMM's rate at 8,192 cubed (CPU: 512, through the engine's upcast form)."""
    size = 8192 if c.device == "cuda" else 512
    x = torch.randn(size, size, dtype=torch.bfloat16, device=c.device)
    w = quantize_weight(torch.randn(size, size, device=c.device))
    if c.device == "cuda":
        w8 = w.values.to(E4M3)
        xq, xs = quantize_input(x)
        ws = w.scale[None, :]
        gemm_s = best_s(c.device, lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws,
                                                           out_dtype=torch.bfloat16))
        quant_s = best_s(c.device, lambda: quantize_input(x))
    else:
        wv = w.values.to(torch.bfloat16)
        gemm_s = best_s(c.device, lambda: x @ wv.t())
        quant_s = best_s(c.device, lambda: quantize_input(x))
    fields = {"gemm_size": size, "fp8_gemm_tflops": round(2 * size**3 / gemm_s / 1e12, 2),
              "input_quant_ms": round(quant_s * 1e3, 3)}
    c.emit("fp8_floors", **fields)
    return fields


def fp8_phases(c: Check, model_dir: str, fl: dict[str, float], bf16_steps: dict[tuple[str, int, int], float],
               cuda: bool) -> None:
    from benchmarks.gpu.gpu_check_decode import decode_steps

    gemm = c.phase("fp8_floors", 10, lambda: fp8_gemm_tflops(c))
    engine = c.phase("fp8_kv_sizing", 60, lambda: build_engine(c, model_dir, "bfloat16", "fp8", "fp8_kv_sizing"))
    if engine is None:
        return
    batches, contexts, steps = decode_shape(cuda)
    got = c.phase("fp8_decode", 60, lambda: decode_steps(c, engine, fl, batches, contexts, steps, "fp8_decode")) or {}
    for key, fp8_s in got.items():  # the same arm, batch and context on the bfloat16 engine, this run
        if key in bf16_steps:
            c.emit("fp8_vs_bf16", attention=key[0], batch=key[1], context=key[2],
                   bf16_ms=round(bf16_steps[key] * 1e3, 3), fp8_ms=round(fp8_s * 1e3, 3),
                   speedup=round(bf16_steps[key] / fp8_s, 2))
    if gemm is not None:
        fl8 = {**fl, "gemm_tflops": gemm["fp8_gemm_tflops"]}
        c.phase("fp8_prefill", 30, lambda: prefill(c, engine, fl8, [2048, 8192] if cuda else [256], "fp8_prefill"))
    engine = None  # its pool given back before the next phase
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    both = c.phase("fp8_kv_sizing_both", 60, lambda: build_engine(c, model_dir, "bfloat16", "fp8", "fp8_kv_sizing_both",
                                                                 kv_cache_dtype="fp8"))
    if both is None:
        return
    got = c.phase("fp8_kv_decode", 40, lambda: decode_steps(c, both, fl, batches[::2], contexts[-1:], steps,
                                                            "fp8_kv_decode")) or {}
    for key, s in got.items():
        if key in bf16_steps:
            c.emit("fp8_kv_vs_bf16", attention=key[0], batch=key[1], context=key[2],
                   bf16_ms=round(bf16_steps[key] * 1e3, 3), fp8_ms=round(s * 1e3, 3),
                   speedup=round(bf16_steps[key] / s, 2))
    both = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
