"""One request's state in the router: its tries on workers, its deadline, the failures that
end a try (`WorkerFailed`: another try may go elsewhere) or the request (`RequestFailed`),
and the decode worker's stream read with a timeout per message."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.request import SamplingParams
from proto import generate_pb2 as pb


class RequestFailed(Exception):
    """Ends a Generate stream with `code`; `retry_after_s` becomes trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class WorkerFailed(RequestFailed):
    """A worker failed under the request (not the request's fault): another try may go elsewhere."""

    def __init__(self, worker_id: str, code: grpc.StatusCode, message: str, down: bool,
                 retry_after_s: float | None = None) -> None:
        super().__init__(code, message, retry_after_s)
        self.worker_id = worker_id
        self.down = down
        """The worker itself is dead or unreachable (it gets no new requests for a while)."""


@dataclass
class Prepared:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str

    def attempt(self, n: int, sent: list[int]) -> Attempt:
        """Try `n` (0 first): a later one re-prefills the prompt plus the tokens `sent` and asks for the rest."""
        if n == 0:
            return Attempt(self.request_id, self.token_ids, self.params, self.tenant, self.priority)
        return Attempt(f"{self.request_id}~{n}", self.token_ids + sent,
                       dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(sent)),
                       self.tenant, self.priority)


@dataclass(frozen=True)
class Attempt:
    """One try of a request on workers: after a failure, the prompt grows by the tokens already sent."""

    worker_request_id: str
    token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: int


@dataclass
class Progress:
    """One request's counters and clock readings (perf_counter seconds)."""

    arrived: float
    admitted: float = 0.0
    routed: float = 0.0
    first_token: float = 0.0
    transfer_ms: float = 0.0
    transfer_window_ms: float = 0.0
    num_cached_tokens: int = 0
    route: pb.Route | None = None
    """Where the current try runs."""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    """Sent to the client so far."""

    @property
    def num_sent(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Deadline:
    """The client's deadline on the router's clock (None: the client set none)."""

    at: float | None
    clock: Callable[[], float] = time.monotonic

    def remaining(self, cap_s: float) -> float:
        """Seconds a wait may take: `cap_s`, or less when the deadline comes first; raises once it passed."""
        if self.at is None:
            return cap_s
        left = self.at - self.clock()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return min(left, cap_s)


class DecodeStream:
    """Reads one Decode call with a timeout per message; maps its errors to RequestFailed."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, worker_id: str, deadline: Deadline,
                 prefill_timeout_s: float, idle_timeout_s: float) -> None:
        self.call, self.worker_id, self.deadline = call, worker_id, deadline
        self.prefill_timeout_s, self.idle_timeout_s = prefill_timeout_s, idle_timeout_s

    def _failure(self, e: grpc.aio.AioRpcError) -> RequestFailed:
        code, what = e.code(), f"decode worker {self.worker_id}: {e.details()}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return RequestFailed(code, what)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return WorkerFailed(self.worker_id, code, what, down=False, retry_after_s=1.0)
        # ABORTED: its KV transfer failed; INTERNAL/UNKNOWN: this request hit a fault there
        down = code not in (grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        return WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE, what, down=down)

    async def _read(self, cap_s: float) -> pb.DecodeEvent:
        timeout_s = self.deadline.remaining(cap_s)  # raises past the deadline, before a read is made
        try:
            ev = await asyncio.wait_for(self.call.read(), timeout_s)
        except TimeoutError:
            self.deadline.remaining(cap_s)  # raises when it was the request's own deadline
            raise WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE,
                               f"decode worker {self.worker_id} sent nothing for {cap_s:.0f} s", down=True) from None
        except grpc.aio.AioRpcError as e:
            raise self._failure(e) from None
        if ev is grpc.aio.EOF:
            raise WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE,
                               f"decode worker {self.worker_id} ended the stream early", down=True)
        return ev

    async def raise_if_failed(self, wait_s: float) -> None:
        """Raises if the decode worker turns out dead or unreachable within `wait_s`."""
        try:
            await asyncio.wait_for(self.call.read(), wait_s)
        except TimeoutError:
            return
        except grpc.aio.AioRpcError as e:
            failure = self._failure(e)
            if isinstance(failure, WorkerFailed) and failure.down:
                raise failure from None

    async def reserved(self) -> pb.Reserved:
        ev = await self._read(self.prefill_timeout_s)
        if not ev.HasField("reserved"):
            raise RequestFailed(grpc.StatusCode.INTERNAL, "decode worker: expected a reservation first")
        return ev.reserved

    async def next_tokens(self) -> pb.Tokens:
        ev = await self._read(self.idle_timeout_s)
        if not ev.HasField("tokens"):
            raise RequestFailed(grpc.StatusCode.INTERNAL, "decode worker: expected tokens")
        return ev.tokens
