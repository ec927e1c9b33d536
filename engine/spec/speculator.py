"""Speculator: speculative decoding inside one engine step, and its counters.

    LLMEngine.step
      -> Speculator.propose(scheduler): SpecPolicy picks who proposes and how many tokens,
         the Proposer fills their `spec_token_ids` (engine/spec/spec_decode.py)
      -> Scheduler.schedule: each gets 1 + k tokens in the batch where budget and blocks allow
      -> ModelRunner: 1 + k logit rows for each of them, one for every other sampled request
      -> Speculator.sample(out, requests, logits): the plain rows through the Sampler, the
         speculating requests through `verify` (engine/spec/spec_verify.py); the policy learns each
         one's acceptance; counters as vLLM keeps them
      -> Scheduler.update_after_step: accepted KV kept, the rest rolled back
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.config import SpeculativeConfig
from engine.structured.constrainer import Constrainer
from engine.core.request import Logprob, Request
from engine.model.sampler import Sampler
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.spec.spec_cost import SpecCost
from engine.spec.spec_decode import NgramProposer, Proposer, SpecPolicy
from engine.spec.spec_verify import Verified, verify
from engine.types import RequestId


PROPOSE_WEIGHT = 0.2
"""Weight of the newest step in the proposer's time per token."""


@dataclass
class SpecCounters:
    """Cumulative, for metrics (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0
    """Verifications (a request's proposals checked in one step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """[i]: verifications that accepted the proposal at position i (0-based)."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, context_limit: int, proposer: Proposer | None = None) -> None:
        self.config = config
        self.policy = SpecPolicy(config, context_limit)
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.propose_s = 0.0
        """The proposer's seconds per token it was asked for (an exponential average): a draft
        model's forward, which the policy prices with the rows that verify it."""
        self.cost = SpecCost()
        """The target's step cost, the proposer's time left out (it is priced by `propose_s`)."""
        self._step_propose_s = 0.0
        """What proposing took in the step last planned."""

    def observe(self, rows: int, kv_tokens: int, speculating: bool, seconds: float) -> None:
        """A decode step's whole period (engine/spec/spec_cost.py), by which the policy prices
        proposals; what proposing took in it is counted by `propose_s`, not here."""
        self.cost.observe(rows, kv_tokens, speculating, seconds - self._step_propose_s)

    def propose(self, scheduler: Scheduler) -> None:
        """Fills the proposals of the decoding requests the policy picks (others: none)."""
        decoding = []
        for r in scheduler.running:
            r.spec_token_ids = []
            if r.num_computed_tokens == r.num_tokens - 1 and r.output_token_ids and not r.params.reads_history:
                decoding.append(r)
        self.proposer.forget(set(scheduler.requests))
        wanted = self.policy.plan(decoding, self.cost.latest, self.propose_s)
        self._step_propose_s = 0.0
        if wanted:
            began = time.perf_counter()
            proposed = self.proposer.propose(wanted)
            self._step_propose_s = time.perf_counter() - began
            self.propose_s += PROPOSE_WEIGHT * (self._step_propose_s / sum(k for _, k in wanted) - self.propose_s)
            for rid, tokens in proposed.items():
                r = scheduler.requests[rid]
                r.spec_token_ids = Constrainer.valid_proposals(r, tokens)  # what a constraint forbids is cut

    def sample(self, sampler: Sampler, out: SchedulerOutput, requests: list[Request], logits: torch.Tensor) -> tuple[
            dict[RequestId, tuple[int, float | Logprob | None]], dict[RequestId, Verified]]:
        """The sampled token of each plain request, the verification of each speculating one."""
        num_spec = {s.request.request_id: s.num_spec_tokens for s in out.scheduled if s.num_spec_tokens}
        if not num_spec:
            return sampler.sample_by_id(logits, requests), {}
        plain_rows, plain, spans, row = [], [], [], 0
        for r in requests:
            k = num_spec.get(r.request_id, 0)
            if k:
                spans.append((r, row, k))
            else:
                plain_rows.append(row)
                plain.append(r)
            row += 1 + k
        sampled = sampler.sample_by_id(logits[plain_rows], plain) if plain else {}
        verified = {}
        for r, row, k in spans:
            v = verified[r.request_id] = verify(sampler, logits[row: row + 1 + k], r, r.spec_token_ids[:k])
            self._count(r, k, v.num_accepted)
        return sampled, verified

    def _count(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.policy.verified(request, num_proposed, num_accepted)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_proposed
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
