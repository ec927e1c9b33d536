"""One priority class of the admission queue: a FIFO per tenant, served in start-time fair
order (torch-free, pure; `router.admission.AdmissionQueue` decides when)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Entry:
    request_id: str
    priority: int
    tenant: str
    cost_tokens: int
    deadline: float | None
    queued_at: float
    start_tag: float = 0.0
    """Start-time fair queueing tag: the class's virtual time its tenant's turn begins."""
    estimate_s: float | None = None
    """Its estimated wait when it was queued (None: nothing measured to estimate with yet)."""
    new_tokens: int = 0
    """Of `cost_tokens`, the output it is charged (0: all of it), for the wait forecast."""
    max_new_tokens: int = 0
    """The most it may generate (0: `new_tokens`), for the wait forecast."""


class PriorityClass:
    """One priority class: a FIFO per tenant, served in start-time fair order. A tenant's
    next request starts where its previous one finished in virtual time (cost over weight),
    or at the class's virtual time if that is later; the smallest start goes first."""

    def __init__(self) -> None:
        self.fifos: dict[str, deque[Entry]] = {}
        self.vtime = 0.0
        self._finish: dict[str, float] = {}
        self.num_queued = 0

    def start_tag(self, tenant: str, lead_cap: float) -> float:
        """A new request's start tag: where the tenant's previous one finishes. A tenant that
        starts waiting anew has its lead over the class capped (`lead_cap`), so what it ran
        while the cluster had room is not held against it for long."""
        finish = self._finish.get(tenant, 0.0)
        if tenant in self.fifos:
            return max(self.vtime, finish)
        return max(self.vtime, min(finish, self.vtime + lead_cap))

    def charge(self, e: Entry, weight: float) -> None:
        self._finish[e.tenant] = e.start_tag + e.cost_tokens / weight

    def push(self, e: Entry) -> None:
        self.fifos.setdefault(e.tenant, deque()).append(e)
        self.num_queued += 1

    def remove(self, e: Entry) -> None:
        fifo = self.fifos[e.tenant]
        fifo.remove(e)
        self.num_queued -= 1
        if not fifo:
            del self.fifos[e.tenant]

    def served(self, e: Entry) -> None:
        """`e` leaves the queue to run: virtual time moves to its start; stale tags go."""
        self.vtime = max(self.vtime, e.start_tag)
        if e in self.fifos.get(e.tenant, ()):
            self.remove(e)
        if len(self._finish) > 2 * len(self.fifos) + 64:
            self._finish = {t: f for t, f in self._finish.items() if f > self.vtime or t in self.fifos}

    def heads(self) -> Iterator[Entry]:
        return (fifo[0] for fifo in self.fifos.values())

    def entries(self) -> Iterator[Entry]:
        return (e for fifo in self.fifos.values() for e in fifo)

    def oldest(self) -> float:
        return min(e.queued_at for e in self.heads())
