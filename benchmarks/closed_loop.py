"""A closed loop of requests through one in-process LLMEngine, for the engine benchmarks.

`concurrency` requests are in flight; when one ends, the next takes its slot, so the batch
stays full while requests of different lengths come and go. Inter-token latency is counted
per token: an output carrying n tokens (accepted speculative proposals) after dt is n gaps
of dt / n, not one fast one.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.request import SamplingParams


@dataclass
class LoopResult:
    tokens: list[list[int]]
    """Each request's output tokens, in the order the requests were given."""
    elapsed_s: float
    gaps_s: list[float]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.elapsed_s

    @property
    def itl_p50_ms(self) -> float:
        return 1000 * statistics.median(self.gaps_s)


def closed_loop(engine: LLMEngine, requests: Sequence[tuple[str, SamplingParams]], concurrency: int) -> LoopResult:
    index: dict[str, int] = {}
    last_at: dict[str, float] = {}
    tokens: list[list[int]] = [[] for _ in requests]
    gaps: list[float] = []
    started, nxt = time.perf_counter(), 0
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
    return LoopResult(tokens, time.perf_counter() - started, gaps)
