"""Admission control (torch-free, pure, injected clock): a token budget shared fairly.

A request costs its prompt's uncached tokens plus the output it is expected to generate
(`expected_output`: a high quantile of what finished requests of its tenant and route
generated, router/output_lengths.py, never over its max_tokens; or its max_tokens where
`charge_output` is "max") while it is admitted; one that generates past that is charged
what it really holds from then on (`progress`), so the budget counts what is expected
and never less than what is used (`charged_tokens` against `used_tokens`). The budget is `kv_overcommit` times the decode pool's KV capacity once the
router knows it (`set_capacity`), so what is admitted can start on a decode worker instead
of waiting there for room; `max_inflight_tokens` caps it where set (until the pool is
known, the cap or `UNKNOWN_POOL_TOKENS`).

Queued requests wait in priority classes (lower number first). A class ages: for each
`aging_s` its oldest request waits, the class moves up one, so the least important
class still progresses. Within a class each tenant has its own FIFO, and tenants are
served in start-time fair order (`PriorityClass`): a tenant's share of the budget follows its
weight (`tenant_weights`, default 1) however fast it sends. The request chosen next is
never bypassed by a smaller one that would fit, so large prompts do not starve.

`offer()` admits at once, queues, or refuses *early*, at arrival: when its class's queue
is full, when its tenant already has its share of that queue waiting, or when the
estimated wait exceeds its deadline or `max_queue_wait_s`. A refusal says which and
carries a retry-after hint. The wait is estimated by `WaitForecast` (router/wait_forecast.py:
a replay of when the admitted requests finish and the queue ahead is admitted, from the
measured time to first token and per token); until it has measured a request, by the tokens
served before it over the drain rate of recent releases. `revise()` (on the router's timer)
replays the queue again as requests progress and finish: a queued request whose admission
now falls past its limit is refused then, not when the limit runs out. Each queued request
admitted reports actual over estimated wait (`on_wait_estimate`): the estimate's error,
exported as a histogram.
"""
from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.admission_config import UNKNOWN_POOL_TOKENS, AdmissionConfig
from router.fair_queue import Entry, PriorityClass
from router.output_lengths import OutputLengths
from router.wait_forecast import Queued, WaitForecast

__all__ = ["AdmissionConfig", "AdmissionQueue", "Refused"]

DRAIN_WINDOW = 64
"""Releases the drain rate is measured over."""
DRAIN_WINDOW_S = 60.0
"""...and at most this far back."""
TTFT_WINDOW = 16
"""Admitted requests' times to first token the TTFT steering looks at, at a time."""


def admission_cost(num_prompt_tokens: int, output: int, cached_tokens: int = 0, max_held: int | None = None) -> int:
    """KV tokens a request is charged (the router and the simulator charge here): its prompt's
    uncached tokens plus `output`, what it is expected to generate (`expected_output`), or
    `max_held` where fewer (a sliding window's: ModelFacts.max_held_tokens)."""
    cost = num_prompt_tokens - min(cached_tokens, num_prompt_tokens) + output
    return cost if max_held is None else min(cost, max_held)


@dataclass
class _Held:
    """An admitted request's charge (`cost` tokens) and tenant."""

    cost: int
    tenant: str


@dataclass(frozen=True)
class Refused:
    reason: str
    retry_after_s: float | None
    """None: retrying the same request cannot help."""
    kind: str
    """queue_full | tenant_share | wait | revised | quota (for the router's stats)."""


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        cap = config.max_inflight_tokens or UNKNOWN_POOL_TOKENS
        self.budget_tokens = cap
        self.limit_tokens = config.max_inflight_tokens or sys.maxsize
        """The TTFT steering's cap on the budget (`observe_ttft`): none until it steers."""
        self._capacity_tokens = cap
        """The most tokens admitted at once, tenants under their share included."""
        self._budget_cap = cap
        """The budget before TTFT steering: the capacity less the share headroom, once known."""
        self._ttfts: list[float] = []
        self.max_wait_s = min(config.max_queue_wait_s, config.ttft_budget_s / 2) if config.ttft_budget_s \
            else config.max_queue_wait_s
        """Longest a request waits in the queue (half the TTFT budget when there is one)."""
        self._classes: dict[int, PriorityClass] = {}
        self._admitted: dict[str, _Held] = {}
        self.lengths = OutputLengths(config.expected_quantile, config.expected_prior_tokens)
        """Output lengths of finished requests, per tenant and route (`expected_output`)."""
        self._tenant_tokens: dict[str, int] = {}
        self.inflight_tokens = 0
        self._releases: deque[tuple[float, int]] = deque(maxlen=DRAIN_WINDOW)
        self.forecast = WaitForecast(clock)
        self.max_held_tokens: int | None = None
        """The most KV tokens one sequence holds (`set_capacity`); None: its length."""
        self.on_wait_estimate: Callable[[float], None] | None = None
        """Called with actual / estimated wait of each queued request admitted (the estimate's error)."""

    # -- the moves ---------------------------------------------------------------------------
    def offer(self, request_id: str, priority: int, cost_tokens: int, deadline: float | None,
              tenant: str = "", new_tokens: int = 0, max_new_tokens: int = 0) -> bool | Refused:
        """True: admitted now; False: queued (wait for `release` to return it); or Refused.
        `new_tokens`: of the cost, the output it is charged (0: all of it); `max_new_tokens`:
        the most it may generate (0: `new_tokens`)."""
        if (over := self._over_quota(tenant, cost_tokens)) is not None:
            return over
        c = self._classes.setdefault(priority, PriorityClass())
        e = self._entry(c, request_id, priority, cost_tokens, deadline, tenant)
        e.new_tokens, e.max_new_tokens = new_tokens, max_new_tokens
        refusal = self._refusal(c, e)
        c.push(e)
        if self._next_candidate() is e and self._fits(e):
            e.estimate_s = None  # never queued: no estimate to judge
            self._admit(c, e)
            return True
        if refusal is not None:
            c.remove(e)
            return refusal
        c.charge(e, self.weight(tenant))
        return False

    def refusal_at(self, priority: int, floor_tokens: int, ceiling_tokens: int, deadline: float | None,
                   tenant: str = "") -> Refused | None:
        """The refusal `offer` would give a request whose cost lies between `floor_tokens` and
        `ceiling_tokens`, decided now without queuing it; None when it might be admitted or
        queued, or when only its exact cost can say (over its tenant's quota or not). Every
        test grows with the cost, so a refusal at the floor is the request's own: the router
        asks this before it hashes the prompt for the exact cost, and a flood's refusals skip
        the hashing."""
        if (over := self._over_quota(tenant, floor_tokens)) is not None:
            return over
        if self._over_quota(tenant, ceiling_tokens) is not None:
            return None
        new_class = priority not in self._classes
        c = self._classes.setdefault(priority, PriorityClass())  # there for `_next_candidate` to see
        e = self._entry(c, "", priority, floor_tokens, deadline, tenant)
        try:
            refusal = self._refusal(c, e)
            if refusal is None:
                return None
            c.push(e)
            admitted_now = self._next_candidate() is e and self._fits(e)
            c.remove(e)
            return None if admitted_now else refusal
        finally:
            if new_class:
                del self._classes[priority]

    def release(self, request_id: str) -> list[str]:
        """An admitted request ended (or a queued one left); returns the requests admitted now."""
        admitted = self._admitted.pop(request_id, None)
        if admitted is None:
            self._withdraw_queued(request_id)
            return []
        cost, tenant = admitted.cost, admitted.tenant
        self.forecast.finished(request_id)
        self.inflight_tokens -= cost
        self._tenant_tokens[tenant] -= cost
        if not self._tenant_tokens[tenant]:
            del self._tenant_tokens[tenant]
        self._releases.append((self.clock(), cost))
        return self._dispatch()

    def expected_output(self, tenant: str, route: str, limit: int, known: bool = False) -> int:
        """The output tokens to charge a request that may generate `limit` (`charge_output`);
        `known`: nothing can stop it early (router/frontend.py `runs_to_the_end`), so `limit`."""
        if known or self.config.charge_output == "max":
            return limit
        return self.lengths.expected(tenant, route, limit)

    def progress(self, request_id: str, num_generated: int) -> None:
        """An admitted request has generated `num_generated` tokens: past its charge, it is
        charged what it holds (its prompt and those tokens)."""
        self.forecast.progress(request_id, num_generated)
        held, running = self._admitted.get(request_id), self.forecast.running.get(request_id)
        if held is None or running is None:
            return
        holds = running.prompt_tokens + num_generated
        if self.max_held_tokens is not None:
            holds = min(holds, self.max_held_tokens)
        if holds <= held.cost:
            return
        more = holds - held.cost
        held.cost += more
        self.inflight_tokens += more
        self._tenant_tokens[held.tenant] += more
        self.forecast.charged(request_id, held.cost)

    def set_capacity(self, kv_tokens: int, max_held_tokens: int | None = None) -> list[str]:
        """The decode pool holds `kv_tokens` of KV (0: unknown): the budget follows it; returns
        the requests a larger budget admits now. `max_held_tokens`: the most one sequence holds
        (a sliding window's, ModelFacts.max_held_tokens; None: its length), which `progress`
        never charges past."""
        self.max_held_tokens = max_held_tokens
        cap = self.config.max_inflight_tokens
        budget = cap or UNKNOWN_POOL_TOKENS
        if kv_tokens > 0:
            budget = min(cap or sys.maxsize, max(int(kv_tokens * self.config.kv_overcommit), 1))
        self._capacity_tokens = budget
        self._budget_cap = max(int(budget * (1 - self.config.share_headroom)), 1) if kv_tokens > 0 else budget
        return self._rebudget()

    def observe_ttft(self, seconds: float, cost_tokens: int) -> list[str]:
        """An admitted request got its first token `seconds` after admission; with a TTFT
        budget, every `TTFT_WINDOW` of them steer the token budget. Returns the requests a
        larger budget admits now."""
        budget_s = self.config.ttft_budget_s
        if budget_s is None:
            return []
        self._ttfts.append(seconds)
        if len(self._ttfts) < TTFT_WINDOW:
            return []
        p90 = sorted(self._ttfts)[int(0.9 * (len(self._ttfts) - 1))]
        self._ttfts = []
        floor = 4 * cost_tokens
        if p90 > budget_s / 2:
            self.limit_tokens = max(int(min(self.limit_tokens, self.inflight_tokens) * 2 / 3), floor)
        elif p90 < budget_s / 4 and (self.num_queued or self.inflight_tokens >= 0.8 * self.budget_tokens):
            self.limit_tokens = min(int(self.limit_tokens * 1.25) + cost_tokens, self._capacity_tokens)
        return self._rebudget()

    def _rebudget(self) -> list[str]:
        """The budget is the KV capacity's less the share headroom, capped by the TTFT steering;
        returns what it admits now."""
        self.budget_tokens = min(self._budget_cap, self.limit_tokens)
        return self._dispatch()

    def expire(self) -> list[str]:
        """Queued requests whose deadline or max wait passed (removed; the caller refuses them)."""
        now = self.clock()
        gone = [e for c in self._classes.values() for e in c.entries()
                if (e.deadline is not None and e.deadline <= now) or now - e.queued_at >= self.max_wait_s]
        for e in gone:
            self._classes[e.priority].remove(e)
        return [e.request_id for e in gone]

    def revise(self) -> list[tuple[str, Refused]]:
        """Replays the queue with what is measured now; the queued requests whose admission
        falls past their limit are removed and returned with their refusal."""
        if not self.num_queued or (times := self._replay()) is None:
            return []
        now, out = self.clock(), []
        for e in self._service_order():
            can_wait = self._can_wait(e)
            if times[e.request_id] > e.queued_at + can_wait:
                self._classes[e.priority].remove(e)
                more = times[e.request_id] - now
                said = "" if e.estimate_s is None else f" (estimated {e.estimate_s:.1f} s at arrival)"
                out.append((e.request_id, Refused(
                    f"revised queue wait: {now - e.queued_at:.1f} s waited and {more:.1f} s more{said} exceed the "
                    f"{can_wait:.1f} s this request can wait", self._retry_hint(more), "revised")))
        return out

    # -- views -------------------------------------------------------------------------------
    @property
    def charged_tokens(self) -> int:
        """Tokens the admitted requests are charged: expected output, or what they hold past it."""
        return self.inflight_tokens

    @property
    def used_tokens(self) -> int:
        """Tokens the admitted requests really hold: uncached prompts and what they generated."""
        return self.forecast.kv_tokens

    @property
    def num_queued(self) -> int:
        return sum(c.num_queued for c in self._classes.values())

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def queued_by_priority(self) -> dict[int, int]:
        return {p: c.num_queued for p, c in sorted(self._classes.items()) if c.num_queued}

    def tenant_tokens(self) -> dict[str, int]:
        """Admitted tokens per tenant."""
        return dict(self._tenant_tokens)

    def queued_admission_times(self) -> dict[str, float]:
        """Each queued request's forecast admission time ({} before the forecast is calibrated)."""
        return self._replay() or {}

    def weight(self, tenant: str) -> float:
        """The tenant's weight (`tenant_weights`, 1 when not named)."""
        return self.config.tenant_weights.get(tenant, 1.0)

    def drain_rate(self) -> float | None:
        """Tokens released per second over the recent releases (None before two of them)."""
        now = self.clock()
        recent = [(t, n) for t, n in self._releases if now - t <= DRAIN_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return sum(n for _, n in recent[1:]) / (recent[-1][0] - recent[0][0])

    def retry_after_s(self, cost_tokens: int, priority: int, tenant: str = "") -> float:
        """When a request of this cost would likely get in: its estimated wait were it queued now."""
        e = self._entry(self._classes.get(priority) or PriorityClass(), "", priority, cost_tokens, None, tenant)
        return self._retry_after(e)

    # -- internals ---------------------------------------------------------------------------
    def _over_quota(self, tenant: str, cost_tokens: int) -> Refused | None:
        quota = self.config.tenant_quota_tokens.get(tenant)
        if quota is None or cost_tokens <= quota:
            return None
        return Refused(f"the request needs {cost_tokens} tokens of the budget, more than tenant {tenant!r}'s "
                       f"quota of {quota}: send a shorter prompt or a smaller max_tokens", None, "quota")

    def _entry(self, c: PriorityClass, request_id: str, priority: int, cost_tokens: int, deadline: float | None,
               tenant: str) -> Entry:
        """A request's entry, its start tag in class `c` set (not queued)."""
        e = Entry(request_id, priority, tenant, cost_tokens, deadline, self.clock())
        e.start_tag = c.start_tag(tenant, self.budget_tokens / self.weight(tenant))
        return e

    def _refusal(self, c: PriorityClass, e: Entry) -> Refused | None:
        """Why `e` may not wait in the queue, or None."""
        limit = self.config.max_queued_per_priority
        if c.num_queued >= limit:
            return Refused(f"the router's queue for priority {e.priority} is full ({c.num_queued} requests "
                           f"waiting)", self._retry_after(e), "queue_full")
        mine = len(c.fifos.get(e.tenant, ()))
        if mine and len(c.fifos) > 1:  # others wait too: each tenant gets its share of the queue
            fraction, total = self._fair_share(e.tenant, c.fifos)
            share = max(int(limit * fraction), 1)
            if mine >= share:
                return Refused(f"tenant {e.tenant!r} already has {mine} requests waiting at priority {e.priority}, "
                               f"its fair share of that queue ({share} of {limit} at weight "
                               f"{self.weight(e.tenant):g} of {total:g})", self._retry_after(e), "tenant_share")
        wait = e.estimate_s = self._estimated_wait_s(e)  # kept: its error is measured if it is admitted
        can_wait = self._can_wait(e)
        if wait is not None and wait > can_wait:
            return Refused(f"estimated queue wait {wait:.1f} s exceeds the {can_wait:.1f} s this request "
                           f"can wait{self._share_note(e.tenant)}", self._retry_hint(wait), "wait")
        return None

    def _can_wait(self, e: Entry) -> float:
        return self.max_wait_s if e.deadline is None else min(self.max_wait_s, e.deadline - e.queued_at)

    def _share_note(self, tenant: str) -> str:
        """For a refusal: the tenant's part of the admitted tokens against its fair share, when
        other tenants are admitted too."""
        if len(self._tenant_tokens) < 2 or tenant not in self._tenant_tokens:
            return ""
        share = self._fair_share(tenant, self._tenant_tokens)[0]
        held = self._tenant_tokens[tenant] / max(self.inflight_tokens, 1)
        return f"; tenant {tenant!r} holds {held:.0%} of the admitted tokens, its fair share is {share:.0%}"

    def _fair_share(self, tenant: str, among: Iterable[str]) -> tuple[float, float]:
        """The tenant's weighted fraction among these tenants and itself, and their total weight."""
        total = sum(self.weight(t) for t in {*among, tenant})
        return self.weight(tenant) / total, total

    def _fits(self, e: Entry) -> bool:
        if not self._within_quota(e):
            return False
        if not self._admitted:
            return True  # even a request over the whole budget runs, alone
        if len(self._admitted) >= self.config.max_inflight_requests:
            return False
        return self.inflight_tokens + e.cost_tokens <= self.budget_tokens or self._fits_by_share(e)

    def _fits_by_share(self, e: Entry) -> bool:
        """A tenant under its weighted share of the budget gets in even while others overfill it
        (up to the KV capacity, never past it): one tenant's flood cannot shut the others out."""
        if len(self._tenant_tokens) < 1 or set(self._tenant_tokens) == {e.tenant}:
            return False
        if self.inflight_tokens + e.cost_tokens > self._capacity_tokens:
            return False
        share = self.budget_tokens * self._fair_share(e.tenant, self._tenant_tokens)[0]
        return self._tenant_tokens.get(e.tenant, 0) + e.cost_tokens <= share

    def _admit(self, c: PriorityClass, e: Entry) -> None:
        if e.estimate_s and self.on_wait_estimate is not None:  # a queued request: how good was its estimate?
            self.on_wait_estimate((self.clock() - e.queued_at) / e.estimate_s)
        new = e.new_tokens or e.cost_tokens
        self.forecast.admitted(e.request_id, e.cost_tokens, new, max(e.max_new_tokens, new))
        c.charge(e, self.weight(e.tenant))
        c.served(e)
        self._admitted[e.request_id] = _Held(e.cost_tokens, e.tenant)
        self._tenant_tokens[e.tenant] = self._tenant_tokens.get(e.tenant, 0) + e.cost_tokens
        self.inflight_tokens += e.cost_tokens

    def _next_candidate(self) -> Entry | None:
        """The queued request served next: the class first (aged priority, then priority), then
        the smallest start tag among its tenants' heads, skipping tenants at their quota and
        preferring heads that fit by their tenant's share."""
        now = self.clock()
        order = sorted((p - int((now - c.oldest()) / self.config.aging_s), p)
                       for p, c in self._classes.items() if c.num_queued)
        for _, p in order:
            heads = [e for e in self._classes[p].heads() if self._within_quota(e)]
            if heads:
                owed = [e for e in heads if self._fits_by_share(e)]  # not held up by another tenant's request
                return min(owed or heads, key=lambda e: (e.start_tag, e.queued_at))
        return None

    def _within_quota(self, e: Entry) -> bool:
        quota = self.config.tenant_quota_tokens.get(e.tenant)
        return quota is None or self._tenant_tokens.get(e.tenant, 0) + e.cost_tokens <= quota

    def _dispatch(self) -> list[str]:
        admitted: list[str] = []
        while (e := self._next_candidate()) is not None and self._fits(e):
            self._admit(self._classes[e.priority], e)
            admitted.append(e.request_id)
        return admitted

    def _withdraw_queued(self, request_id: str) -> None:
        for c in self._classes.values():
            for e in c.entries():
                if e.request_id == request_id:
                    c.remove(e)
                    return

    def _tokens_before(self, e: Entry) -> int:
        """Queued tokens served before `e`: every more important class, and the requests of its
        own class whose turn starts no later than its."""
        ahead = 0
        for p, c in self._classes.items():
            if p < e.priority:
                ahead += sum(x.cost_tokens for x in c.entries())
            elif p == e.priority:
                ahead += sum(x.cost_tokens for x in c.entries() if x.start_tag <= e.start_tag and x is not e)
        return ahead

    def _service_order(self, extra: Entry | None = None) -> list[Entry]:
        """The queued requests (and `extra`) in the order they are served, aging aside."""
        queued = [x for c in self._classes.values() for x in c.entries()]
        if extra is not None and all(x is not extra for x in queued):
            queued.append(extra)
        return sorted(queued, key=lambda x: (x.priority, x.start_tag, x.queued_at))

    def _replay(self, extra: Entry | None = None) -> dict[str, float] | None:
        """`WaitForecast.admission_times` over the queue (with `extra`), None before calibration."""
        queue = [Queued(x.request_id, x.cost_tokens, x.new_tokens or x.cost_tokens, x.queued_at + self._can_wait(x))
                 for x in self._service_order(extra)]
        return self.forecast.admission_times(queue, self.budget_tokens - self.inflight_tokens, self.budget_tokens,
                                             self.config.max_inflight_requests - len(self._admitted))

    def _estimated_wait_s(self, e: Entry) -> float | None:
        if self._within_quota(e) and self._fits_by_share(e):
            return 0.0
        if (times := self._replay(e)) is not None:
            return max(times[e.request_id] - self.clock(), 0.0)
        rate = self.drain_rate()
        if not rate:
            return None
        short = self._tokens_before(e) + e.cost_tokens - (self.budget_tokens - self.inflight_tokens)
        return max(short, 0) / rate

    def _retry_after(self, e: Entry) -> float:
        return self._retry_hint(self._estimated_wait_s(e))

    def _retry_hint(self, wait_s: float | None) -> float:
        """A retry-after hint from an estimated wait (already replayed: not again)."""
        return min(max(wait_s or 0.0, self.config.min_retry_after_s), self.max_wait_s)
