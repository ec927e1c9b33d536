"""OutputLengths (pure): how many tokens requests really generate, learned online, so that
admission charges a request the KV it is expected to use, not the worst case.

A chat without `max_tokens` may generate to the end of the context, and most stop after a
few dozen tokens; charged the worst case, eight ordinary chats filled a CPU decode pool
and six were refused (issue 47). vLLM charges no output at all and preempts when the pool
fills; this charges a high quantile of what finished requests like it generated:

    servicer, a request ended (stop or length) --observe(tenant, route, n)--> a window of the
        last `WINDOW` lengths per (tenant, route), per tenant, per route and overall
    servicer, a request arrives --expected(tenant, route, limit)--> the `quantile` of the most
        specific window with `MIN_SAMPLES` lengths (else `prior_tokens`), never over `limit`
        (its max_tokens within the context) and at least 1

The charge is a guess; the real use is the limit it cannot pass: a request that runs past
its charge is charged what it holds from then on (`AdmissionQueue.progress`), and a decode
worker whose pool fills preempts the least important request (recompute), as vLLM does.
Tenants are many and may be made up: at most `MAX_KEYS` windows are kept, the least
recently used dropped first.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque

WINDOW = 256
"""Finished requests each window holds (the oldest leaves first)."""
MIN_SAMPLES = 8
"""Lengths a window needs before its quantile is used; fewer, the next wider window answers."""
MAX_KEYS = 4096


class _Window:
    """The last `WINDOW` lengths, in arrival order and sorted."""

    def __init__(self) -> None:
        self.order: deque[int] = deque()
        self.sorted: list[int] = []

    def add(self, n: int) -> None:
        if len(self.order) == WINDOW:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(n)
        bisect.insort(self.sorted, n)

    def quantile(self, q: float) -> int:
        return self.sorted[min(int(q * len(self.sorted)), len(self.sorted) - 1)]


class OutputLengths:
    """`quantile` and `prior_tokens`: AdmissionConfig's `expected_quantile` and
    `expected_prior_tokens` (checked there)."""

    def __init__(self, quantile: float, prior_tokens: int) -> None:
        self.quantile = quantile
        self.prior_tokens = prior_tokens
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()

    def observe(self, tenant: str, route: str, num_generated: int) -> None:
        """A request of this tenant and route ended having generated `num_generated` tokens."""
        if num_generated < 1:
            return
        keys = {(tenant, route), (tenant, ""), ("", route), ("", "")}
        for key in keys:
            w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window()
            else:
                self._windows.move_to_end(key)
            w.add(num_generated)
        while len(self._windows) > MAX_KEYS:
            self._windows.popitem(last=False)

    def expected(self, tenant: str, route: str, limit: int) -> int:
        """The output to charge a request that may generate at most `limit` tokens."""
        if limit <= 0:
            return 0
        for key in ((tenant, route), (tenant, ""), ("", route), ("", "")):
            w = self._windows.get(key)
            if w is not None and len(w.order) >= MIN_SAMPLES:
                return max(min(w.quantile(self.quantile), limit), 1)
        return min(self.prior_tokens, limit)

    def samples(self, tenant: str = "", route: str = "") -> int:
        """Lengths held for this tenant and route ("": any)."""
        w = self._windows.get((tenant, route))
        return len(w.order) if w is not None else 0
