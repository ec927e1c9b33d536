"""Iteration-level scheduler: one token budget per step, no prefill/decode split (torch-free).

Each step walks the requests by aged priority class; within a class, output tokens
first (in arrival order), then prompt work, running or waiting, in fair order among
tenants (`engine.core.fair_order`). Each gets up to its missing tokens within the budget, so
neither a more important request nor a light tenant's is held behind the prefill chunks
of a less important one or of a heavy tenant's backlog.
When blocks run out the least important running request (lowest priority, then newest)
is preempted by recompute. Prefix-cache hits are claimed at a request's first schedule.
Requests in WAITING_FOR_REMOTE_KV hold reserved blocks and are skipped until their
KV arrives; then they rejoin like any waiting request with computed tokens.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_pool import PoolUsage
from engine.config import SchedulerConfig
from engine.core.fair_order import FairOrder
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import FinishReason, Logprob, Request, RequestStatus
from engine.types import BlockId, EngineLoad, InvalidRequestError, RequestId

if TYPE_CHECKING:
    from engine.spec.spec_verify import Verified

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, starting at request.num_computed_tokens."""
    num_spec_tokens: int = 0
    """Of those, the request's proposed tokens (its `spec_token_ids`) after its last token."""


@dataclass
class SchedulerOutput:
    """What one step computes, in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[RequestId] = field(default_factory=list)

    @property
    def decodes_only(self) -> bool:
        """Every request computes one token past its proposals: no prompt's chunk in the step."""
        return all(s.num_new_tokens - s.num_spec_tokens == 1 for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float],
    ) -> None:
        self.config = config.resolved(None)  # the engine has set a GPU's budget; else a CPU's
        self.kv = kv
        self.max_model_len = max_model_len
        budget = self.config.max_num_batched_tokens
        fits = kv.blocks_to_compute(max_model_len, budget) <= kv.pool.num_free_blocks
        self.context_limit = max_model_len if fits else min(max_model_len, kv.pool.num_free_blocks * kv.block_size + 1)
        """Where a sequence stops with finish reason length: the model's context, or the
        pool's, whichever is shorter. A sequence alone in a pool smaller than the model's
        context would otherwise preempt itself to recompute, grow back, and again, forever.
        (The last sampled token needs no slot, hence the + 1.) A model whose layers all slide
        their window holds only a window's blocks, so the pool limits it less."""
        self.clock = clock
        self.requests: dict[RequestId, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._seq = 0
        self.fair = FairOrder(config.fair_burst_tokens)
        self.num_preemptions = 0
        """Cumulative, for metrics."""
        self.in_flight: frozenset[RequestId] = frozenset()
        """Requests in a step the device still runs (engine/model/overlap.py): one that ends now keeps
        its blocks, held (`KVCacheManager.hold`), until that step lands; their ids in `held_in_flight`."""
        self.held_in_flight: list[RequestId] = []

    # -- admission -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._admit(request)
        self.waiting.append(request)

    def add_remote_request(self, request: Request) -> bool:
        """Reserve blocks for a prompt whose KV another worker computes.

        Cached prefix blocks are reused; request.num_cached_tokens tells the sender
        which leading tokens it need not send. False (and nothing kept) on shortage.
        """
        self._admit(request)
        cached, num_cached = self.kv.find_cached_prefix(request)
        missing = request.num_prompt_tokens - num_cached
        if not self.kv.allocate_slots(request, missing, cached, next_query=request.num_prompt_tokens):
            del self.requests[request.request_id]
            return False
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return True

    def remote_kv_ready(self, request_id: RequestId, first_token_id: int) -> None:
        """The prompt's KV has landed in the reserved blocks; decode from here."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequestError(f"request {request_id} is not waiting for remote KV")
        self.landed(request, first_token_id)

    def landed(self, request: Request, first_token_id: int) -> None:
        """A request whose blocks hold its prompt's KV (a remote prefill's, or its parent's
        for a forked choice) and whose first token is drawn: it waits to decode from there."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        request.append_output(first_token_id)
        reason = request.stop_reason_for_last_token(self.context_limit)
        if reason is not None:
            self.finish(request, reason)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _admit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.max_model_len}, so the prompt must be shorter than that"
            )
        if (
            not self.config.enable_chunked_prefill
            and request.num_prompt_tokens > self.config.max_num_batched_tokens
        ):
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} with chunked "
                "prefill off; enable chunked prefill or raise the budget"
            )
        if self.context_limit < self.max_model_len and request.num_prompt_tokens + 1 >= self.context_limit:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens, more than the KV pool holds "
                f"(at most {self.context_limit - 2} prompt tokens)"
            )
        request.arrival_seq = self._seq
        self._seq += 1
        output = min(request.params.max_tokens, max(self.max_model_len - request.num_prompt_tokens, 0))
        if not self.requests:
            self.fair.idle()
        self.fair.tag(request, request.num_prompt_tokens + output)
        self.requests[request.request_id] = request

    # -- the step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One pass over running and waiting requests in `_step_order`.

        A waiting request of a more important class takes the budget (and free blocks)
        before less important running ones, so it is not held behind their prefill chunks;
        within a class, output tokens come first, then prompt work in fair order among
        tenants. After a preemption, or once a waiting request does not fit, no waiting
        request starts this step.

        Nothing running and nothing started is a stall when waiting requests hold the
        blocks: prompts whose remote KV landed, each needing a block more for its first
        step, can fill a decode worker's pool, and nothing would ever free one (seen in the
        simulator: 34 requests on one decode worker, forever). Then the least important of
        those holders gives its blocks back as a preempted request would (it recomputes
        later), one at a time, until a request starts.
        """
        out = self._pass()
        while not out.scheduled and not self.running and self._evict_a_waiting_holder():
            out = self._pass()
        return out

    def _pass(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        admitting = True
        for request in sorted([*self.running, *self.waiting], key=self._step_order):
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING:
                budget = self._schedule_running(out, request, budget)
            elif admitting:  # waiting (one preempted this step ends `admitting` first)
                admitting = not out.preempted_ids and self._start_waiting(out, request, budget)
                if admitting:
                    budget -= out.scheduled[-1].num_new_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        num_new = self._num_new_tokens(request, budget)
        if num_new == 0:
            return budget
        num_spec = min(len(request.spec_token_ids), budget - 1) if num_new == 1 else 0
        if num_spec and self.kv.allocate_slots(request, 1 + num_spec):  # proposals never preempt anyone
            out.scheduled.append(ScheduledRequest(request, 1 + num_spec, num_spec))
            return budget - 1 - num_spec
        request.spec_token_ids = []
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return budget
        request.num_prefill_chunks += request.num_computed_tokens < request.num_prompt_tokens
        out.scheduled.append(ScheduledRequest(request, num_new))
        return budget - num_new

    def _start_waiting(self, out: SchedulerOutput, request: Request, budget: int) -> bool:
        """Move `request` to running with its first tokens this step; False if it does not fit."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        cached: list[BlockId] = []
        num_cached = 0
        if not request.block_ids:
            cached, num_cached = self.kv.find_cached_prefix(request)
        num_new = self._num_new_tokens(request, budget, num_cached)
        if num_new == 0 or not self.kv.allocate_slots(request, num_new, cached):
            return False
        request.num_computed_tokens += num_cached
        if request.num_preemptions == 0 and not request.output_token_ids:
            request.num_cached_tokens = num_cached
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        self.fair.started(request)
        request.num_prefill_chunks += request.num_computed_tokens < request.num_prompt_tokens
        out.scheduled.append(ScheduledRequest(request, num_new))
        return True

    def _num_new_tokens(self, request: Request, budget: int, num_cached: int = 0) -> int:
        missing = request.num_tokens - request.num_computed_tokens - num_cached
        if missing > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(missing, budget)

    def _rank(self, request: Request) -> tuple[int, int]:
        """Smaller ranks first: aged priority, then arrival order."""
        return self._aged_priority(request), request.arrival_seq

    def _step_order(self, request: Request) -> tuple[int, bool, float, int]:
        """Aged priority; then requests generating output, in arrival order, before prompt
        work (prefill chunks, running or waiting) in fair order among tenants."""
        decoding = request.status is RequestStatus.RUNNING and request.num_computed_tokens >= request.num_prompt_tokens
        return self._aged_priority(request), not decoding, 0.0 if decoding else request.fair_tag, request.arrival_seq

    def _aged_priority(self, request: Request) -> int:
        waited_s = max(0.0, self.clock() - request.arrival_time)
        return request.priority - int(waited_s / self.config.aging_interval_s)

    def _evict_a_waiting_holder(self) -> bool:
        """Frees the blocks of the least important waiting request that holds any, other
        than the first in step order (the one that must start); False when none does."""
        if not self.waiting:
            return False
        first = min(self.waiting, key=self._step_order)
        holders = [r for r in self.waiting if r.block_ids and r is not first]
        if not holders:
            return False
        self._preempt(max(holders, key=self._rank))
        return True

    def _preempt(self, request: Request) -> None:
        logger.debug("request %s: preempted (recompute)", request.request_id)
        (self.running if request in self.running else self.waiting).remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.append(request)

    # -- after the model ran ---------------------------------------------------------
    def update_after_step(
        self, out: SchedulerOutput, sampled: Mapping[RequestId, tuple[int, float | Logprob | None]],
        verified: Mapping[RequestId, Verified] | None = None,
    ) -> list[Request]:
        """Advance counters, append sampled tokens, finish on token-level stops.

        A request that verified proposals (`verified`) keeps the KV of its last token and
        of the proposals accepted; the blocks past them go back (`KVCacheManager.roll_back`)
        and its tokens are appended one by one, up to a stop. Returns the requests that got
        new tokens this step.
        """
        updated = []
        for s in out.scheduled:
            request = s.request
            if s.num_spec_tokens:
                assert verified is not None
                v = verified[request.request_id]
                request.spec_token_ids = []
                tokens, num_computed = v.tokens, 1 + v.num_accepted
            else:
                token = sampled.get(request.request_id)
                tokens, num_computed = [] if token is None else [token], s.num_new_tokens
            reason = None
            for token in tokens:
                request.append_output(*token)
                reason = request.stop_reason_for_last_token(self.context_limit)
                if request.choice_tokens:  # a prefill worker's request of n choices: the decode worker ends each
                    reason = None
                if reason is not None:
                    break
            # a stop among accepted proposals: the KV after it is not kept
            request.num_computed_tokens = min(request.num_computed_tokens + num_computed, request.num_tokens)
            if s.num_spec_tokens:
                self.kv.roll_back(request)
            self.kv.cache_computed_blocks(request)
            self.kv.slide(request)
            if tokens:
                updated.append(request)
            if reason is not None:
                self.finish(request, reason)
        return updated

    def finish(self, request: Request, reason: FinishReason, keep_blocks: bool = False) -> None:
        """End a request in any state; its blocks go back unless handed off."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not keep_blocks and request.request_id in self.in_flight and request.block_ids:
            self.kv.hold(request)  # a step in flight still writes them: held until it lands
            self.held_in_flight.append(request.request_id)
        elif not keep_blocks:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def abort(self, request_id: RequestId) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, FinishReason.ABORT)
        return True

    def check_invariants(self) -> PoolUsage:
        """Pool accounting holds and every in-use block is held by a request or the KV cache
        manager (a hand-off's, the null block)."""
        return self.kv.check_holders([r.block_ids for r in self.requests.values()])

    def load(self, num_prompt_tokens: int, num_cached_tokens: int) -> EngineLoad:
        """What this scheduler's pool and queues hold now (the engine's and the simulator's
        heartbeat; the engine adds its speculation counters)."""
        u = self.kv.pool.usage()
        queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in [*self.waiting, *self.running])
        return EngineLoad(u.num_total, u.num_free, u.num_cached, len(self.running), len(self.waiting), queued,
                          num_prompt_tokens, num_cached_tokens, self.num_preemptions)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)
