"""AdmissionGate: the asyncio side of `AdmissionQueue` — a request waits here until admitted.

`admit()` offers the request: admitted at once, refused early (RESOURCE_EXHAUSTED with
a retry-after hint), or queued on a future that `release()` (a request left) or
`expire()` (a timer: waited too long, or its revised wait passes its limit) resolves. The wait is bounded by the request's
deadline and `max_queue_wait_s`; however the wait ends, the request's place is given
back exactly once.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import NoReturn

import grpc

from engine.core.step_model import StepShape
from router.admission import AdmissionConfig, AdmissionQueue, Refused
from router.attempt import Deadline, Prepared, RequestFailed


class AdmissionGate:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.queue = AdmissionQueue(config, clock)
        self._waiters: dict[str, asyncio.Future[bool | Refused]] = {}
        self.refusals: Counter[str] = Counter()
        """Requests refused, by reason (`Refused.kind`, and `timeout` for a wait that ran out)."""

    async def admit(self, prep: Prepared, deadline: Deadline, cost: int, new_tokens: int = 0,
                    max_new_tokens: int = 0) -> None:
        """Admits the request (`cost` tokens of the budget, `new_tokens` of them output, of at
        most `max_new_tokens` it may generate) or
        raises RequestFailed: refused at once with a retry hint, refused while queued once its
        revised wait passes its limit, its own deadline passed while queued (DEADLINE_EXCEEDED),
        or the queue's wait limit passed (RESOURCE_EXHAUSTED with a retry hint)."""
        verdict = self.queue.offer(prep.request_id, prep.priority, cost, deadline.at, prep.tenant, new_tokens,
                                   max_new_tokens)
        if isinstance(verdict, Refused):
            self._refuse(verdict)
        if verdict:
            return
        fut: asyncio.Future[bool | Refused] = asyncio.get_running_loop().create_future()
        self._waiters[prep.request_id] = fut
        wait_s = deadline.remaining(self.queue.max_wait_s)
        try:
            admitted = await asyncio.wait_for(fut, wait_s + 0.5)  # the queue's own expiry answers first
        except TimeoutError:
            self.queue.release(prep.request_id)
            admitted = False
        except BaseException:
            self.release(prep.request_id)
            raise
        finally:
            self._waiters.pop(prep.request_id, None)
        if isinstance(admitted, Refused):
            self._refuse(admitted)
        if admitted:
            return
        if deadline.at is not None and deadline.clock() >= deadline.at - 0.01:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed while it waited for admission")
        self.refusals["timeout"] += 1
        retry_s = self.queue.retry_after_s(cost, prep.priority, prep.tenant)
        raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"waited {self.queue.max_wait_s:g} s for admission (the router's queue limit) "
                            f"while the cluster stayed full; retry after {retry_s:.1f} s", retry_s)

    def refuse_early(self, prep: Prepared, deadline: Deadline, floor_cost: int, ceiling_cost: int) -> None:
        """Raises the refusal `admit` would give the request, whose cost lies between the two,
        when its bounds already decide it (`AdmissionQueue.refusal_at`); else returns."""
        verdict = self.queue.refusal_at(prep.priority, floor_cost, ceiling_cost, deadline.at, prep.tenant)
        if verdict is not None:
            self._refuse(verdict)

    def _refuse(self, verdict: Refused) -> NoReturn:
        self.refusals[verdict.kind] += 1
        hint = "" if verdict.retry_after_s is None else f"; retry after {verdict.retry_after_s:.1f} s"
        raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, verdict.reason + hint, verdict.retry_after_s)

    def release(self, request_id: str) -> None:
        """The request left: its budget goes to the queued requests it admits."""
        self._wake(self.queue.release(request_id))

    def _wake(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            fut = self._waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(True)
            elif fut is None:  # left already: give its place back
                self._wake(self.queue.release(rid))

    def progress(self, request_id: str, num_generated: int) -> None:
        """An admitted request has sent `num_generated` tokens (the wait forecast times them;
        past its expected output, it is charged what it holds)."""
        self.queue.progress(request_id, num_generated)

    def ended(self, prep: Prepared, num_generated: int) -> None:
        """The request ended by itself (a stop or its length) after `num_generated` tokens: a
        sample of what its tenant and route generate (the expected output admission charges)."""
        self.queue.lengths.observe(prep.tenant, prep.route, num_generated)

    def set_step_model(self, model: StepShape | None, num_decode_workers: int) -> None:
        """The decode workers' step time model (the wait forecast's per-token time)."""
        self.queue.forecast.set_step_model(model, num_decode_workers)

    def observe_ttft(self, seconds: float, cost_tokens: int) -> None:
        """An admitted request's first token came `seconds` after its admission (TTFT steering)."""
        self._wake(self.queue.observe_ttft(seconds, cost_tokens))

    def set_capacity(self, kv_tokens: int, max_held_tokens: int | None = None) -> None:
        """The decode pool's KV capacity in tokens (0: unknown): the budget follows it;
        `max_held_tokens`: the most one sequence holds (None: its length)."""
        self._wake(self.queue.set_capacity(kv_tokens, max_held_tokens))

    def expire(self) -> None:
        """Called on a timer: queued requests past their max wait, or whose revised wait now
        passes it, are refused."""
        ended: list[tuple[str, bool | Refused]] = [(rid, False) for rid in self.queue.expire()]
        for rid, verdict in ended + list(self.queue.revise()):
            fut = self._waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(verdict)
