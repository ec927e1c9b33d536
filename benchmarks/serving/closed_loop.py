"""A closed loop of requests through one in-process LLMEngine, for the engine benchmarks.

`concurrency` requests are in flight; when one ends, the next takes its slot, so the batch
stays full while requests of different lengths come and go. Inter-token latency is counted
per token: an output carrying n tokens (accepted speculative proposals) after dt is n gaps
of dt / n, not one fast one.

Two throughputs: over the whole run, and over the part of it while the loop was full (from
the start until the first request ends that no waiting request can replace). The second is
what a server under steady load sees; the first adds the drain of the last requests, which
a fixed batch of equal lengths exaggerates: run without speculation its requests all end in
one step, run with it they end apart, and the last few decode alone.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams


@dataclass
class LoopResult:
    tokens: list[list[int]]
    """Each request's output tokens, in the order the requests were given."""
    elapsed_s: float
    gaps_s: list[float]
    full_s: float
    """How long the loop stayed full (all of `elapsed_s` where it never drained)."""
    full_tokens: int
    """Output tokens produced in that time."""

    @property
    def output_tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.elapsed_s

    @property
    def full_tokens_per_s(self) -> float:
        return self.full_tokens / self.full_s

    @property
    def itl_p50_ms(self) -> float:
        return 1000 * statistics.median(self.gaps_s)


def closed_loop(engine: LLMEngine, requests: Sequence[tuple[str, SamplingParams]], concurrency: int) -> LoopResult:
    index: dict[str, int] = {}
    last_at: dict[str, float] = {}
    tokens: list[list[int]] = [[] for _ in requests]
    gaps: list[float] = []
    started, nxt, full = time.perf_counter(), 0, None
    while nxt < len(requests) or engine.has_unfinished():
        while nxt < len(requests) and engine.scheduler.num_unfinished < concurrency:
            rid = engine.add_request(*requests[nxt])
            index[rid], last_at[rid] = nxt, time.perf_counter()
            nxt += 1
        for out in engine.step():
            now, n, mine = time.perf_counter(), len(out.new_token_ids), tokens[index[out.request_id]]
            if mine:  # after the first token
                gaps += [(now - last_at[out.request_id]) / n] * n
            last_at[out.request_id] = now
            mine += out.new_token_ids
        if full is None and nxt == len(requests) and engine.scheduler.num_unfinished < min(concurrency, len(requests)):
            full = (time.perf_counter() - started, sum(map(len, tokens)))
    elapsed = time.perf_counter() - started
    full_s, full_tokens = full or (elapsed, sum(map(len, tokens)))
    return LoopResult(tokens, elapsed, gaps, full_s, full_tokens)
