"""What the router knows of each worker's load (torch-free, pure).

Two sources, merged conservatively: the router's own bookkeeping of what it sent
(exact for its own requests, immediate) and the workers' heartbeats from Redis (which
also see other routers' requests, half a second late). Free blocks take the smaller
estimate, activity and queued prefill tokens the larger, so neither source alone can
overload a worker. Without Redis the router's own view remains: load-only routing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from control.heartbeat import Heartbeat
from router.policy import RouteDecision, WorkerLoad, blocks_for

if TYPE_CHECKING:
    from router.kv_index import KVIndex


@dataclass
class _Own:
    num_active: int = 0
    queued_prefill_tokens: int = 0
    promised_blocks: int = 0


@dataclass
class LoadBook:
    num_blocks: dict[str, int]
    """Worker id -> KV pool size in blocks (from its heartbeats)."""
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    _own: dict[str, _Own] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)
    _present: set[str] = field(default_factory=set)
    reachable: bool = False
    """The last read of the registry succeeded (heartbeats are current)."""

    def set_heartbeats(self, heartbeats: dict[str, Heartbeat] | None) -> None:
        """The registry's current heartbeats; None when the registry cannot be read: the workers'
        load is unknown meanwhile, but who had gone stays gone (the view survives an outage)."""
        self.reachable = heartbeats is not None
        self.heartbeats = heartbeats or {}
        if heartbeats is not None:
            self._present = set(heartbeats)
            self._seen |= self._present
            if len(self._seen) > 2 * len(self._present) + 1024:  # long gone ones are no members either
                self._seen = set(self._present)

    def gone(self, worker_id: str) -> bool:
        """Its heartbeat was seen and has expired since: the worker stopped (or hangs)."""
        return worker_id in self._seen and worker_id not in self._present

    def alive(self, worker_id: str) -> bool:
        """Its heartbeat is in the registry's current read: its engine thread answers (busy, not dead)."""
        return worker_id in self.heartbeats

    def book(self, decode: str, prefill: str | None, prompt_tokens: int, blocks: int) -> Booking:
        """Counts a routed attempt: `prompt_tokens` queued on its prefiller (P, or D for a
        local prefill), `blocks` promised on D, one active request on each."""
        self.start(decode, prompt_tokens if prefill is None else 0, blocks)
        if prefill is not None:
            self.start(prefill, prompt_tokens, 0)
        return Booking(self, decode, prefill, prompt_tokens, blocks)

    def start(self, worker_id: str, prefill_tokens: int, blocks: int) -> None:
        o = self._own.setdefault(worker_id, _Own())
        o.num_active += 1
        o.queued_prefill_tokens += prefill_tokens
        o.promised_blocks += blocks

    def prefilled(self, worker_id: str, prefill_tokens: int) -> None:
        self._own[worker_id].queued_prefill_tokens -= prefill_tokens

    def end(self, worker_id: str, blocks: int) -> None:
        o = self._own[worker_id]
        o.num_active -= 1
        o.promised_blocks -= blocks

    def load(self, worker_id: str) -> WorkerLoad:
        o = self._own.get(worker_id, _Own())
        total = self.num_blocks.get(worker_id, 0)
        free = total - o.promised_blocks
        active, queued = o.num_active, o.queued_prefill_tokens
        hb = self.heartbeats.get(worker_id)
        if hb is not None:
            free = min(free, hb.load.num_free_blocks + hb.load.num_cached_blocks)
            active = max(active, hb.load.num_running + hb.load.num_waiting)
            queued = max(queued, hb.load.queued_prefill_tokens)
        return WorkerLoad(worker_id, active, queued, max(free, 0), total)


@dataclass
class Booking:
    """One routed attempt's entries in a `LoadBook`, each settled exactly once, however the
    attempt ends (finished, cancelled, a worker failed): the prompt stops counting as
    queued prefill at the first token, the rest when the attempt ends."""

    book: LoadBook
    decode: str
    prefill: str | None
    prompt_tokens: int
    """Prompt tokens the prefiller computes (not cached there)."""
    blocks: int
    prefilling: bool = True
    """The prompt still counts as queued on the prefiller."""
    _ended: bool = False

    def prefilled(self) -> None:
        """The first token exists: the prompt no longer waits on the prefiller."""
        if self.prefilling:
            self.prefilling = False
            self.book.prefilled(self.prefill or self.decode, self.prompt_tokens)

    def end(self) -> None:
        """The attempt is over: settles whatever is still counted."""
        if self._ended:
            return
        self._ended = True
        self.prefilled()
        self.book.end(self.decode, self.blocks)
        if self.prefill is not None:
            self.book.end(self.prefill, 0)


def book_route(loads: LoadBook, index: KVIndex, decision: RouteDecision, hashes: list[bytes], num_prompt_tokens: int,
               block_size: int, window: int = 0) -> Booking:
    """A routed attempt counted where the router counts it (the flow and the simulator both
    book here): its uncached prompt tokens queued on its prefiller, its blocks promised on D,
    and the index's prediction that D (and P) will hold the prompt's blocks."""
    d, p = decision.decode_worker, decision.prefill_worker
    cached_blocks = decision.num_decode_cached_blocks if p is None else decision.num_prefill_cached_blocks
    booking = loads.book(d, p, num_prompt_tokens - cached_blocks * block_size,
                         blocks_for(num_prompt_tokens, block_size, window))
    index.predict(d, hashes)
    if p is not None:
        index.predict(p, hashes)
    return booking
