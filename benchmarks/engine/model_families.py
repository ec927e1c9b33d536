"""Each architecture on CPU: the engine against transformers on the same tiny checkpoint and
prompts, and a mixture of experts against a dense model of the same active parameters.

Per architecture (engine/model/tiny_model.py: llama, qwen2, qwen3, mistral, gemma2, gemma3, phi3,
mixtral, qwen2_moe, qwen3_moe), `--size` small by default: --requests prompts of
--prompt-tokens, greedy, --max-tokens each, all at once through one LLMEngine, against
transformers' `generate` on the same prompts one batch at a time (left-padded, as a user of
transformers batches), both float32 and warmed first; arms alternate for --rounds and the
median is kept. One JSON line per architecture: engine_tokens_per_s, transformers_tokens_per_s,
speedup, identical (the greedy tokens equal, prompt by prompt). Then one line comparing the
decode step of qwen3_moe (4 experts, 2 per token, each half the dense MLP) with qwen3's (the
same active MLP width): their step times at --requests.

    ./dev python benchmarks/engine/model_families.py [--size tiny] [--archs llama gemma3 ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.tiny_model import ARCHS, make_tiny_model  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine_run(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    out = engine.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - began), [c.token_ids for c in out]


def hf_run(model, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig

    ids = torch.tensor(batch)  # equal lengths: no padding needed
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    took = time.perf_counter() - began
    return out[:, ids.shape[1]:].numel() / took, out[:, ids.shape[1]:].tolist()


def step_time(engine: LLMEngine, batch: list[list[int]], steps: int) -> float:
    """Median seconds of a decode step with len(batch) requests running."""
    for p in batch:
        engine.add_request(p, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    config = {k: v for k, v in vars(args).items() if k != "archs"}
    tmp = Path(tempfile.mkdtemp())
    engines = {}
    for arch in args.archs:
        model_dir = str(make_tiny_model(tmp / arch, arch=arch, size=args.size, seed=0))
        engine = engines[arch] = LLMEngine(EngineConfig(
            model_dir=model_dir, dtype="float32", cache=CacheConfig(kv_cache_bytes=256 * 2**20),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(64, args.requests))))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # both run to max_tokens
        batch = prompts(args.requests, args.prompt_tokens, engine.model.config.vocab_size)
        engine_run(engine, batch[:2], 4), hf_run(hf, batch[:2], 4)  # warm both
        ours, theirs, same = [], [], True
        for _ in range(args.rounds):
            tps, ours_tokens = engine_run(engine, batch, args.max_tokens)
            ours.append(tps)
            tps, hf_tokens = hf_run(hf, batch, args.max_tokens)
            theirs.append(tps)
            same = same and ours_tokens == hf_tokens
        e, t = statistics.median(ours), statistics.median(theirs)
        print(json.dumps({"bench": "model_families", "arch": arch, "engine_tokens_per_s": round(e, 1),
                          "transformers_tokens_per_s": round(t, 1), "speedup": round(e / t, 2), "identical": same,
                          **config}), flush=True)
        del hf
    if "qwen3" in engines and "qwen3_moe" in engines:
        batch = prompts(args.requests, args.prompt_tokens, engines["qwen3"].model.config.vocab_size)
        dense, moe = [], []
        for _ in range(args.rounds):
            dense.append(step_time(engines["qwen3"], batch, 16))
            moe.append(step_time(engines["qwen3_moe"], batch, 16))
        d, m = statistics.median(dense), statistics.median(moe)
        print(json.dumps({"bench": "model_families", "compare": "qwen3_moe vs qwen3 (same active MLP width)",
                          "dense_step_ms": round(d * 1e3, 2), "moe_step_ms": round(m * 1e3, 2),
                          "moe_over_dense": round(m / d, 2), **config}), flush=True)


if __name__ == "__main__":
    main()
