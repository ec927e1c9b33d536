"""gpu_check's decode phases (benchmarks/gpu/gpu_check.py runs them): the engine's decode step in
each of its arms (the torch forms, the Triton kernels eagerly, the kernels through the CUDA
graphs, and those overlapped with the host's work) on the same requests, against the bandwidth floor, and the launches and host against
GPU time per step under the torch profiler."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.gpu_check import Check, best_s, kv_bytes_per_token, timed, token_ids, top_kernels
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams


def decoding(engine: LLMEngine, batch: int, context: int, seed: int) -> tuple[list[str], bool]:
    """`batch` requests decoding over `context` tokens each; returns their ids once every one
    is past its prompt, and whether they share one prefix. Each has a context of its own
    where the pool holds them all (nine tenths of it), so every KV byte a step reads comes
    from memory; else they share a cached prefix of `context` tokens (one prefill), whose
    blocks the L2 cache serves to all but the first reader."""
    pool_tokens = engine.kv_pool.num_blocks * engine.layout.block_size
    shared = batch * (context + 2) > 0.9 * pool_tokens
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    if shared:
        prefix = token_ids(engine, context, seed)
        engine.generate([prefix], SamplingParams(max_tokens=1, ignore_eos=True))  # the shared prefix, cached
        ids = [engine.add_request([*prefix, 3 + i % 200], params) for i in range(batch)]
    else:
        ids = [engine.add_request(token_ids(engine, context + 1, seed * 1000 + i), params) for i in range(batch)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    return ids, shared


def decode_arms(engine: LLMEngine, cuda: bool) -> dict[str, Callable[[], None]]:
    """The ways to run a decode step on the same weights and pool: the torch forms (the
    baseline), the Triton kernels eagerly, the kernels through the CUDA graphs with the host
    waiting for each step, and the graphs overlapped with the host's work (engine/model/overlap.py)."""
    m, runner, overlap = engine.model, engine.runner, engine.overlap
    kernels, graphs, overlaps = m.kernels, runner.decode, overlap.enabled

    def arm(k: Any, g: Any, o: bool = False) -> Callable[[], None]:
        def use() -> None:
            m.use_kernels(k) if cuda else None
            runner.decode = g
            overlap.enabled = o
        return use

    if not cuda:
        return {"native": arm(kernels, graphs), **({"overlap": arm(kernels, graphs, True)} if overlaps else {})}
    arms = {"torch": arm(None, None)}
    if kernels is not None:
        arms["triton"] = arm(kernels, None)
    if graphs is not None and graphs.graphs:
        arms["graphs"] = arm(kernels, graphs)
        if overlaps:
            arms["overlap"] = arm(kernels, graphs, True)
    return arms


def decode_steps(c: Check, engine: LLMEngine, fl: dict[str, float], batches: list[int], contexts: list[int],
                 steps: int, check: str = "decode") -> dict[tuple[str, int, int], float]:
    """Emits `check` lines; returns each (arm, batch, context)'s step seconds."""
    m = engine.model
    measured: dict[tuple[str, int, int], float] = {}
    arms = decode_arms(engine, c.device == "cuda")
    weight_read = m.weight_bytes - (0 if m.tied else m.embed.numel() * m.embed.element_size())
    per_token = kv_bytes_per_token(engine)
    for ctx in contexts:
        for b in batches:
            if c.left_s() < 20:
                c.emit(check, batch=b, context=ctx, skipped="budget")
                continue
            ids, shared = decoding(engine, b, ctx, seed=b + ctx)
            done = 0
            for name, use in arms.items():  # the same requests, each arm in turn, each warmed first
                use()
                for _ in range(3):
                    engine.step()  # warm: Triton compiles a new shape here, never in the timed steps
                box: dict[str, float] = {}
                wall = time.perf_counter()
                with timed(c.device, box):
                    for _ in range(steps):
                        assert len(engine.step()) == b
                wall = (time.perf_counter() - wall) / steps
                done += 3 + steps
                step_s = box["s"] / steps
                mean_ctx = ctx + 1 + done - steps // 2
                unique = ctx + b * (mean_ctx - ctx) if shared else b * mean_ctx  # tokens whose KV must come from memory
                kv_read = unique * per_token
                floor_s = (weight_read + kv_read) / (fl["copy_gb_per_s"] * 1e9)
                measured[(name, b, ctx)] = step_s
                c.emit(check, attention=name, batch=b, context=ctx, shared_prefix=shared,
                       step_ms=round(step_s * 1e3, 3),
                       wall_ms=round(wall * 1e3, 3), floor_ms=round(floor_s * 1e3, 3),
                       over_floor=round(step_s / floor_s, 2), tokens_per_s=round(b / step_s),
                       weight_read_gib=round(weight_read / 2**30, 3), kv_read_gib=round(kv_read / 2**30, 3))
            list(arms.values())[-1]()  # the engine as built
            for rid in ids:
                engine.abort(rid)
    return measured


def replayed(device: str, fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` captured into a CUDA graph (after a run that compiles its kernels): the replay; on
    CPU `fn` itself."""
    if device != "cuda":
        return fn
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")


def launches(c: Check, engine: LLMEngine, batch: int, context: int, steps: int = 5) -> None:
    """Per decode step, under the torch profiler: host calls that launch GPU work, by name,
    and the GPU's busy time (its kernels' durations) against the step's host time."""
    from torch.profiler import ProfilerActivity, profile

    ids, _ = decoding(engine, batch, context, seed=5)
    for name, use in decode_arms(engine, True).items():
        use()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            for _ in range(steps):
                engine.step()
            host_s = (time.perf_counter() - began) / steps
            torch.cuda.synchronize()
        counts: dict[str, int] = {}
        for e in prof.key_averages():
            if e.key in LAUNCHES:
                counts[e.key] = counts.get(e.key, 0) + e.count
        gpu_us, top = top_kernels(prof)
        c.emit("launches", arm=name, batch=batch, context=context,
               per_step={k: round(v / steps, 1) for k, v in sorted(counts.items())},
               launches_per_step=round(sum(v for k, v in counts.items() if "Memcpy" not in k and "Memset" not in k) / steps, 1),
               host_ms_per_step=round(host_s * 1e3, 3), gpu_busy_ms_per_step=round(gpu_us / steps / 1e3, 3),
               top_kernels_us_per_step={k: round(v / steps, 1) for k, v in top})
    for rid in ids:
        engine.abort(rid)


def attention_splits(c: Check, engine: LLMEngine, fl: dict[str, float],
                     shapes: tuple[tuple[int, int], ...] = ((8, 512), (32, 512), (128, 512), (8, 4096), (32, 4096)),
                     splits: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
    """The Triton decode attention alone at each number of context splits, every layer's call
    replayed from one CUDA graph as the engine's decode runs it (eager launches took longer than
    the kernels at 512 tokens): its time per layer (each layer's own KV, so the L2 cache serves
    none of it) against its KV bytes at the copy bandwidth, and the number the engine's graphs
    use (`num_splits` over the table's width)."""
    from engine.kernels import triton_attention

    pool = engine.kv_pool.tensor
    num_blocks, layers, _, block_size, kv_heads, head_dim = pool.shape
    heads, dev = engine.model_config.num_heads, pool.device
    num_sms = getattr(engine.model.kernels, "num_sms", 1)
    g = torch.Generator(device=dev).manual_seed(0)
    for b, ctx in shapes:
        per = -(-ctx // block_size)
        if b * per > num_blocks:
            c.emit("attention_splits", batch=b, context=ctx, skipped="the pool holds fewer blocks")
            continue
        table = torch.randperm(num_blocks, device=dev, generator=g)[: b * per].view(b, per).contiguous()
        rows = torch.arange(b, device=dev)
        ctx_lens = torch.full((b,), ctx, device=dev)
        q = torch.randn(b, heads, head_dim, device=dev, generator=g).to(pool.dtype)
        out = torch.empty_like(q)
        kv_bytes = b * ctx * kv_heads * head_dim * 2 * pool.element_size()
        floor_us = kv_bytes / (fl["copy_gb_per_s"] * 1e9) * 1e6
        times: dict[int, float] = {}
        for s in splits:
            def run(s: int = s) -> None:
                for layer in range(layers):
                    triton_attention.paged_decode(q, pool, layer, table, rows, rows, ctx_lens, head_dim**-0.5, out, s)
            times[s] = best_s(c.device, replayed(c.device, run)) / layers * 1e6
        picked = triton_attention.num_splits(b, kv_heads, engine.max_model_len, num_sms)
        c.emit("attention_splits", batch=b, context=ctx, us_per_layer={s: round(t, 1) for s, t in times.items()},
               over_floor={s: round(t / floor_us, 2) for s, t in times.items()}, floor_us=round(floor_us, 1),
               graphs_use=picked, best=min(times, key=times.__getitem__))
