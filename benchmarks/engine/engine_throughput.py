"""Engine throughput against transformers on the `small` model, in one process.

Workload: the first N requests of benchmarks/traces/mooncake_synthetic_trace.jsonl with
prompt lengths divided by --input-scale and output lengths by --output-scale (clamped),
prompts of random token ids (seeded). Our engine runs them as one continuous batch;
transformers runs them one request at a time (on a subset: a rate) and in static
left-padded batches, and its best rate is the baseline. Tokens/s counts generated
tokens each request asked for. Also: decode step time at batch 1/8/32 against the
floor weight_bytes / memcpy bandwidth. The machines are noisy (memcpy alone swings
between about 20 and 34 GB/s here), so the batch-32 step and memcpy are measured in
alternating rounds and `floor_ratio_bs32` is the median of the per-round ratios. For
context, `compute_floor_ms_bs32` is the batch-32 step's matmul flops at the peak rate
of a large packed GEMM measured in this run: at batch 32 a CPU is compute-bound.

Prints one JSON line (config + results). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cluster.default_model import default_model_dir  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"


def workload(n: int, input_scale: int, output_scale: int, seed: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:n]]
    out = []
    for r in rows:
        p = min(max(r["input_length"] // input_scale, 8), 1024)
        o = min(max(r["output_length"] // output_scale, 4), 128)
        out.append((torch.randint(3, 8000, (p,), generator=g).tolist(), o))
    return out


def memcpy_gb_per_s(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4)  # float32: byte count is what matters
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


def make_engine(model_dir: str, dtype: str = "float32", native_kernels: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model_dir, dtype=dtype, native_kernels=native_kernels,
        cache=CacheConfig(block_size=16, kv_cache_bytes=2 * 2**30),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64)))


def run_engine(engine: LLMEngine, work) -> float:
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in work]
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - t
    assert [len(c.token_ids) for c in outs] == [o for _, o in work]
    return sum(o for _, o in work) / elapsed


def run_hf_single(hf, work) -> float:
    from transformers import GenerationConfig

    tokens, elapsed = 0, 0.0
    for prompt, o in work:
        gc = GenerationConfig(do_sample=False, max_new_tokens=o, eos_token_id=None, pad_token_id=2)
        t = time.perf_counter()
        hf.generate(torch.tensor([prompt]), generation_config=gc)
        elapsed += time.perf_counter() - t
        tokens += o
    return tokens / elapsed


def run_hf_batched(hf, work, batch: int) -> float:
    from transformers import GenerationConfig

    t = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        gc = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in chunk),
                              eos_token_id=None, pad_token_id=2)
        hf.generate(ids, attention_mask=mask, generation_config=gc)
    return sum(o for _, o in work) / (time.perf_counter() - t)


def gemm_gflops(engine: LLMEngine, dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """Peak-ish matmul rate: a square GEMM with a prepacked weight, as the engine runs them
    (its native kernel where it has one, else oneDNN)."""
    from engine.model.linear import Linear

    a = torch.randn(size, size, dtype=dtype)
    lin = Linear(torch.randn(size, size, dtype=dtype), None, prepack=True, kernels=engine.model.kernels)
    lin(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lin(a)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9


def decode_step_ms(engine: LLMEngine, batch: int, steps: int = 8, context: int = 32) -> float:
    """Mean step time of exactly `batch` requests decoding with about `context` tokens each.

    Their output limit is far off, so none finishes while the others' prompts are still
    being prefilled (with long prompts that used to shrink the timed batch)."""
    for i in range(batch):
        engine.add_request([3 + (i * 7 + j) % 8000 for j in range(context)],
                           SamplingParams(max_tokens=1024, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # warm the decode-only path
    t = time.perf_counter()
    for _ in range(steps):
        out = engine.step()
        assert len(out) == batch, f"{len(out)} requests decoded, wanted {batch}"
    ms = (time.perf_counter() - t) / steps * 1e3
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return ms


def prefill_tokens_per_s(engine: LLMEngine, hf, num_tokens: int, repeats: int = 3) -> tuple[float, float]:
    """One `num_tokens` prompt prefilled (max_tokens=1, so the time is the prompt's), best of
    `repeats`, by our engine (in chunks of its max_num_batched_tokens: the first chunk is
    causal self-attention, the others attend to the chunks before them) and by one
    transformers forward over the whole prompt."""
    prompt = [3 + (j * 13) % 8000 for j in range(num_tokens)]
    ours, theirs = float("inf"), float("inf")
    for r in range(repeats):
        t = time.perf_counter()
        engine.generate([[prompt[0] + r, *prompt[1:]]], [SamplingParams(max_tokens=1, ignore_eos=True)])
        ours = min(ours, time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            hf(torch.tensor([prompt]))
        theirs = min(theirs, time.perf_counter() - t)
    return num_tokens / ours, num_tokens / theirs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: the embedded small llama)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-scale", type=int, default=100)
    ap.add_argument("--output-scale", type=int, default=2)
    ap.add_argument("--hf-single-requests", type=int, default=4, help="requests timed one at a time")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="weights and activations, the same for both engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--floor-rounds", type=int, default=5, help="alternating memcpy / batch-32 rounds")
    ap.add_argument("--long-context", type=int, default=512, help="context of the long-context decode step")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prompt of the prefill measurement")
    ap.add_argument("--no-native-kernels", action="store_true",
                    help="the engine's torch paths only (EngineConfig.native_kernels=False), for comparison")
    return ap.parse_args()


def floors(engine: LLMEngine, dtype: torch.dtype, num_rounds: int) -> dict:
    """The batch-32 step against the memory floor (alternating rounds) and the compute floor."""
    weight_bytes = engine.model.weight_bytes
    rounds = [(memcpy_gb_per_s(), decode_step_ms(engine, 32)) for _ in range(num_rounds)]
    ratios = sorted(ms / (weight_bytes / (bw * 1e9) * 1e3) for bw, ms in rounds)
    bw = sorted(bw for bw, _ in rounds)[len(rounds) // 2]
    gflops = gemm_gflops(engine, dtype)
    matmul_flops_bs32 = 2 * 32 * sum(x.in_features * x.out_features for x in engine.model.linears())
    return {
        "weight_bytes": weight_bytes,
        "memcpy_gb_per_s": round(bw, 2),
        "floor_ms": round(weight_bytes / (bw * 1e9) * 1e3, 2),
        "floor_ratio_bs32": round(ratios[len(ratios) // 2], 2),
        "floor_rounds": [{"memcpy_gb_per_s": round(b, 2), "step_ms_bs32": round(ms, 2)} for b, ms in rounds],
        "gemm_gflops": round(gflops, 1),
        "compute_floor_ms_bs32": round(matmul_flops_bs32 / (gflops * 1e9) * 1e3, 2),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(default_model_dir(size="small"))
    work = workload(args.num_requests, args.input_scale, args.output_scale, args.seed)

    engine = make_engine(model_dir, args.dtype, native_kernels=not args.no_native_kernels)
    run_engine(engine, work[:2])  # warm-up
    engine_tps = run_engine(engine, work)
    steps = {bs: decode_step_ms(engine, bs) for bs in (1, 8, 32)}
    long_ms = decode_step_ms(engine, 32, context=args.long_context)
    floor = floors(engine, getattr(torch, args.dtype), args.floor_rounds)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    hf_single = run_hf_single(hf, work[: args.hf_single_requests])
    hf_batched = {bs: run_hf_batched(hf, work, bs) for bs in args.hf_batch_sizes}
    hf_best = max([hf_single, *hf_batched.values()])
    prefill, hf_prefill = prefill_tokens_per_s(engine, hf, args.prefill_tokens)
    print(json.dumps({
        "benchmark": "engine_throughput",
        "config": {"model": model_dir, "dtype": args.dtype, "num_requests": len(work),
                   "trace": TRACE.name, "input_scale": args.input_scale, "output_scale": args.output_scale,
                   "mean_prompt_tokens": sum(len(p) for p, _ in work) / len(work),
                   "mean_output_tokens": sum(o for _, o in work) / len(work),
                   "threads": args.threads, "block_size": 16, "max_num_batched_tokens": 1024,
                   "floor_rounds": args.floor_rounds, "long_context": args.long_context,
                   "prefill_tokens": args.prefill_tokens,
                   "native_kernels": engine.model.kernels is not None},
        "engine_tokens_per_s": round(engine_tps, 1),
        "transformers_tokens_per_s": round(hf_best, 1),
        "transformers_single_tokens_per_s": round(hf_single, 1),
        "transformers_batched_tokens_per_s": {str(k): round(v, 1) for k, v in hf_batched.items()},
        "speedup": round(engine_tps / hf_best, 2),
        "prefill_tokens_per_s": round(prefill, 1),
        "transformers_prefill_tokens_per_s": round(hf_prefill, 1),
        "prefill_speedup": round(prefill / hf_prefill, 2),
        "decode_step_ms": {str(k): round(v, 2) for k, v in steps.items()},
        "decode_step_ms_bs32_long_context": round(long_ms, 2),
        **floor,
    }))


if __name__ == "__main__":
    main()
