"""The GPU path's one-shot check: verifies it and measures it against floors taken in the
same run, in one command that fits a short lease on a GPU machine (about 9 minutes).

    python benchmarks/gpu/gpu_check.py --out DIR [--model DIR | --size llama3-8b] [--budget-s 520]

One JSON line per figure in DIR/gpu_check.jsonl (also printed), each naming the GPU:
- preflight: versions (torch, CUDA, CuPy, NCCL, Triton, transformers), the GPU, free memory;
- pytest: `pytest tests/gpu`, counts and the failures (log in DIR/pytest_gpu.log);
- floors: device-to-device copy bandwidth (bytes read + written / time) and a bfloat16
  GEMM's FLOP/s, timed with CUDA events;
- kv_sizing: the engine built with its defaults (gpu_memory_utilization 0.9): its pool
  against `torch.cuda.mem_get_info` before and after;
- kv_sizing: also the time to ready (load, profile, graph capture) and the capture alone;
- decode: the engine's step at batch 1, 8, 32, 128 and contexts 512 and 4,096 (the contexts
  are each request's own where the pool holds them all, else one cached prefix they share,
  and the floor counts each KV byte once), timed with CUDA events,
  against (weights read + KV read) / copy bandwidth, on the same requests in four arms: the
  torch forms (the baseline), the Triton kernels eagerly, the kernels through the CUDA
  graphs, the graphs overlapped with the host's work (engine/model/overlap.py, the default); each
  arm warmed at each shape before it is timed;
- launches: per decode step (batch 32, context 512) under the torch profiler, the host calls
  that launch GPU work, the GPU's busy time against the host's time, and the kernels that
  take the most GPU time, per arm;
- attention_splits: the Triton decode attention alone, per layer, at 1 to 16 context splits
  and batch x context 8/32/128 x 512 and 8/32 x 4,096, against its KV bytes at the copy
  bandwidth, beside the number the graphs use;
- prefill_attention (benchmarks/gpu/gpu_check_prefill.py): a later chunk's attention over its
  context, one lower-right causal call against the engine's two merged by log-sum-exp;
- prefill: tokens/s for one 2,048- and one 8,192-token prompt against 2 x parameters x
  tokens (+ causal attention) / GEMM FLOP/s; the longest once more under the profiler, the
  kernels that take the most GPU time;
- worst_step: under that pool, the largest decode batch at the context the pool allows and
  a long prompt's last chunk over its whole context: run or out of memory, and the peak;
- engine_vs_transformers: the same batch through the engine and `transformers` generate;
- fabric (benchmarks/gpu/gpu_check_fabric.py): cuda_ipc push bandwidth and 1-block latency
  between two processes against a device-to-device copy of the same bytes, small and
  Llama-3-8B block shapes; nccl to itself on one GPU.
The model is `make-tiny-model --size llama3-8b` (random weights, real shapes) unless --model.
Each phase is skipped, and says so, when the budget left cannot hold it; an error in one is
written and the next one runs. Without CUDA it runs on the CPU with a tiny model and small
shapes (`--size tiny` is the default there): a check of the script, not of a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402


class Check:
    """Phases against one deadline; each writes its JSON lines as soon as it has them."""

    def __init__(self, out: Path, budget_s: float, device: str) -> None:
        self.out, self.device = out, device
        self.deadline = time.monotonic() + budget_s
        self.gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
        self.lines = (out / "gpu_check.jsonl").open("a")

    def emit(self, check: str, **fields: Any) -> None:
        line = json.dumps({"bench": "gpu_check", "check": check, "gpu": self.gpu, **fields})
        print(line, flush=True)
        self.lines.write(line + "\n")
        self.lines.flush()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, name: str, needs_s: float, fn: Callable[[], Any]) -> Any:
        if self.left_s() < needs_s:
            self.emit(name, skipped=f"{self.left_s():.0f} s left, needs about {needs_s:.0f}")
            return None
        began = time.monotonic()
        try:
            return fn()
        except Exception as e:  # written, and the next phase runs
            self.emit(name, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
            return None
        finally:
            self.emit(name + "_done", wall_s=round(time.monotonic() - began, 1))


@contextlib.contextmanager
def timed(device: str, box: dict[str, float]) -> Iterator[None]:
    """Seconds of the block: CUDA events on the current stream (then a sync), else the host clock."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        end.synchronize()
        box["s"] = start.elapsed_time(end) / 1e3
    else:
        t = time.perf_counter()
        yield
        box["s"] = time.perf_counter() - t


def best_s(device: str, fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        box: dict[str, float] = {}
        with timed(device, box):
            fn()
        times.append(box["s"])
    return min(times)


def preflight(c: Check) -> None:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda}
    for name in ("cupy", "triton", "transformers", "grpc", "flashinfer"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # absent is an answer
            info[name] = f"absent ({type(e).__name__})"
    if c.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        info.update(gpu_total_gib=round(total / 2**30, 2), gpu_free_gib=round(free / 2**30, 2),
                    capability=".".join(map(str, torch.cuda.get_device_capability())))
        try:
            from kvfabric.cuda import nccl

            info["nccl"] = nccl().get_version()
        except Exception as e:
            info["nccl"] = f"unavailable: {e}"
    c.emit("preflight", **info)


def run_pytest(c: Check, timeout_s: float) -> None:
    log = c.out / "pytest_gpu.log"
    try:
        # a test that hangs is ended at 90 s with its traceback, not the whole phase
        # in this process, without the suite's addopts (`-n 2`: the device image has no pytest-xdist)
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-rfEs", "--tb=short",
                            "--timeout", "90", "-p", "no:cacheprovider", "tests/gpu"],
                           cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
        text, rc = f"{out.decode(errors='replace')}\nTIMEOUT after {timeout_s:.0f} s", None
    log.write_text(text)
    lines = str(text).strip().splitlines()
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln)), "")
    c.emit("pytest", rc=rc, summary=summary.strip("= "), failures=[ln for ln in lines if ln.startswith(("FAILED", "ERROR"))])


def floors(c: Check) -> dict[str, float]:
    """Copy bandwidth (read + write) and GEMM FLOP/s on this device, now."""
    n = 2**30 if c.device == "cuda" else 2**26  # the CPU run checks the script, briefly
    src = torch.empty(n, dtype=torch.uint8, device=c.device)
    dst = torch.empty_like(src)
    copy_s = best_s(c.device, lambda: dst.copy_(src))
    size = 8192 if c.device == "cuda" else 512
    a = torch.randn(size, size, dtype=torch.bfloat16, device=c.device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=c.device)
    gemm_s = best_s(c.device, lambda: a @ b)
    f = {"copy_gb_per_s": 2 * n / copy_s / 1e9, "gemm_tflops": 2 * size**3 / gemm_s / 1e12}
    c.emit("floors", copy_bytes=n, gemm_size=size, **{k: round(v, 2) for k, v in f.items()})
    return f


def build_engine(c: Check, model_dir: str, dtype: str, quantization: str | None = None,
                 check: str = "kv_sizing", kv_cache_dtype: str = "auto") -> LLMEngine:
    free0 = torch.cuda.mem_get_info()[0] if c.device == "cuda" else 0
    began = time.monotonic()
    cache = CacheConfig(block_size=16, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_bytes=None if c.device == "cuda" else 64 * 2**20)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device=c.device, dtype=dtype, cache=cache,  # type: ignore[arg-type]
                                    scheduler=SchedulerConfig(), detokenize=False, quantization=quantization))
    pool = engine.kv_pool.num_blocks * engine.layout.block_bytes
    decode = engine.runner.decode
    fields: dict[str, Any] = {"ready_s": round(time.monotonic() - began, 1), "pool_gib": round(pool / 2**30, 3),
                              "graph_capture_s": round(decode.capture_s, 2) if decode is not None else None,
                              "graph_buckets": sorted(decode.graphs) if decode is not None else [],
                              "kernels": type(engine.model.kernels).__name__,
                              "pool_blocks": engine.kv_pool.num_blocks, "weight_gib": round(engine.model.weight_bytes / 2**30, 3),
                              "gpu_memory_utilization": engine.config.cache.gpu_memory_utilization}
    if c.device == "cuda":
        free1, total = torch.cuda.mem_get_info()
        fields.update(free_before_gib=round(free0 / 2**30, 2), free_after_gib=round(free1 / 2**30, 2),
                      total_gib=round(total / 2**30, 2), pool_over_total=round(pool / total, 3),
                      torch_reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 2))
    c.emit(check, **fields)
    return engine


def token_ids(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """`n` token ids inside the model's vocabulary (past the special ones), varied by `salt`."""
    room = engine.model_config.vocab_size - 3
    return [3 + (salt * 7919 + j * 31) % room for j in range(n)]


def kv_bytes_per_token(engine: LLMEngine) -> int:
    return engine.layout.block_bytes // engine.layout.block_size


def prefill(c: Check, engine: LLMEngine, fl: dict[str, float], lengths: list[int], check: str = "prefill") -> None:
    m, cfg = engine.model, engine.model_config
    matmul_params = sum(x.in_features * x.out_features for x in m.linears())
    for n in lengths:
        prompt = token_ids(engine, n, n)
        box: dict[str, float] = {}
        for r in range(2):  # the second is timed; each is a new prompt (no prefix hit)
            with timed(c.device, box):
                engine.generate([[3 + r, *prompt[1:]]], SamplingParams(max_tokens=1, ignore_eos=True))
        attention = 2 * cfg.num_layers * n * n * cfg.num_heads * cfg.head_dim  # causal: half of QK^T and PV
        floor_s = (2 * matmul_params * n + attention) / (fl["gemm_tflops"] * 1e12)
        c.emit(check, tokens=n, chunk_tokens=engine.config.scheduler.max_num_batched_tokens,
               seconds=round(box["s"], 4), tokens_per_s=round(n / box["s"]), floor_s=round(floor_s, 4),
               over_floor=round(box["s"] / floor_s, 2))
    if c.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        n = lengths[-1]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate([[5, *token_ids(engine, n, n)[1:]]], SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
        busy, top = top_kernels(prof)
        c.emit("prefill_kernels", tokens=n, gpu_busy_ms=round(busy / 1e3, 2),
               top_kernels_ms={k: round(v / 1e3, 2) for k, v in top})


def top_kernels(prof: Any, count: int = 10) -> tuple[float, list[tuple[str, float]]]:
    """A torch profile's GPU busy time (us) and its `count` kernels (names cut to 60
    characters) that took the most of it."""
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            device_us = getattr(e, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(e, "self_cuda_time_total", 0.0)
            kernels[e.key[:60]] = kernels.get(e.key[:60], 0.0) + device_us
    return sum(kernels.values()), sorted(kernels.items(), key=lambda kv: -kv[1])[:count]


def worst_step(c: Check, engine: LLMEngine) -> None:
    """The largest decode batch at the context the pool allows, then a long prompt whose last
    chunk attends over all of it: does either run out of memory under the sized pool?"""
    cuda = c.device == "cuda"
    b = engine.config.scheduler.max_num_seqs
    pool_tokens = engine.kv_pool.num_blocks * engine.layout.block_size
    ctx = min(pool_tokens // b, engine.max_model_len - 64) // 16 * 16
    long = min(engine.max_model_len - 8, 16384 if cuda else 1024, pool_tokens // 2)
    for what, run in (("decode_batch", lambda: _one_decode(engine, b, ctx)), ("long_prompt", lambda: _long(engine, long))):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            run()
            outcome = "ran"
        except torch.OutOfMemoryError as e:
            outcome = f"out of memory: {str(e)[:300]}"
            for rid in list(engine.scheduler.requests):
                engine.abort(rid)
        fields = {"batch": b, "context": ctx} if what == "decode_batch" else {"prompt_tokens": long}
        if cuda:
            fields.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                          free_gib=round(torch.cuda.mem_get_info()[0] / 2**30, 2))
        c.emit("worst_step", case=what, outcome=outcome, **fields)


def _one_decode(engine: LLMEngine, batch: int, context: int) -> None:
    from benchmarks.gpu.gpu_check_decode import decoding

    ids, _ = decoding(engine, batch, context, seed=1)
    engine.step()
    for rid in ids:
        engine.abort(rid)


def _long(engine: LLMEngine, n: int) -> None:
    engine.generate([token_ids(engine, n, 11)], SamplingParams(max_tokens=2, ignore_eos=True))


def engine_vs_transformers(c: Check, engine: LLMEngine | None, model_dir: str, vocab: int, batch: int, prompt: int,
                           new: int) -> float | None:
    """Tokens/s of `batch` prompts of `prompt` tokens, `new` generated each, through the engine
    (when given) or through transformers generate (same dtype, device, greedy)."""
    prompts = [[3 + (i * 101 + j * 7) % (vocab - 3) for j in range(prompt)] for i in range(batch)]
    if engine is not None:  # warmed on other prompts of the same shape (no prefix hit), then timed
        warm = [[3 + (i * 37 + j * 11 + 5) % (vocab - 3) for j in range(prompt)] for i in range(batch)]
        engine.generate(warm, SamplingParams(max_tokens=new, ignore_eos=True))
        began = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        return batch * new / (time.perf_counter() - began)
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(c.device).eval()
    gc_ = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=2)
    ids = torch.tensor(prompts, device=c.device)
    with torch.inference_mode():
        hf.generate(ids[:1, :16], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False,
                                                                      eos_token_id=None, pad_token_id=2))
        began = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
        rate = batch * new / (time.perf_counter() - began)
    del hf
    return rate


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.jsonl and the pytest log")
    ap.add_argument("--model", help="a checkpoint directory (default: one made with --size)")
    ap.add_argument("--size", default=None, help="make-tiny-model size (default llama3-8b on CUDA, tiny on CPU)")
    ap.add_argument("--budget-s", type=float, default=520.0, help="the whole check's time")
    ap.add_argument("--skip", nargs="*", default=[], help="phases to leave out (pytest, decode, prefill, ...)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(2)
    c = Check(out, args.budget_s, "cuda" if cuda else "cpu")
    c.phase("preflight", 0, lambda: preflight(c))
    if "pytest" not in args.skip:
        c.phase("pytest", 60, lambda: run_pytest(c, min(240.0, c.left_s() - 220)))
    model_dir = args.model or tiny_model(c, args.size or ("llama3-8b" if cuda else "tiny"), cuda)
    fl = c.phase("floors", 10, lambda: floors(c)) or {"copy_gb_per_s": float("nan"), "gemm_tflops": float("nan")}
    engine = c.phase("kv_sizing", 60, lambda: build_engine(c, model_dir, "bfloat16"))
    if engine is not None:
        vocab = engine.model_config.vocab_size
        ours, bf16_steps = engine_phases(c, engine, fl, model_dir, set(args.skip), cuda)
        del engine  # its pool given back before the FP8 engine and transformers load the model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if "fp8" not in args.skip:
            from benchmarks.gpu.gpu_check_fp8 import fp8_phases

            fp8_phases(c, model_dir, fl, bf16_steps, cuda)
        if "transformers" not in args.skip:
            transformers_phase(c, model_dir, vocab, ours, cuda)
    if cuda and "fabric" not in args.skip:
        from benchmarks.gpu.gpu_check_fabric import fabric

        c.phase("fabric", 40, lambda: fabric(c))
    c.emit("end", left_s=round(c.left_s()))


def tiny_model(c: Check, size: str, cuda: bool) -> str:
    """A checkpoint of random weights in `size`'s shapes, drawn on the GPU where there is one
    (a minute less than on the host)."""
    from engine.model.tiny_model import make_tiny_model

    began = time.monotonic()
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-")) / size, size=size,
                                    device="cuda" if cuda else "cpu"))
    c.emit("model", size=size, dir=model_dir, write_s=round(time.monotonic() - began, 1))
    return model_dir


def generate_shape(cuda: bool) -> tuple[int, int, int]:
    """engine_vs_transformers's batch, prompt tokens and new tokens."""
    return (32, 512, 64) if cuda else (4, 64, 8)


def decode_shape(cuda: bool) -> tuple[list[int], list[int], int]:
    """The decode phase's batches, contexts and timed steps."""
    return ([1, 8, 32, 128], [512, 4096], 10) if cuda else ([1, 8], [64, 256], 3)


def engine_phases(c: Check, engine: LLMEngine, fl: dict[str, float], model_dir: str, skip: set[str],
                  cuda: bool) -> tuple[float | None, dict[tuple[str, int, int], float]]:
    """The phases that run on the sized engine. Returns its generate tokens/s and its decode
    steps' seconds by (arm, batch, context)."""
    from benchmarks.gpu.gpu_check_decode import attention_splits, decode_steps, launches
    from benchmarks.gpu.gpu_check_prefill import prefill_attention

    batches, contexts, steps = decode_shape(cuda)
    steps_s: dict[tuple[str, int, int], float] = {}
    if "decode" not in skip:
        steps_s = c.phase("decode", 60, lambda: decode_steps(c, engine, fl, batches, contexts, steps)) or {}
    if cuda and "launches" not in skip:
        c.phase("launches", 20, lambda: launches(c, engine, 32, 512))
    if cuda and "attention_splits" not in skip:
        c.phase("attention_splits", 30, lambda: attention_splits(c, engine, fl))
    if cuda and "prefill_attention" not in skip:
        c.phase("prefill_attention", 15, lambda: prefill_attention(c, fl))
    if "prefill" not in skip:
        c.phase("prefill", 30, lambda: prefill(c, engine, fl, [2048, 8192] if cuda else [256, 512]))
    vocab, shape = engine.model_config.vocab_size, generate_shape(cuda)
    ours = c.phase("engine_generate", 30, lambda: engine_vs_transformers(c, engine, model_dir, vocab, *shape))
    if "worst_step" not in skip:
        c.phase("worst_step", 60, lambda: worst_step(c, engine))
    return ours, steps_s


def transformers_phase(c: Check, model_dir: str, vocab: int, ours: float | None, cuda: bool) -> None:
    """transformers generating the engine_generate phase's batch, and the ratio of the two."""
    shape = generate_shape(cuda)
    theirs = c.phase("transformers", 90, lambda: engine_vs_transformers(c, None, model_dir, vocab, *shape))
    if ours and theirs:
        c.emit("engine_vs_transformers", batch=shape[0], prompt_tokens=shape[1], new_tokens=shape[2],
               engine_tokens_per_s=round(ours, 1), transformers_tokens_per_s=round(theirs, 1),
               ratio=round(ours / theirs, 2))


if __name__ == "__main__":
    main()
