"""Start-time fair order among tenants inside one engine's queue (torch-free, pure).

The router admits fairly, but once admitted, requests queue again on the workers: a tenant
that flooded the router with its share still has many requests ahead of a light tenant's
newcomer there. Each request gets a start tag when it arrives: where its tenant's previous
request finishes in virtual time (its cost over the tenant's weight), or the engine's
virtual time if that is later. Within a priority class the scheduler serves waiting work by
tag, so a light tenant's request goes before a heavy tenant's backlog, while one tenant's
requests keep their arrival order.

Strict start-time fair queuing would still interleave a light tenant's short burst (two
requests close together) one for one with the heavy tenant's backlog: its second request
waits behind one of the heavy tenant's. So a tenant that has fallen behind the engine's
virtual time starts up to `burst_tokens` (times its weight) before it, as CFS credits a
waking task: a burst of the light tenant runs back to back, and the heavy tenant loses at
most that much service to it, however long the light one was idle. The credit is earned
while others are served, and refilled for every known tenant whenever the engine holds no
request (`idle`): a tenant that had the engine to itself but left it idle most of the time
is light, not a heavy tenant's equal. A tenant the engine does not know yet (or has
forgotten) starts at the virtual time without credit, so a flood that begins does not jump
ahead of the tenants already being served.
"""
from __future__ import annotations

from engine.core.request import Request

STALE_TENANTS = 64
"""Finish tags kept for tenants with nothing in the engine, at most (then the stale go)."""


class FairOrder:
    def __init__(self, burst_tokens: int = 0) -> None:
        self.vtime = 0.0
        self.burst_tokens = burst_tokens
        self._finish: dict[str, float] = {}

    def tag(self, request: Request, cost_tokens: int) -> None:
        """Sets `request.fair_tag` and moves its tenant's finish on by the request's cost."""
        finish = self._finish.get(request.tenant)
        start = self.vtime if finish is None else max(self.vtime - self.burst_tokens, finish)
        self._finish[request.tenant] = start + cost_tokens / request.tenant_weight
        request.fair_tag = start

    def idle(self) -> None:
        """The engine holds no request: every known tenant's credit is full again."""
        if self._finish:
            self.vtime = max(self.vtime, max(self._finish.values()) + self.burst_tokens)

    def started(self, request: Request) -> None:
        """`request` gets its first tokens: virtual time moves up to its tag."""
        self.vtime = max(self.vtime, request.fair_tag)
        if len(self._finish) > STALE_TENANTS:
            self._finish = {t: f for t, f in self._finish.items() if f > self.vtime - self.burst_tokens}
