"""The router's one client interface to workers of both kinds.

`WorkerClients.call(worker_id, request)` starts a worker's server stream (a
`PrefillRequest` goes to the PrefillWorker service, a `DecodeRequest` to DecodeWorker)
and returns a `WorkerCall`: `next(cap_s)` reads one event within the cap and the
request's deadline, `cancel()` ends the call, which is how an abort reaches the worker.
Every failure a worker reports, or a broken connection, becomes a `RequestFailed` or
`WorkerFailed` here (`failure_for`, the one status-code map). The transport behind it is
a `Streams`: `GrpcStreams` in production, in-process fakes in the unit tests.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control.auth import TOKEN_METADATA
from control.tls import MemberTLS, member_channel
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.attempt import Deadline, RequestFailed, WorkerFailed

WorkerRequest = pb.PrefillRequest | pb.DecodeRequest
WorkerEvent = pb.PrefillEvent | pb.DecodeEvent


class RawStream(Protocol):
    """A started server-streaming call (`grpc.aio.UnaryStreamCall`'s surface that we use)."""

    async def read(self) -> object:
        """The next message, or `grpc.aio.EOF` after the last; raises `grpc.aio.AioRpcError`."""
        ...

    def cancel(self) -> bool:
        ...


Metadata = tuple[tuple[str, str], ...]


class Streams(Protocol):
    def open(self, address: str, request: WorkerRequest, metadata: Metadata = ()) -> RawStream:
        """`metadata`: more call metadata (the trace context)."""
        ...

    async def close(self) -> None:
        ...


ALIVE_CODES = frozenset({grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Statuses a worker answers a request's call with while it serves on: another try goes elsewhere, the worker stays."""


def failure_for(worker_id: str, code: grpc.StatusCode, details: str) -> RequestFailed:
    """The one map from a worker's status to what the router does with the request."""
    what = f"{worker_id}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # the request's fault: no retry
        return RequestFailed(code, what)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # no room there now: elsewhere, or later
        return WorkerFailed(worker_id, code, what, down=False, retry_after_s=1.0)
    # The worker answered and still serves (control/worker_host.py's `status_for`): ABORTED,
    # the request's KV transfer failed; FAILED_PRECONDITION, it cannot serve the request as
    # routed; INTERNAL/UNKNOWN, a fault there hit this request; DEADLINE_EXCEEDED, the request
    # stalled there (the worker's idle bound). Anything else (UNAVAILABLE: it is stopping, or
    # the channel's own failures): it is gone or unreachable.
    down = code not in ALIVE_CODES
    return WorkerFailed(worker_id, grpc.StatusCode.UNAVAILABLE, what, down=down, retry_after_s=1.0 if down else None)


class WorkerCall:
    """One call to one worker, read with a timeout per event. A read that times out stays
    pending (cancelling it would cancel the call): the next `next` goes on waiting for it."""

    def __init__(self, raw: RawStream, worker_id: str, deadline: Deadline) -> None:
        self.raw, self.worker_id, self.deadline = raw, worker_id, deadline
        self._read: asyncio.Future[object] | None = None

    async def next(self, cap_s: float, allow_end: bool = False) -> WorkerEvent | None:
        """The next event; None at the call's clean end when `allow_end`, else that end is a failure.
        Nothing within `cap_s` raises a `WorkerFailed` with `timed_out` set (the call goes on)."""
        timeout_s = self.deadline.remaining(cap_s)  # raises past the deadline, before a read is made
        read = self._read = self._read or asyncio.ensure_future(self.raw.read())
        done, _ = await asyncio.wait({read}, timeout=timeout_s)
        if not done:
            self.deadline.remaining(cap_s)  # raises when it was the request's own deadline
            raise WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE,
                               f"{self.worker_id} sent nothing for {cap_s:.0f} s", down=True, timed_out=True)
        if self._read is read:  # (a concurrent `failure_within` may have taken it already)
            self._read = None
        if read.cancelled():  # not this task's cancellation (that raises from the wait): the call was
            # cancelled under it, as when the worker left the membership and its channel was closed
            raise WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE,
                               f"{self.worker_id}: the call was cancelled (the worker left the cluster)", down=True)
        try:
            ev = read.result()
        except grpc.aio.AioRpcError as e:
            raise failure_for(self.worker_id, e.code(), e.details() or "") from None
        if ev is grpc.aio.EOF:
            if allow_end:
                return None
            raise WorkerFailed(self.worker_id, grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} ended the call early",
                               down=True)
        return ev  # type: ignore[return-value]

    async def failure_within(self, wait_s: float) -> RequestFailed | None:
        """The call's failure if it fails within `wait_s` (an event read meanwhile is dropped)."""
        try:
            await self.next(wait_s, allow_end=True)
        except WorkerFailed as e:
            return None if e.timed_out else e
        except RequestFailed as e:
            return e
        return None

    def cancel(self) -> None:
        read, self._read = self._read, None
        if read is not None:
            if not read.done():
                read.cancel()
            elif not read.cancelled():
                read.exception()  # retrieved: a failure after the try ended is not logged as lost
        self.raw.cancel()


class WorkerClients:
    """Calls to workers by id; `address_of` says where a worker is now (the membership table)."""

    def __init__(self, streams: Streams, address_of: Callable[[str], str | None]) -> None:
        self.streams, self.address_of = streams, address_of

    def call(self, worker_id: str, request: WorkerRequest, deadline: Deadline, metadata: Metadata = ()) -> WorkerCall:
        address = self.address_of(worker_id)
        if address is None:
            raise WorkerFailed(worker_id, grpc.StatusCode.UNAVAILABLE, f"{worker_id} is no longer a member", down=True)
        return WorkerCall(self.streams.open(address, request, metadata), worker_id, deadline)

    async def close(self) -> None:
        await self.streams.close()


HEALTH_TIMEOUT_S = 1.0
"""A health check's bound (`GrpcStreams.serving`)."""


class GrpcStreams:
    """gRPC channels to workers, one per address, opened on first use."""

    def __init__(self, token: str | None = None, tls: MemberTLS | None = None) -> None:
        """`token`: the cluster's proof of its secret, shown on every call (`control.auth`);
        `tls`: this router's identity for mutual TLS with workers (`control.tls`), None: plain."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls
        self._metadata: Metadata = ((TOKEN_METADATA, token),) if token else ()

    def open(self, address: str, request: WorkerRequest, metadata: Metadata = ()) -> RawStream:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = member_channel(address, self._tls)
        metadata = self._metadata + metadata
        if isinstance(request, pb.PrefillRequest):
            call = pb_grpc.PrefillWorkerStub(channel).Prefill(request, metadata=metadata or None)
        else:
            call = pb_grpc.DecodeWorkerStub(channel).Decode(request, metadata=metadata or None)
        return call  # type: ignore[no-any-return]

    async def serving(self, address: str, role: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Whether the worker at `address` answers its health check SERVING within `timeout_s`
        (on its calls' channel when one is open: the path its calls take)."""
        channel = self._channels.get(address)
        own = channel is None
        if channel is None:
            channel = member_channel(address, self._tls)
        service = pb.DESCRIPTOR.services_by_name["PrefillWorker" if role == "prefill" else "DecodeWorker"].full_name
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False
        finally:
            if own:
                await _close(channel)

    async def forget(self, address: str) -> None:
        """A worker left: its channel closes (its calls are cancelled; bounded wait)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await _close(channel)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await _close(channel)


CHANNEL_CLOSE_TIMEOUT_S = 2.0


async def _close(channel: grpc.aio.Channel) -> None:
    try:
        await asyncio.wait_for(channel.close(), CHANNEL_CLOSE_TIMEOUT_S)
    except TimeoutError:
        pass  # its calls were cancelled; the rest is grpc's clean-up
