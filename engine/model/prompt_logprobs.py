"""Prompt log-probabilities (lm-evaluation-harness's log-likelihoods, OpenAI `echo` with
`logprobs`, vLLM's `prompt_logprobs`), gathered where the prompt is computed.

A chunk computing positions s..e-1 of a prompt of P tokens makes the logits that predict its
tokens s+1..min(e, P-1): for each, the token's log-probability, its rank among the vocabulary
(1: the likeliest) and the position's k likeliest tokens. The model hands over the logits a
slice at a time (`LlamaForCausalLM.forward`'s `prompt_rows`), so a long prompt's never sit in
memory at once. A position already recorded (a recompute after preemption) is not recorded
again. Prefix-cache hits would skip positions, so such a prompt is computed whole
(`KVCacheManager.find_cached_prefix`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import PromptLogprob, Request, TopLogprobs


@dataclass
class PromptRows:
    """A step's prompt positions whose logits are wanted: their token indices in the batch,
    and per position the request, the position, and its next prompt token."""

    index: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)

    def add(self, request: Request, start: int, num_new: int, offset: int) -> None:
        """A chunk of `num_new` tokens from position `start`, the first at batch index `offset`."""
        end = min(start + num_new, request.num_prompt_tokens - 1)
        for p in range(max(start, len(request.prompt_logprobs)), end):
            self.index.append(offset + p - start)
            self.requests.append(request)
            self.positions.append(p)
            self.targets.append(request.prompt_token_ids[p + 1])

    def take(self, at: int, logits: torch.Tensor) -> None:
        """Records the positions at..at + len(logits) from their logits [rows, vocab]."""
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(self.targets[at:at + len(logits)], dtype=torch.long, device=logits.device)
        chosen = lp.gather(1, targets[:, None])
        ranks = (lp > chosen).sum(dim=-1) + 1
        requests = self.requests[at:at + len(logits)]
        k = max(r.params.prompt_logprobs or 0 for r in requests)
        values, ids = lp.topk(k, dim=-1) if k else (None, None)
        tops = zip(ids.tolist(), values.tolist(), strict=True) if k else (([], []) for _ in requests)
        for r, p, value, rank, (top_ids, top_lps) in zip(requests, self.positions[at:at + len(logits)],
                                                          chosen[:, 0].tolist(), ranks.tolist(), tops, strict=True):
            if p == len(r.prompt_logprobs):
                n = r.params.prompt_logprobs or 0
                r.prompt_logprobs.append(PromptLogprob(value, rank, TopLogprobs(tuple(top_ids[:n]), tuple(top_lps[:n]))))
