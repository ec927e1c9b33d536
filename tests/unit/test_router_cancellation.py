"""Cancellations inside the router. `WorkerCall` tells a call cancelled under it (grpc.aio
raises `CancelledError` from a read when the call's channel is closed, as the router does
when a worker leaves the membership) from the caller's own cancellation: the first is that
worker's failure, so the request is retried elsewhere; the second still cancels. And a
cancellation that escapes the flow anyway ends the client's call with a status at once,
not silence until its deadline."""
from __future__ import annotations

import asyncio

import time
from collections.abc import AsyncIterator

import grpc
import pytest

from proto import generate_pb2 as pb
from router.admission import AdmissionConfig
from router.attempt import Deadline, Prepared, RequestFailed, WorkerFailed
from engine.core.request import FinishReason
from router.reply import Reply, Usage
from router.clients import WorkerCall
from router.frontend import Frontend
from router.gate import AdmissionGate
from router.members import Members
from router.metrics import RouterMetrics
from router.servicer import Generation
from tests.unit.helpers import heartbeat


class ClosableStream:
    """A read that waits until the stream is closed under it, then raises as grpc.aio does."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.reading = asyncio.Event()

    async def read(self) -> object:
        self.reading.set()
        await self.closed.wait()
        raise asyncio.CancelledError

    def cancel(self) -> bool:
        return True


def test_a_read_cancelled_under_the_call_is_the_workers_failure() -> None:
    async def scenario() -> WorkerFailed:
        stream = ClosableStream()
        call = WorkerCall(stream, "decode-far", Deadline(None))
        asyncio.get_running_loop().call_later(0.05, stream.closed.set)  # the channel closes mid-wait
        with pytest.raises(WorkerFailed) as failed:
            await call.next(5.0)
        return failed.value

    failure = asyncio.run(scenario())
    assert (failure.worker_id, failure.code, failure.down, failure.timed_out) == (
        "decode-far", grpc.StatusCode.UNAVAILABLE, True, False)
    assert "left the cluster" in failure.message


def test_the_callers_own_cancellation_still_cancels() -> None:
    async def scenario() -> None:
        stream = ClosableStream()
        call = WorkerCall(stream, "decode-far", Deadline(None))
        task = asyncio.ensure_future(call.next(5.0))
        await asyncio.wait_for(stream.reading.wait(), 5)  # the call waits in its read
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        call.cancel()

    asyncio.run(scenario())


class Aborted(Exception):
    pass


class Context:
    """The parts of grpc.aio's ServicerContext the Generate handler uses."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.trailers: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str], ...]) -> None:
        self.trailers = trailers

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted


def one_decode_worker() -> Members:
    """The membership a Generation sees: one decode worker, d0."""
    members = Members(("*",))
    members.update({"d0": heartbeat("d0", "decode", address="d0", model_id="m", block_size=16, vocab_size=1000,
                                    max_model_len=512, num_total_blocks=64)})
    return members


class CancelledFlow:
    """A flow with a bug: its run is cancelled from below."""

    def cached_tokens(self, prep: Prepared) -> int:
        return 0

    async def run(self, *args: object) -> AsyncIterator[pb.GenerateResponse]:
        raise asyncio.CancelledError
        yield  # an async generator, as the real flow is


def test_a_cancellation_from_below_ends_the_call_with_a_status() -> None:
    members = one_decode_worker()
    gate = AdmissionGate(AdmissionConfig(), time.monotonic)
    service = Generation(Frontend(None), gate, CancelledFlow(), members)  # type: ignore[arg-type]
    context = Context()

    async def call() -> None:
        request = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises(Aborted):
            async for _ in service.Generate(request, context):  # type: ignore[arg-type]
                pass

    asyncio.run(call())
    assert context.status == (grpc.StatusCode.UNAVAILABLE, "the request was cut off inside the router; retry")
    assert context.trailers == (("retry-after-ms", "1000"),)
    assert gate.queue.num_admitted == 0 and not service._named  # released


def test_each_request_ends_with_one_access_line(caplog: pytest.LogCaptureFixture) -> None:
    """Who asked (the client's id, the tenant), by which door, and how it ended: one line a
    request, on the `splitserve.access` logger."""
    members = one_decode_worker()
    service = Generation(Frontend(None), AdmissionGate(AdmissionConfig(), time.monotonic), CancelledFlow(),  # type: ignore[arg-type]
                         members)

    async def call(request_id: str) -> None:
        request = pb.GenerateRequest(request_id=request_id, tenant="gold", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises(Aborted):
            async for _ in service.Generate(request, Context()):  # type: ignore[arg-type]
                pass

    with caplog.at_level("INFO", logger="splitserve.access"):
        asyncio.run(call("mine"))
        asyncio.run(call("forged\nrequest x status=0"))
    first, second = [r.getMessage() for r in caplog.records if r.name == "splitserve.access"]
    assert "client_id='mine' tenant='gold' route=generate status=14 prompt=3 output=0" in first
    assert "status=3 prompt=0" in second and "\n" not in second  # refused; its newline forges no line


def test_a_call_refused_at_the_door_has_its_access_line(caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that are no request, and a call without a key where keys are needed, never reach
    the flow: the door writes their lines (the tenant a keyless call names is not believed)."""
    from router.api_keys import ApiKeys

    gate = AdmissionGate(AdmissionConfig(), time.monotonic)
    service = Generation(Frontend(None), gate, CancelledFlow(), one_decode_worker(),  # type: ignore[arg-type]
                         api_keys=ApiKeys.parse(["sk-aaaaaaaaaa"]))

    async def call(raw: bytes) -> grpc.StatusCode | None:
        context = Context()
        with pytest.raises(Aborted):
            async for _ in service.GenerateRaw(raw, context):  # type: ignore[arg-type]
                pass
        return context.status[0] if context.status else None

    keyless = pb.GenerateRequest(request_id="r1", tenant="gold", text="hi").SerializeToString()
    with caplog.at_level("INFO", logger="splitserve.access"):
        assert asyncio.run(call(b"\x12\x02\xff\xfe")) == grpc.StatusCode.INVALID_ARGUMENT  # text not UTF-8
        assert asyncio.run(call(keyless)) == grpc.StatusCode.UNAUTHENTICATED
    lines = [r.getMessage().rsplit(" ", 1)[0] for r in caplog.records if r.name == "splitserve.access"]
    assert lines == ["request - client_id='' tenant='' route=generate status=3 prompt=0 output=0 cached=0",
                     "request - client_id='r1' tenant='' route=generate status=16 prompt=0 output=0 cached=0"]


class EndlessFlow:
    """A flow that sends one token, then nothing more until it is cancelled; or, for a request
    asking 1 token, that one as its last reply."""

    def cached_tokens(self, prep: Prepared) -> int:
        return 0

    async def run(self, prep: Prepared, deadline: Deadline, progress: object, out: object) -> AsyncIterator[Reply]:
        progress.token_ids.append(9)  # type: ignore[attr-defined]
        if prep.params.max_tokens == 1:
            yield Reply(prep.shown_id, token_ids=[9], finish_reason=FinishReason.LENGTH, usage=Usage(3, 0, 1))
        else:
            yield Reply(prep.shown_id, token_ids=[9])
        await asyncio.Event().wait()


def ask(max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[5, 6, 7]),
                              sampling=pb.SamplingParams(max_tokens=max_tokens))


async def read_then_close(service: Generation, request: pb.GenerateRequest, replies: int = 1) -> None:
    """Reads up to `replies` replies (or the call's failure), then closes the stream, as the HTTP
    door does when its client goes or after a last reply."""
    stream = service.Generate(request, Context())  # type: ignore[arg-type]
    try:
        for _ in range(replies):
            await anext(stream)
    except Aborted:  # the call's status, set by context.abort
        pass
    finally:
        await stream.aclose()


def test_a_client_gone_mid_stream_is_cancelled_in_its_access_line(caplog: pytest.LogCaptureFixture) -> None:
    """A caller who leaves mid-stream (grpc.aio cancels the handler; the HTTP door closes the
    stream) is logged CANCELLED (1), not OK: an operator counting the requests that did not end
    well counts it."""
    members = one_decode_worker()
    gate = AdmissionGate(AdmissionConfig(), time.monotonic)
    service = Generation(Frontend(None), gate, EndlessFlow(), members)  # type: ignore[arg-type]

    async def cancelled() -> None:
        first = asyncio.Event()

        async def read() -> None:
            async for _ in service.Generate(ask(8, "left"), Context()):  # type: ignore[arg-type]
                first.set()
        task = asyncio.ensure_future(read())
        await asyncio.wait_for(first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level("INFO", logger="splitserve.access"):
        asyncio.run(cancelled())
        asyncio.run(read_then_close(service, ask(8, "closed")))
        asyncio.run(read_then_close(service, ask(1, "ended")))  # closed after its last reply: it ended
    lines = [r.getMessage() for r in caplog.records if r.name == "splitserve.access"]
    assert len(lines) == 3, lines
    assert "client_id='left' tenant='' route=generate status=1 prompt=3 output=1" in lines[0]
    assert "client_id='closed' tenant='' route=generate status=1 prompt=3 output=1" in lines[1]
    assert "client_id='ended' tenant='' route=generate status=0 prompt=3 output=1" in lines[2]
    assert service.stats["num_requests"] == 3  # each counted as it ended, the first two as aborted
    assert gate.queue.num_admitted == 0 and not service._named  # both released


class FailingFlow(EndlessFlow):
    """A flow that sends one token, then fails as a request whose workers are all gone does."""

    async def run(self, prep: Prepared, deadline: Deadline, progress: object, out: object) -> AsyncIterator[Reply]:
        progress.token_ids.append(9)  # type: ignore[attr-defined]
        yield Reply(prep.shown_id, token_ids=[9])
        raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no decode worker left")


def test_each_admitted_request_is_counted_once_by_how_it_ended() -> None:
    """request_success_total's reasons, as vLLM's: `length` for one that ran out its tokens,
    `abort` for one whose client went, `error` for one that failed after admission (its
    workers gone; a cancellation from below)."""
    members = one_decode_worker()
    metrics = RouterMetrics()

    def service(flow: object) -> Generation:
        gate = AdmissionGate(AdmissionConfig(), time.monotonic)
        return Generation(Frontend(None), gate, flow, members, metrics=metrics)  # type: ignore[arg-type]

    asyncio.run(read_then_close(service(EndlessFlow()), ask(1)))  # its last reply, then closed: ended
    asyncio.run(read_then_close(service(EndlessFlow()), ask(8)))  # closed mid-stream: aborted
    asyncio.run(read_then_close(service(FailingFlow()), ask(8), replies=2))  # UNAVAILABLE after its first token
    asyncio.run(read_then_close(service(CancelledFlow()), ask(8)))  # UNAVAILABLE before any

    def count(reason: str) -> float | None:
        return metrics.registry.get_sample_value("splitserve:request_success_total",
                                                 {"model_name": "", "finished_reason": reason})
    assert (count("length"), count("abort"), count("error")) == (1, 1, 2)
    assert metrics.registry.get_sample_value("splitserve:generation_tokens_total", {"model_name": ""}) == 3
