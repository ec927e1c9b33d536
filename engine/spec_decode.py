"""Speculative decoding, the proposing half: who proposes tokens, and how many (torch-free).

    LLMEngine.step --SpecPolicy.plan(decoding requests)--> k per request (0: not this step)
                   --Proposer.propose([(request, k)])--> request.spec_token_ids (at most k)
    Scheduler: a decoding request with proposals computes 1 + k tokens (its last token and
        the proposals) in one chunk over the paged KV, beside the batch's other work
    engine/spec_verify.py: the target model's logits at those positions accept a prefix of
        the proposals and add one token of its own; the rest is rolled back
    SpecPolicy.verified(request, proposed, accepted): the request's acceptance, and back-off

Proposers sit behind `Proposer`: one call per step with every request that may propose
(a draft model runs them as one batch; a head reading the target's hidden states, EAGLE-
style, would take them here too). `NgramProposer` is prompt lookup: the last n tokens
(longest n first) are looked for earlier in the prompt and output, and what followed the
most recent match is proposed. It costs no model, and on text that copies its input
(editing, summarising, code completion over a given file) it is often right.

The policy is load-aware. Verification costs one token of compute per proposal, which is
nearly free while a step is memory-bound (few requests) and steals from the batch once it
is not, so a step's decode tokens plus proposals stay within `max_batched_tokens`: alone, a
request gets `num_speculative_tokens`; as the batch grows each gets fewer, and at that many
requests none. Each request proposes as many tokens as its acceptance (an exponential average over its
verifications, of the part of its proposals accepted) says are likely to be kept, at least
one; one whose acceptance falls under `min_acceptance` stops proposing for `backoff_steps`
steps, twice as long each time it fails again.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.types import RequestId

ACCEPTANCE_WEIGHT = 0.3
"""Weight of the newest verification in a request's acceptance average."""


class Proposer(Protocol):
    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        """For each (request, k): at most k tokens to follow its tokens so far (none: no guess)."""
        ...

    def forget(self, live: set[RequestId]) -> None:
        """Drop what is kept for requests not in `live` (they finished or left)."""
        ...


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        out = {}
        for request, k in wanted:
            tokens = self.lookup(request.all_token_ids, k)
            if tokens:
                out[request.request_id] = tokens
        return out

    def forget(self, live: set[RequestId]) -> None:
        """Nothing is kept between steps."""

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix."""
        ids = np.asarray(token_ids, dtype=np.int64)
        total = len(ids)
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            windows = sliding_window_view(ids[: total - 1], n)  # each is followed by a token
            hits = np.flatnonzero((windows == ids[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start: start + k].tolist()
        return []


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, context_limit: int) -> None:
        self.config, self.context_limit = config, context_limit
        self.step = 0

    def plan(self, decoding: Sequence[Request]) -> list[tuple[Request, int]]:
        """The requests that may propose this step and how many tokens each (called once per step)."""
        self.step += 1
        c = self.config
        spare = c.max_batched_tokens - len(decoding)
        if spare <= 0 or not decoding:
            return []
        share = min(c.num_speculative_tokens, spare // len(decoding))
        wanted = []
        for r in decoding:
            room = min(r.params.max_tokens - len(r.output_token_ids), self.context_limit - r.num_tokens) - 1
            k = min(share, room, math.ceil(r.spec_acceptance * c.num_speculative_tokens))
            if k > 0 and self.step >= r.spec_paused_until:
                wanted.append((r, k))
        return wanted

    def verified(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` tokens accepted `num_accepted`: update the average,
        and pause a request whose proposals keep failing."""
        if num_proposed <= 0:
            return
        rate = num_accepted / num_proposed
        request.spec_acceptance += ACCEPTANCE_WEIGHT * (rate - request.spec_acceptance)
        if rate >= self.config.min_acceptance:
            request.spec_failures = 0
        elif request.spec_acceptance < self.config.min_acceptance:
            request.spec_failures += 1
            request.spec_paused_until = self.step + 1 + self.config.backoff_steps * 2 ** (request.spec_failures - 1)
            request.spec_acceptance = 1.0  # after the pause it starts afresh
