"""A cost model fitted to this machine's CPU engine, for validating the simulator against the
real cluster where both can run (benchmarks/sim_validate.py).

    profile_engine: the real LLMEngine (the model, one torch thread, as a worker runs it)
        steps a staggered mix of requests (prompts and chunks of many sizes, decodes
        beside them); each step's composition (what the scheduler gave it) and time
    fit: step time ~ c · (1, new tokens, attention pairs, KV read, sampled rows), least
        squares of the relative error (a decode step counts as much as a long prefill chunk)
        with every coefficient kept >= 0 (a term the data cannot show is dropped)
    CpuCost: that fit, plus what serving adds around the engine, measured on the running
        cluster by the caller: per step and per streamed request (`step_overhead_s`,
        `seq_overhead_s`: the worker's output path between steps), the router's hops before
        the first step (`rpc_s`), a KV hand-off (`transfer_base_s`), and how late a token
        reaches the client past its step (`jitter_s`, samples drawn per token: the client's
        view only, the engines' timing is not moved by it)

Attention pairs are a chunk's new tokens times the context each attends to, Σ n·(ctx + (n+1)/2);
KV read is Σ (ctx + n): the two ways context costs, for prefill and for decode.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import StepFloor

FEATURES = ("step", "tokens", "attention_pairs", "kv_read", "sampled")
Chunks = Sequence[tuple[int, int]]


def features(chunks: Chunks, num_sampled: int) -> list[float]:
    return [1.0, float(sum(n for n, _ in chunks)), sum(n * (ctx + (n + 1) / 2) for n, ctx in chunks),
            float(sum(ctx + n for n, ctx in chunks)), float(num_sampled)]


@dataclass(frozen=True)
class CpuCost:
    coef: tuple[float, ...]
    """Seconds per unit of each of FEATURES."""
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    rpc_s: float = 0.0
    transfer_base_s: float = 0.0
    jitter_s: tuple[float, ...] = ()
    """Measured delays of a token's delivery past its step's end (sorted samples; empty: none)."""
    push_token_s: float = 0.0
    """A prefill worker's time per KV token it pushes (on CPU the copies share its cores)."""
    floor: StepFloor | None = None
    """The workers' engines hold each step to this (`EngineConfig.step_floor`): an engine step
    takes the longer of the fit and the floor."""

    def engine_s(self, chunks: Chunks, num_sampled: int | None = None) -> float:
        sampled = len(chunks) if num_sampled is None else num_sampled
        fitted = sum(c * x for c, x in zip(self.coef, features(chunks, sampled), strict=True))
        if self.floor is None:
            return fitted
        return max(fitted, self.floor.seconds(sum(n for n, _ in chunks), len(chunks)))

    def step_s(self, chunks: Chunks, num_sampled: int | None = None) -> float:
        if not chunks:
            return 0.0
        sampled = len(chunks) if num_sampled is None else num_sampled
        return self.engine_s(chunks, sampled) + self.step_overhead_s + self.seq_overhead_s * sampled

    def transfer_s(self, num_tokens: int, same_node: bool) -> float:
        return self.transfer_base_s

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)) + "\n")

    @classmethod
    def load(cls, path: Path) -> CpuCost:
        d = json.loads(path.read_text())
        floor = StepFloor(**d["floor"]) if d.get("floor") else None
        return cls(**{**d, "coef": tuple(d["coef"]), "jitter_s": tuple(d.get("jitter_s", ())), "floor": floor})


def profile_engine(model_dir: str, num_requests: int = 96, chunk_tokens: int = 512, max_prompt: int = 1024,
                   seed: int = 0) -> list[tuple[list[tuple[int, int]], int, float]]:
    """(chunks, sampled rows, seconds) for every step of a staggered mix on the real engine."""
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, cache=CacheConfig(kv_cache_bytes=256 * 2**20),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=chunk_tokens)))
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    schedule = engine.scheduler.schedule
    seen: list[tuple[list[tuple[int, int]], int]] = []

    def recorded():  # type: ignore[no-untyped-def]
        out = schedule()
        chunks = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled]
        sampled = sum(s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens for s in out.scheduled)
        seen.append((chunks, sampled))
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    engine.generate([[5] * 64], SamplingParams(max_tokens=4, ignore_eos=True))  # warm: first-use costs out
    seen.clear()
    samples = []
    arrivals = sorted(rng.randrange(0, 6 * num_requests) for _ in range(num_requests))
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            n = int(2 ** rng.uniform(4, max_prompt.bit_length() - 1))
            engine.add_request([rng.randrange(3, vocab) for _ in range(n)],
                               SamplingParams(max_tokens=rng.randrange(1, 96), ignore_eos=True))
        began = time.perf_counter()
        engine.step()
        took = time.perf_counter() - began
        if seen and seen[-1][0]:
            samples.append((seen[-1][0], seen[-1][1], took))
        seen.clear()
        step += 1
    return samples


def fit(samples: Sequence[tuple[Chunks, int, float]]) -> tuple[float, ...]:
    """Least squares over FEATURES, coefficients >= 0 (the most negative dropped and refitted)."""
    import numpy as np

    y = np.array([t for _, _, t in samples])
    x = np.array([features(c, s) for c, s, _ in samples]) / y[:, None]  # relative error: small steps count
    y = np.ones_like(y)
    scale = np.maximum(x.max(axis=0), 1e-12)
    free = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, free] / scale[free], y, rcond=None)
        if (coef >= 0).all() or len(free) == 1:
            out = [0.0] * len(FEATURES)
            for i, c in zip(free, coef, strict=True):
                out[i] = max(float(c / scale[i]), 0.0)
            return tuple(out)
        free.pop(int(np.argmin(coef)))
