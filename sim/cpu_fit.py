"""A cost model fitted to this machine's CPU engine, for validating the simulator against the
real cluster where both can run (benchmarks/sim/sim_validate.py).

    profile_engine: the real LLMEngine (the model, one torch thread, as a worker runs it, in a
        process of its own) steps a staggered mix of requests (prompts and chunks of many
        sizes, some over a long cached prefix, decodes beside them); each step's composition
        (what the scheduler gave it), whether its token count was new to the process, and its time
    fit: step time ~ c · FEATURES, least squares of the relative error, prompt-computing steps
        and decode steps weighing the same in all, every coefficient kept >= 0 (a term the
        data cannot show is dropped)
    CpuCost: that fit, plus what serving adds around the engine, measured on the running
        cluster by the caller: per step and per streamed request (`step_overhead_s`,
        `seq_overhead_s`: the worker's output path between steps), the router's hops before
        the first step (`rpc_s`), a KV hand-off (`transfer_base_s`), and when a stream's later
        tokens reach the client against a steady pace (`delivery_s`, the measured streams'
        patterns, one replayed per simulated stream: the client's view only, the engines'
        timing is not moved by it)

The features follow the engine's code paths (engine/model/attention.py):
    step, tokens         per step, and per token through every linear layer
    causal_pairs         a first chunk's causal attention over itself, Σ n(n+1)/2 (SDPA's flash kernel)
    paged_pairs          a later chunk's masked attention over its gathered context, Σ n·(ctx+n)
    paged_kv             that gather, Σ (ctx+n)
    decode_kv            short queries' context read in place (the native kernel), Σ (ctx+n)
    sampled              rows through the LM head and the sampler
    new_shape            the step's token count is one this process's oneDNN has no
                         primitives for: every prepacked linear builds one (about 0.33 ms
                         each here, whatever the size), so a worker's first step of each
                         size costs 1-2 ms more on the tiny llama, twice the step itself
Without the split of attention, a step over a cached 1,000-token prefix ran 1.4-1.5x the fit
and a cold chunk 0.6x; without new_shape, the first-use cost was spread over every step.
"""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import SHORT_QUERY_MAX_LEN, StepFloor
from engine.core.fit import DecayedFit

FEATURES = ("step", "tokens", "causal_pairs", "paged_pairs", "paged_kv", "decode_kv", "sampled", "new_shape")
Chunks = Sequence[tuple[int, int]]
Sample = tuple[list[tuple[int, int]], int, bool, float]
"""(chunks, sampled rows, new shape, seconds) of one profiled step."""


def features(chunks: Chunks, num_sampled: int, new_shape: bool = False) -> list[float]:
    tokens = causal = paged = paged_kv = decode_kv = 0.0
    for n, ctx in chunks:
        tokens += n
        if n <= SHORT_QUERY_MAX_LEN:
            decode_kv += ctx + n
        elif ctx == 0:
            causal += n * (n + 1) / 2
        else:
            paged += n * (ctx + n)
            paged_kv += ctx + n
    return [1.0, tokens, causal, paged, paged_kv, decode_kv, float(num_sampled), float(new_shape)]


@dataclass(frozen=True)
class CpuCost:
    coef: tuple[float, ...]
    """Seconds per unit of each of FEATURES."""
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    rpc_s: float = 0.0
    transfer_base_s: float = 0.0
    delivery_s: tuple[tuple[float, ...], ...] = ()
    """Measured streams' delivery patterns (`delivery_cycle`; empty: every token seen as its step ends)."""
    hops_s: tuple[float, ...] = ()
    """Measured router hops, each request's TTFT at an idle rate less its fitted prefill and
    `hop_token_s` for its prompt (sorted samples; empty: `rpc_s` for every request)."""
    hop_token_s: float = 0.0
    """The hops' time per prompt token: whatever grows with a prompt beyond its fitted prefill
    (a profile of the running cluster found no per-token work in the router; the prefill
    worker's busy time was its engine steps, so part of it is likely the fit's error on long
    chunks over long contexts)."""
    push_token_s: float = 0.0
    """A prefill worker's time per KV token it pushes (the calibration leaves it 0: what a
    prompt's push costs here is in `hop_token_s`, and no run tells the two apart)."""
    floor: StepFloor | None = None
    """The workers' engines hold each step to this (`EngineConfig.step_floor`): an engine step
    takes the longer of the fit and the floor."""
    shape_cache: int = 256
    """Token counts a worker keeps primitives for: oneDNN's cache holds 1,024 primitives by
    default, least recently used out, and the tiny llama's layers have four linear shapes."""

    def engine_s(self, chunks: Chunks, num_sampled: int | None = None, new_shape: bool = False) -> float:
        sampled = len(chunks) if num_sampled is None else num_sampled
        fitted = sum(c * x for c, x in zip(self.coef, features(chunks, sampled, new_shape), strict=True))
        if self.floor is None:
            return fitted
        return max(fitted, self.floor.seconds(sum(n for n, _ in chunks), len(chunks)))

    def step_s(self, chunks: Chunks, num_sampled: int | None = None, new_shape: bool = False) -> float:
        if not chunks:
            return 0.0
        sampled = len(chunks) if num_sampled is None else num_sampled
        return self.engine_s(chunks, sampled, new_shape) + self.step_overhead_s + self.seq_overhead_s * sampled

    def for_worker(self) -> Callable[[Chunks, int | None], float]:
        """One worker's `step_s`: it remembers the token counts its steps ran (the last
        `shape_cache` of them), and a step of any other count pays `new_shape`."""
        seen: OrderedDict[int, None] = OrderedDict()

        def step_s(chunks: Chunks, num_sampled: int | None = None) -> float:
            if not chunks:
                return 0.0
            m = sum(n for n, _ in chunks)
            new = m not in seen
            seen[m] = None
            seen.move_to_end(m)
            if len(seen) > self.shape_cache:
                seen.popitem(last=False)
            return self.step_s(chunks, num_sampled, new)

        return step_s

    def transfer_s(self, num_tokens: int, same_node: bool) -> float:
        return self.transfer_base_s

    def store_s(self, num_tokens: int) -> float:
        """A fetch from the host's store: its round trips, as a transfer's (a shm copy on one host)."""
        return self.transfer_base_s

    def disk_s(self, num_tokens: int) -> float:
        """A spill's read back: not calibrated on this host (its page cache serves it)."""
        return 0.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)) + "\n")

    @classmethod
    def load(cls, path: Path) -> CpuCost:
        d = json.loads(path.read_text())
        floor = StepFloor(**d["floor"]) if d.get("floor") else None
        return cls(**{**d, "coef": tuple(d["coef"]), "delivery_s": tuple(map(tuple, d.get("delivery_s", ()))),
                      "hops_s": tuple(d.get("hops_s", ())), "floor": floor})


def delivery_cycle(itls_s: list[float]) -> tuple[float, ...]:
    """How one measured stream's tokens after its first decode token reached the client
    against a steady pace: token k's offset from where a pace of the stream's mean gap puts
    it (the first is 0, the next one's offset ends the cycle at 0 again). Read on two cores,
    half the gaps are shorter than a step: the client read two tokens at once, late for one
    and on time for the next. Replayed whole (from any phase: the cycle's offsets sum its
    gaps, the last one's included, to 0), a pattern keeps that pairing, which delays drawn
    one per token cannot produce."""
    gaps = itls_s[1:]  # the first gap is the hand-off's
    pace = sum(gaps) / len(gaps)
    return tuple(round(x, 6) for x in itertools.accumulate((g - pace for g in gaps[:-1]), initial=0.0))


def profile_engine(model_dir: str, num_requests: int = 256, chunk_tokens: int = 512, max_prompt: int = 1024,
                   seed: int = 0, shared_fraction: float = 0.3, timeout_s: float = 600.0) -> list[Sample]:
    """Every step of a staggered mix on the real engine, in a new Python process (oneDNN's
    primitives are per process, and this one's may hold any token count already).
    `shared_fraction` of the prompts continue an earlier one's blocks with a quarter as many
    new tokens: steps of few tokens over a long cached context, without which the fit cannot
    tell attention over context from the cost per token (the two grow together in a cold
    prompt's chunks)."""
    args = [model_dir, num_requests, chunk_tokens, max_prompt, seed, shared_fraction]
    done = subprocess.run([sys.executable, "-m", "sim.cpu_fit", json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"profiling the engine failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return [(list(map(tuple, c)), s, new, t) for c, s, new, t in json.loads(done.stdout.splitlines()[-1])]


def _profile_here(model_dir: str, num_requests: int, chunk_tokens: int, max_prompt: int, seed: int,
                  shared_fraction: float) -> list[Sample]:
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.core.request import SamplingParams

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
    shapes = {sum(n for n, _ in chunks) for chunks, _ in seen}
    seen.clear()
    samples: list[Sample] = []
    arrivals = sorted(rng.randrange(0, 6 * num_requests) for _ in range(num_requests))
    earlier: list[list[int]] = []
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            n = int(2 ** rng.uniform(4, max_prompt.bit_length() - 1))
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            long = [p for p in earlier if len(p) >= chunk_tokens]
            if long and rng.random() < shared_fraction:  # a few new tokens over a long cached prefix
                before = rng.choice(long)
                prompt = before[:len(before) // 16 * 16] + prompt[:max(n // 4, 1)]
            earlier.append(prompt)
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 96), ignore_eos=True))
        began = time.perf_counter()
        engine.step()
        took = time.perf_counter() - began
        if seen and seen[-1][0]:
            chunks, sampled = seen[-1]
            m = sum(n for n, _ in chunks)
            samples.append((chunks, sampled, m not in shapes, took))
            shapes.add(m)
        seen.clear()
        step += 1
    return samples


def fit(samples: Sequence[Sample]) -> tuple[float, ...]:
    """Least squares over FEATURES of each step's relative error (small steps count), every
    coefficient >= 0: the project's one fit (engine/core/fit.py DecayedFit), all samples alike
    (no decay). Steps that compute prompt tokens and pure decode steps weigh the same in all,
    however many of each the profile ran (decode steps outnumber them five to one, and a fit
    that follows them misses prefill)."""
    num_prefill = sum(any(n > 1 for n, _ in c) for c, *_ in samples)
    share = {True: 1 / max(num_prefill, 1), False: 1 / max(len(samples) - num_prefill, 1)}
    lsq = DecayedFit((0.0,) * len(FEATURES), decay=1.0)
    for chunks, sampled, new, seconds in samples:
        lsq.add(features(chunks, sampled, new), seconds, share[any(n > 1 for n, _ in chunks)] / seconds ** 2)
    coef = lsq.solve() or [0.0] * len(FEATURES)
    return tuple(max(c, 0.0) for c in coef)


if __name__ == "__main__":  # profile_engine's child: arguments as one JSON list, samples as one JSON line
    print(json.dumps(_profile_here(*json.loads(sys.argv[1]))))
