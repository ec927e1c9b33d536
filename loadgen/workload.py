"""What a bench run sends: token-id prompts (any model works) and when.

  synthetic: prompt and output lengths uniform within +-50% of their means; a fraction of
             requests start with one of a few shared prefixes (prefix-cache workloads)
  trace:     Mooncake-format JSONL (`hash_ids`, lengths, timestamps): each 512-token hash
             block becomes `block_tokens` tokens (the same hash id gives the same tokens, so
             shared prefixes stay shared); lengths scale by the same factor (at least 1) and
             arrival times by `time_scale`
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS_ORIG = 512


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int]
    max_tokens: int
    at_s: float | None = None
    """Arrival offset (trace replay); None: from the rate or the concurrency."""


def synthetic(n: int, prompt_len: int, output_len: int, shared_fraction: float, num_prefixes: int,
              prefix_len: int, vocab: int, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    items = []
    for _ in range(n):
        plen = max(1, int(prompt_len * rng.uniform(0.5, 1.5)))
        head = rng.choice(prefixes) if prefixes and rng.random() < shared_fraction else []
        tail = [rng.randrange(3, vocab) for _ in range(max(plen - len(head), 1))]
        items.append(WorkloadRequest(head + tail, max(1, int(output_len * rng.uniform(0.5, 1.5)))))
    return items


def from_trace(path: Path, limit: int, block_tokens: int, max_prompt_tokens: int, vocab: int,
               time_scale: float) -> list[WorkloadRequest]:
    scale = block_tokens / TRACE_BLOCK_TOKENS_ORIG
    items = []
    import numpy as np  # here: bench's other paths start without it

    blocks: dict[int, list[int]] = {}
    ids = list(range(vocab))  # one int object per token id, shared by every prompt (not 28 bytes a token)
    for line in path.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        prompt: list[int] = []
        for h in rec["hash_ids"]:
            if h not in blocks:  # a block's tokens are drawn from its hash id: the same in every run
                blocks[h] = [ids[t] for t in np.random.default_rng(h).integers(3, vocab, block_tokens).tolist()]
            prompt += blocks[h]
        prompt = prompt[:max(1, min(int(rec["input_length"] * scale), max_prompt_tokens))]
        items.append(WorkloadRequest(prompt, max(1, int(rec["output_length"] * scale)),
                                     rec["timestamp"] / 1000 * time_scale))
    return items
