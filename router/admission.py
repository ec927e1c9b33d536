"""Admission control (torch-free, pure, injected clock): bounded per-priority queues, a token budget, deadlines.

A request costs `prompt + max_tokens` tokens of the budget while it is admitted.
`offer()` admits at once, queues, or refuses *early*: when its priority's queue is
full, or when the estimated wait (tokens ahead of it over the measured drain rate)
already exceeds its deadline or `max_queue_wait_s`. A refusal carries a retry-after
hint. `release()` returns the queued requests it admitted, most important first,
FIFO within a priority; the head of a queue is never bypassed by a smaller request,
so large prompts do not starve.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight_tokens: int = 262_144
    """Token budget: sum of prompt + max_tokens over admitted requests."""
    max_inflight_requests: int = 512
    """Most requests admitted at once."""
    max_queued_per_priority: int = 256
    """Most requests waiting per priority class; one more is refused."""
    max_queue_wait_s: float = 30.0
    """Longest a request may wait for admission; a longer estimated wait is refused up front."""
    min_retry_after_s: float = 0.2
    """Smallest retry-after hint given with a refusal."""

    def __post_init__(self) -> None:
        for name in ("max_inflight_tokens", "max_inflight_requests", "max_queued_per_priority"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_queue_wait_s <= 0 or self.min_retry_after_s <= 0:
            raise ValueError("max_queue_wait_s and min_retry_after_s must be positive")


@dataclass(frozen=True)
class Refused:
    reason: str
    retry_after_s: float


@dataclass
class _Entry:
    request_id: str
    priority: int
    cost_tokens: int
    deadline: float | None
    queued_at: float


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._queues: dict[int, deque[_Entry]] = {}
        self._admitted: dict[str, int] = {}
        self.inflight_tokens = 0
        self._rate_tokens_per_s: float | None = None
        self._last_release: float | None = None

    # -- the three moves ---------------------------------------------------------------
    def offer(self, request_id: str, priority: int, cost_tokens: int, deadline: float | None) -> bool | Refused:
        """True: admitted now; False: queued (wait for `release` to return it); or Refused."""
        entry = _Entry(request_id, priority, cost_tokens, deadline, self.clock())
        if not self._queued_ahead(priority) and self._fits(cost_tokens):
            self._admit(entry)
            return True
        q = self._queues.setdefault(priority, deque())
        if len(q) >= self.config.max_queued_per_priority:
            return Refused(f"the router's queue for priority {priority} is full "
                           f"({len(q)} requests waiting)", self._retry_after(cost_tokens, priority))
        wait = self._estimated_wait_s(cost_tokens, priority)
        limit = self.config.max_queue_wait_s if deadline is None else min(self.config.max_queue_wait_s, deadline - entry.queued_at)
        if wait is not None and wait > limit:
            return Refused(f"estimated queue wait {wait:.1f} s exceeds the {limit:.1f} s this request "
                           "can wait", self._retry_after(cost_tokens, priority))
        q.append(entry)
        return False

    def release(self, request_id: str) -> list[str]:
        """An admitted request ended (or a queued one left); returns the requests admitted now."""
        cost = self._admitted.pop(request_id, None)
        if cost is None:
            self._withdraw_queued(request_id)
            return []
        self.inflight_tokens -= cost
        self._note_drain(cost)
        return self._dispatch()

    def expire(self) -> list[str]:
        """Queued requests whose deadline or max wait passed (removed; the caller refuses them)."""
        now = self.clock()
        gone: list[str] = []
        for q in self._queues.values():
            for e in list(q):
                if (e.deadline is not None and e.deadline <= now) or now - e.queued_at >= self.config.max_queue_wait_s:
                    q.remove(e)
                    gone.append(e.request_id)
        return gone

    # -- views -------------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def queued_by_priority(self) -> dict[int, int]:
        return {p: len(q) for p, q in sorted(self._queues.items()) if q}

    # -- internals ---------------------------------------------------------------------------
    def _fits(self, cost_tokens: int) -> bool:
        if not self._admitted:
            return True
        return (len(self._admitted) < self.config.max_inflight_requests
                and self.inflight_tokens + cost_tokens <= self.config.max_inflight_tokens)

    def _admit(self, e: _Entry) -> None:
        self._admitted[e.request_id] = e.cost_tokens
        self.inflight_tokens += e.cost_tokens

    def _dispatch(self) -> list[str]:
        admitted: list[str] = []
        for p in sorted(self._queues):
            q = self._queues[p]
            while q and self._fits(q[0].cost_tokens):
                e = q.popleft()
                self._admit(e)
                admitted.append(e.request_id)
            if q:
                break
        return admitted

    def _withdraw_queued(self, request_id: str) -> None:
        for q in self._queues.values():
            for e in q:
                if e.request_id == request_id:
                    q.remove(e)
                    return

    def _queued_ahead(self, priority: int) -> bool:
        return any(q for p, q in self._queues.items() if p <= priority)

    def _tokens_ahead(self, priority: int) -> int:
        return sum(e.cost_tokens for p, q in self._queues.items() if p <= priority for e in q)

    def _estimated_wait_s(self, cost_tokens: int, priority: int) -> float | None:
        if not self._rate_tokens_per_s:
            return None
        room = self.config.max_inflight_tokens - self.inflight_tokens
        short = self._tokens_ahead(priority) + cost_tokens - room
        return max(short, 0) / self._rate_tokens_per_s

    def retry_after_s(self, cost_tokens: int, priority: int) -> float:
        """When a request of this cost would likely get in: the estimated wait from the measured drain rate."""
        return self._retry_after(cost_tokens, priority)

    def _retry_after(self, cost_tokens: int, priority: int) -> float:
        wait = self._estimated_wait_s(cost_tokens, priority)
        return min(max(wait or 0.0, self.config.min_retry_after_s), self.config.max_queue_wait_s)

    def _note_drain(self, cost_tokens: int) -> None:
        """EWMA of tokens released per second (the rate the budget frees up)."""
        now = self.clock()
        if self._last_release is not None and now > self._last_release:
            rate = cost_tokens / (now - self._last_release)
            prev = self._rate_tokens_per_s
            self._rate_tokens_per_s = rate if prev is None else 0.8 * prev + 0.2 * rate
        self._last_release = now
