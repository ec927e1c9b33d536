"""Tensor parallelism's cost on CPU: decode and prefill step time of one engine over the
whole model (TP 1) against the same engine split across 2 processes (gloo), same prompts.

    ./dev python -m benchmarks.engine.tensor_parallel [--size tiny|small] [--batch 8] [--tokens 32]

One JSON line per degree, with the ratio to TP 1. On this CPU the split halves each rank's
matmuls but adds two all-reduces a layer and the logits' all-gather, and the two ranks share
the machine's cores: the ratio is the collectives' overhead, not a speed-up to expect.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import SamplingParams


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model_dir=model_dir, cache=CacheConfig(block_size=16, num_blocks=512),
                        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64), decode_graphs=False)


def timed_run(model_dir: str, prompts: list[list[int]], tokens: int, tp: tuple[int, int, int] | None) -> dict:
    """Prefill all prompts in one step, then decode `tokens` steps: seconds of each kind."""
    import torch

    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    config = engine_config(model_dir)
    if tp is not None:
        import torch.distributed as dist

        from engine.parallel.tensor_parallel import TensorParallel
        from engine.parallel.tp_followers import follow

        rank, world, port = tp
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        config = replace(config, tensor_parallel=TensorParallel(rank, world))
        if rank:
            follow(config)
            dist.destroy_process_group()
            return {}
    engine = LLMEngine(config)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=tokens + 1, ignore_eos=True), request_id=f"r{i}")
    t0 = time.perf_counter()
    engine.step()  # every prompt in one step
    prefill = time.perf_counter() - t0
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    engine.release_followers()
    if tp is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    steps.sort()
    return {"prefill_s": prefill, "decode_step_ms": steps[len(steps) // 2] * 1e3, "decode_steps": len(steps)}


def _rank(rank: int, world: int, port: int, model_dir: str, prompts: list[list[int]], tokens: int, out: str) -> None:
    result = timed_run(model_dir, prompts, tokens, (rank, world, port))
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def split(world: int, model_dir: str, prompts: list[list[int]], tokens: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_dir, prompts, tokens, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from engine.model.tiny_model import make_tiny_model
    from tests.integration.reference import random_prompts

    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", "llama", args.size))
    from engine.model.model_config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = random_prompts([args.prompt_tokens] * args.batch, vocab, seed=1)
    config = {"size": args.size, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "backend": "gloo", "dtype": "float32"}
    base = timed_run(model_dir, prompts, args.tokens, None)
    print(json.dumps({"tp": 1, **base, "config": config}), flush=True)
    for world in (2,):
        got = split(world, model_dir, prompts, args.tokens)
        print(json.dumps({"tp": world, **got, "decode_ratio": round(got["decode_step_ms"] / base["decode_step_ms"], 3),
                          "prefill_ratio": round(got["prefill_s"] / base["prefill_s"], 3), "config": config}))


if __name__ == "__main__":
    main()
