"""Speculative decoding, the proposing half: who proposes tokens, and how many (torch-free).

    LLMEngine.step --SpecPolicy.plan(decoding requests)--> k per request (0: not this step)
                   --Proposer.propose([(request, k)])--> request.spec_token_ids (at most k)
    Scheduler: a decoding request with proposals computes 1 + k tokens (its last token and
        the proposals) in one chunk over the paged KV, beside the batch's other work
    engine/spec/spec_verify.py: the target model's logits at those positions accept a prefix of
        the proposals and add one token of its own; the rest is rolled back
    SpecPolicy.verified(request, proposed, accepted): the request's acceptance, and back-off

Proposers sit behind `Proposer`: one call per step with every request that may propose
(a draft model runs them as one batch; a head reading the target's hidden states, EAGLE-
style, would take them here too). `NgramProposer` is prompt lookup: the last n tokens
(longest n first) are looked for earlier in the prompt and output, and what followed the
most recent match is proposed. It costs no model, and on text that copies its input
(editing, summarising, code completion over a given file) it is often right.

The policy prices proposals. Verification costs a row of compute per proposal, nearly free
while a step is memory-bound (few requests) and stealing from the batch once it is not.
Once the step cost is fitted (engine/spec/spec_cost.py: a step of n rows over kv KV tokens takes
a + b n + c kv, plus o if it verifies any proposal), a proposal is made only where it pays:
the j-th proposal of a request whose acceptance is alpha is kept with probability alpha^j
(each kept only if all before it are) and costs b + c ctx (its row, and its row's read of
the request's context) plus the proposer's own time per token; proposals are taken
best-first while each one's expected tokens per second of step it adds beat the step's
tokens per second so far (`p T > N dt`), and only if together they also pay o. At one
request a step is mostly its fixed cost and most proposals pay; at 32 on a CPU a row costs
what a request does and only near-certain ones do. Before the model is fitted the batch
shares `max_batched_tokens` (decode tokens plus proposals), which stays the cap: alone, a request gets `num_speculative_tokens`; as the batch grows each gets
fewer, at that many requests none. A request's acceptance is an exponential average over
its verifications of the part of its proposals accepted, starting from the engine's prior
(the recent acceptance of all requests' proposals, drifting back toward 1 while nothing is
verified), so a new request on text where proposals fail does not pay to learn it again (the threshold policy proposes as
many as it says are likely kept, at least one); one whose acceptance falls under
`min_acceptance` stops proposing for `backoff_steps` steps, twice as long each time it
fails again.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.types import RequestId

ACCEPTANCE_WEIGHT = 0.3
"""Weight of the newest verification in a request's acceptance average."""
PRIOR_WEIGHT = 0.05
"""Weight of the newest verification (any request's) in the engine's acceptance prior."""
PRIOR_RELAX_STEPS = 512
"""Steps over which the prior, with no verification to learn from, drifts back toward 1
(so an engine whose proposals stopped paying tries again as its text changes)."""


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


def priced(decoding: Sequence[Request], limits: Sequence[tuple[Request, int]],
           cost: tuple[float, float, float, float], propose_s: float, budget: int,
           acceptance: Callable[[Request], float] = lambda r: r.spec_acceptance or 1.0) -> list[tuple[Request, int]]:
    """Proposals best-first by expected kept tokens per second of step they add, each taken
    while it raises the step's expected tokens per second, at most `budget` in all and a
    request's limit each; none unless together they also pay what speculating at all costs
    a step (`o`; see the module's docstring)."""
    a, b, c, o = cost
    step_s = a + b * len(decoding) + c * sum(r.num_tokens for r in decoding)
    plain_rate = len(decoding) / step_s if step_s > 0 else 0.0
    tokens = float(len(decoding))
    candidates = []
    for r, limit in limits:
        alpha = min(max(acceptance(r), 0.0), 1.0)
        dt = b + c * r.num_tokens + propose_s
        candidates += [(alpha**j / dt if dt > 0 else math.inf, j, alpha**j, dt, r) for j in range(1, limit + 1)]
    candidates.sort(key=lambda x: (-x[0], x[1]))
    k: dict[RequestId, int] = {}
    picked: list[Request] = []
    for _, j, p, dt, r in candidates:
        if budget <= 0:
            break
        if k.get(r.request_id, 0) != j - 1 or p * step_s <= tokens * dt:
            continue
        if j == 1:
            picked.append(r)
        k[r.request_id] = j
        step_s += dt
        tokens += p
        budget -= 1
    if not picked or tokens / (step_s + o) <= plain_rate:
        return []
    return [(r, k[r.request_id]) for r in picked]


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, context_limit: int) -> None:
        self.config, self.context_limit = config, context_limit
        self.step = 0
        self.prior = 1.0
        """What a request's proposals are expected to keep before its own have been verified:
        the recent acceptance of every request's (exponential average), 1 at first."""

    def acceptance(self, request: Request) -> float:
        return self.prior if request.spec_acceptance is None else request.spec_acceptance

    def plan(self, decoding: Sequence[Request], cost: tuple[float, float, float, float] | None = None,
             propose_s: float = 0.0) -> list[tuple[Request, int]]:
        """The requests that may propose this step and how many tokens each (called once per
        step). `cost`: (a, b, c, o) in seconds (engine/spec/spec_cost.py), None before it is
        fitted; `propose_s`: the proposer's seconds per proposed token."""
        self.step += 1
        self.prior += (1.0 - self.prior) / PRIOR_RELAX_STEPS
        c = self.config
        spare = c.max_batched_tokens - len(decoding)
        if spare <= 0 or not decoding:
            return []
        # priced, a request may take any number up to the cap, the budget shared best-first;
        # else the budget is split evenly
        if not c.priced:
            cost = None
        share = min(c.num_speculative_tokens, spare if cost is not None else spare // len(decoding))
        limits = []
        for r in decoding:
            room = min(r.params.max_tokens - len(r.output_token_ids), self.context_limit - r.num_tokens) - 1
            if self.step >= r.spec_paused_until and min(share, room) > 0:
                limits.append((r, min(share, room)))
        if cost is None:
            wanted = [(r, min(k, math.ceil(self.acceptance(r) * c.num_speculative_tokens))) for r, k in limits]
            return [(r, k) for r, k in wanted if k > 0]
        return priced(decoding, limits, cost, propose_s, spare, self.acceptance)

    def verified(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` tokens accepted `num_accepted`: update the average,
        and pause a request whose proposals keep failing."""
        if num_proposed <= 0:
            return
        rate = num_accepted / num_proposed
        self.prior += PRIOR_WEIGHT * (rate - self.prior)
        acceptance = self.acceptance(request)
        request.spec_acceptance = acceptance + ACCEPTANCE_WEIGHT * (rate - acceptance)
        if rate >= self.config.min_acceptance:
            request.spec_failures = 0
        elif request.spec_acceptance < self.config.min_acceptance:
            request.spec_failures += 1
            request.spec_paused_until = self.step + 1 + self.config.backoff_steps * 2 ** (request.spec_failures - 1)
            request.spec_acceptance = None  # after the pause it starts afresh, from the prior
