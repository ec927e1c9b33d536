"""SimEngine: one worker's engine with the model replaced by a cost model, on a virtual clock.

    add(request) -> the real Scheduler (engine/core/scheduler.py) over the real KVCacheManager and
        BlockPool (prefix cache with the real chained block hashes, segmented LRU,
        preemption by recompute, chunked prefill, fair order, priorities with aging)
    step(now) -> SchedulerOutput -> the cost model prices it (chunks of new tokens and the
        context before them) -> the step ends `duration` later -> each sampled request gets
        its next token (a deterministic id per request and position: the prefix cache sees
        outputs as it would real ones) -> update_after_step -> what got a token and what ended
    role prefill: a request ends at its first token and its blocks are held for the transfer
        (the connector's `give_back` frees them): the engine's own PrefillRole and KV manager
    connector: the engine's seam (`SimConnector`, as engine/kv_connector.py's `KVConnector` is
        an LLMEngine's): its KV loans, through which the fleet's hand-offs and KV tier borrow
        and return blocks as a worker's do, and the decode side of a hand-off: `reserve` holds
        blocks for a prompt computed elsewhere (the scheduler's remote-KV admission, cached
        prefix reused), `landed` joins it to the batch, `end` ends it in any state
    speculation (`speculative`): the engine's own SpecPolicy (engine/spec/spec_decode.py) picks
        who proposes how many, priced by its own SpecCost fitted to the steps' priced
        durations; the proposals are the workload's: each one right with probability
        `spec_acceptance` if all before it were (a draft model's or prompt lookup's rate, a
        property of the text), drawn per request and position; the scheduler verifies them and
        rolls back the rest as it does a model's

Nothing here decides anything: scheduling, admission to the batch, block accounting and
eviction are the engine's own code; only the forward pass is a number.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.core.hashing import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output_builder import OutputBuilder
from engine.kv_connector import KVLoans
from engine.core.outputs import RemoteBlocks
from engine.core.request import Request, SamplingParams
from engine.core.roles import role_for
from engine.core.scheduler import Scheduler
from engine.spec.spec_cost import SpecCost
from engine.spec.spec_decode import SpecPolicy
from engine.spec.spec_verify import Verified
from engine.types import BlockHash, EngineLoad, RequestId

StepCost = Callable[[Sequence[tuple[int, int]], int], float]
"""(chunks of (new tokens, tokens computed before), requests sampled) -> seconds."""


@dataclass
class StepResult:
    duration_s: float
    tokens: dict[RequestId, int] = field(default_factory=dict)
    """Requests that got a token this step, and how many they have now."""
    finished: list[RequestId] = field(default_factory=list)
    num_preempted: int = 0
    first: dict[RequestId, tuple[int, int]] = field(default_factory=dict)
    """Requests that got their first token this step: (the token, prompt tokens that were cached)."""


class SimEngine:
    def __init__(self, cost: StepCost, num_blocks: int, block_size: int, vocab_size: int,
                 scheduler: SchedulerConfig | None = None, secret: bytes = b"sim", model_id: str = "sim",
                 max_model_len: int = 1 << 20, protected_fraction: float = 0.5, role: str = "both",
                 kv_window: int = 0, speculative: SpeculativeConfig | None = None,
                 spec_acceptance: float = 0.0) -> None:
        self.cost, self.vocab_size, self.role = cost, vocab_size, role
        self.block_size = block_size
        self.outputs = OutputBuilder(None, detokenize=False)
        """The engine's step tail (`turn`): prompt and cache-hit totals, the role's turn."""
        self.extra_s: dict[str, float] = {}
        """Seconds a request adds to the first step it is scheduled in (the caller prices them)."""
        self.now = 0.0
        self.pool = BlockPool(num_blocks, True, protected_fraction)
        self.kv = KVCacheManager(self.pool, BlockHasher(secret, model_id, block_size), kv_window)
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), self.kv, max_model_len, lambda: self.now)
        self.connector = SimConnector(self)
        self._role = role_for(role)
        self.busy_s = 0.0
        """Virtual seconds spent in steps (the worker's busy time)."""
        on = speculative is not None and speculative.method != "off" and role != "prefill"
        self.spec = SpecPolicy(speculative, self.scheduler.context_limit) if on and speculative else None
        self.spec_cost = SpecCost()
        self.spec_acceptance = spec_acceptance
        self.num_proposed = self.num_accepted = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0, tenant: str = "",
            block_hashes: list[BlockHash] | None = None) -> Request:
        """`block_hashes`: the prompt's, when the router hashed it already under the same key
        (the engine's own hashing gives the same list; this only saves computing it twice)."""
        r = self.request(request_id, prompt, max_tokens, block_hashes, priority, tenant)
        self.scheduler.add_request(r)
        return r

    def request(self, request_id: str, prompt: list[int], max_tokens: int,
                block_hashes: list[BlockHash] | None = None, priority: int = 0, tenant: str = "") -> Request:
        """A request arriving now that generates `max_tokens` (ignore_eos)."""
        return Request(RequestId(request_id), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=self.now, priority=priority, tenant=tenant, block_hashes=list(block_hashes or ()))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(RequestId(request_id))

    def load(self) -> EngineLoad:
        """As LLMEngine.load, for heartbeats."""
        return self.scheduler.load(self.outputs.num_prompt_tokens, self.outputs.num_cached_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self, now: float) -> StepResult:
        """Runs one step starting at `now` (virtual seconds); it ends `duration_s` later."""
        self.now = now
        if self.spec is not None:
            self._propose()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return StepResult(0.0, num_preempted=len(out.preempted_ids))
        chunks = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled]
        sampled = {s.request.request_id: (self.token_for(s.request), None) for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens}
        verified = {s.request.request_id: self._verified(s.request, s.num_spec_tokens)
                    for s in out.scheduled if s.num_spec_tokens}
        duration = self.cost(chunks, len(sampled) + sum(1 + s.num_spec_tokens for s in out.scheduled
                                                         if s.num_spec_tokens))
        if self.extra_s:  # work a request brings to its first step (a prefill worker's KV push)
            duration += sum(self.extra_s.pop(s.request.request_id, 0.0) for s in out.scheduled)
        self.busy_s += duration
        self.now = now + duration
        if self.spec is not None and out.decodes_only:  # the step's period, as the engine feeds its policy's fit
            self.spec_cost.observe(sum(s.num_new_tokens for s in out.scheduled), sum(n + c for n, c in chunks),
                                   bool(verified), duration)
        updated = self.scheduler.update_after_step(out, sampled, verified)
        first = {}
        for r in updated:
            if len(r.output_token_ids) == 1:
                first[r.request_id] = (r.output_token_ids[0], r.num_cached_tokens)
            self.outputs.turn(r, self.scheduler, self._role)  # as LLMEngine's step ends, text aside
        return StepResult(duration, {r.request_id: len(r.output_token_ids) for r in updated},
                          [r.request_id for r in updated if r.is_finished], len(out.preempted_ids), first)

    def token_for(self, request: Request, ahead: int = 0) -> int:
        """The token a request gets `ahead` positions past its next one: fixed by its id and the position."""
        key = f"{request.request_id}:{request.num_tokens + ahead}".encode()
        return zlib.crc32(key) % self.vocab_size

    def _propose(self) -> None:
        """The policy's proposals for the decoding requests (as `Speculator.propose`), stand-ins
        for the tokens a proposer would give: only how many are kept matters here."""
        assert self.spec is not None
        decoding = []
        for r in self.scheduler.running:
            r.spec_token_ids = []
            if r.num_computed_tokens == r.num_tokens - 1 and r.output_token_ids:
                decoding.append(r)
        for r, k in self.spec.plan(decoding, self.spec_cost.latest):
            r.spec_token_ids = [self.token_for(r, j + 1) for j in range(k)]

    def _verified(self, request: Request, k: int) -> Verified:
        """The proposals kept: each with probability `spec_acceptance` if all before it were
        (drawn from the request's id and position), and the target's own token after them."""
        assert self.spec is not None
        accepted = 0
        while accepted < k and zlib.crc32(f"{request.request_id}@{request.num_tokens + accepted}".encode()) \
                / 2**32 < self.spec_acceptance:
            accepted += 1
        self.spec.verified(request, k, accepted)
        self.num_proposed += k
        self.num_accepted += accepted
        return Verified([(self.token_for(request, j), None) for j in range(accepted + 1)], accepted)


class SimConnector(KVLoans):
    """A SimEngine's seam, as `KVConnector` is an LLMEngine's: its loans and `end`, and the decode
    side of a hand-off over the engine's own scheduler. Runs on the fleet's event loop, the engine's."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(lambda: engine.kv, engine.abort)
        self._engine = engine

    def reserve(self, request_id: str, prompt: list[int], max_tokens: int,
                block_hashes: list[BlockHash] | None = None) -> RemoteBlocks | None:
        """Blocks reserved for a prompt whose KV comes from a prefill worker (its cached prefix
        reused); None when the pool cannot hold it. `block_hashes`: as `SimEngine.add`."""
        e = self._engine
        r = e.request(request_id, prompt, max_tokens, block_hashes)
        if not e.scheduler.add_remote_request(r):
            return None
        return RemoteBlocks(r.request_id, list(r.block_ids), r.num_cached_tokens, r.num_cached_blocks)

    def landed(self, request_id: str, first_token: int) -> bool:
        """The KV landed with the first token; True when that token already ends the request
        (its context is full)."""
        e = self._engine
        r = e.scheduler.requests[RequestId(request_id)]
        e.scheduler.remote_kv_ready(RequestId(request_id), first_token)
        e.outputs.turn(r, e.scheduler, e._role)
        return r.is_finished
