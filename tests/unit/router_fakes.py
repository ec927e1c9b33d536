"""In-process fake workers for the router's request flow (no Ray, no sockets), shared by
the flow's unit tests.

Each fake worker plays a script of events and failures through the same `Streams`
interface the gRPC client implements; failures are real `grpc.aio.AioRpcError`s, so the
status-code map is exercised as in production. `make_flow` builds a `RequestFlow` on them,
`run` sends one request, and `assert_settled` checks every call was cancelled and the load
book holds nothing afterwards (bookings settled once).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from router.attempt import Deadline, Prepared, Progress
from router.clients import WorkerClients, WorkerRequest
from router.config import RouterConfig
from router.flow import RequestFlow
from router.choices import Choices
from router.reply import Reply
from router.kv_index import KVIndex
from router.loads import LoadBook
from router.members import Members
from router.policy import RoutingConfig
from tests.unit.helpers import heartbeat

HANG = "hang"
Script = list[object]
"""Events to return in order; an AioRpcError is raised; HANG waits until cancelled; a float
is a pause of that many seconds before the next item; the end is EOF."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeStream:
    def __init__(self, script: Script) -> None:
        self.script = list(script)
        self.cancelled = False
        self._cancel = asyncio.Event()

    async def read(self) -> object:
        if self.cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED, "cancelled")
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        while isinstance(item, float):
            await asyncio.sleep(item)
            item = self.script.pop(0)
        if item == HANG:
            await self._cancel.wait()
            raise rpc_error(grpc.StatusCode.CANCELLED, "cancelled")
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        self._cancel.set()
        return True


class FakeStreams:
    """Workers by address; `scripts[worker_id]` makes each call's script from its request."""

    def __init__(self, scripts: dict[str, Callable[[WorkerRequest], Script]]) -> None:
        self.scripts = scripts
        self.calls: list[tuple[str, WorkerRequest, FakeStream]] = []

    def open(self, address: str, request: WorkerRequest, metadata: tuple[tuple[str, str], ...] = ()) -> FakeStream:
        stream = FakeStream(self.scripts[address](request))
        self.calls.append((address, request, stream))
        return stream

    async def close(self) -> None:
        pass

    def tried(self) -> list[str]:
        return [w for w, _, _ in self.calls]


def reserved() -> pb.DecodeEvent:
    return pb.DecodeEvent(reserved=pb.Reserved(ticket=pb.KVTicket(request_id="r1", reservation_id=7)))


def arrived() -> pb.DecodeEvent:
    return pb.DecodeEvent(arrived=pb.Arrived(transfer_window_ms=1.0))


def tokens(ids: list[int], finish: int = pb.FINISH_REASON_UNSPECIFIED) -> pb.DecodeEvent:
    return pb.DecodeEvent(tokens=pb.Tokens(token_ids=ids, finish_reason=finish))


def first(token_id: int) -> pb.PrefillEvent:
    return pb.PrefillEvent(first=pb.FirstToken(token_id=token_id))


def pushed() -> pb.PrefillEvent:
    return pb.PrefillEvent(pushed=pb.KVPushed(push_ms=1.0))


def good_prefill(req: WorkerRequest) -> Script:
    """The first token of the sequence 100, 101, ... after wherever the request's prompt ends."""
    return [first(100 + len(req.prompt_token_ids) - len(PROMPT)), pushed()]


def good_decode(req: WorkerRequest) -> Script:
    """Continues the sequence 100, 101, ... from wherever the request's prompt ends."""
    assert isinstance(req, pb.DecodeRequest)
    done = len(req.prompt_token_ids) - len(PROMPT)  # tokens a retried request already sent
    n = req.sampling.max_tokens
    if req.local_prefill:
        return [tokens([100 + done + i], pb.FINISH_REASON_LENGTH if i == n - 1 else 0) for i in range(n)]
    rest = [tokens([100 + done + i], pb.FINISH_REASON_LENGTH if i == n - 1 else 0) for i in range(1, n)]
    return [reserved(), arrived(), *rest]


PROMPT = list(range(1, 41))
MAX_TOKENS = 5
EXPECTED = [100, 101, 102, 103, 104]


def first_call_then(failing: Callable[[WorkerRequest], Script],
                    good: Callable[[WorkerRequest], Script]) -> Callable[[WorkerRequest], Script]:
    """A script maker shared by workers of one kind: the first call fails, later ones go well."""
    n = [0]

    def script(req: WorkerRequest) -> Script:
        n[0] += 1
        return failing(req) if n[0] == 1 else good(req)
    return script


def make_flow(scripts: dict[str, Callable[[WorkerRequest], Script]],
              mode: str = "disaggregated", **config_kw: float) -> tuple[RequestFlow, FakeStreams]:
    members = Members(("*",))
    beats = {w: heartbeat(w, "prefill" if w.startswith("p") else "decode", address=w, model_id="m", block_size=16,
                          vocab_size=1000, max_model_len=512, num_total_blocks=64) for w in scripts}
    members.update(beats)
    loads = LoadBook(members.num_blocks())
    streams = FakeStreams(scripts)
    config = RouterConfig(**{"routing": RoutingConfig(mode=mode), "prefill_timeout_s": 5.0,  # type: ignore[arg-type]
                             "decode_idle_timeout_s": 5.0, "no_worker_wait_s": 0.3,
                             "cluster_secret": b"flow-test-secret", **config_kw})
    return RequestFlow(config, members, WorkerClients(streams, members.address), KVIndex(time.monotonic), loads,
                       seed=0), streams


async def run(flow: RequestFlow, deadline_s: float | None = None) -> tuple[list[int], list[Reply]]:
    prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0, "")
    progress = Progress(time.perf_counter())
    deadline = Deadline(None if deadline_s is None else time.monotonic() + deadline_s)
    responses = [r async for r in flow.run(prep, deadline, progress, Choices(prep, progress, [None]))]
    return [t for r in responses for t in r.token_ids], responses


def assert_settled(flow: RequestFlow, streams: FakeStreams) -> None:
    assert all(s.cancelled for _, _, s in streams.calls)  # every call ended by the router (the abort)
    for w in ["p0", "p1", "d0", "d1"]:
        load = flow.loads.load(w)
        assert (load.num_active, load.queued_prefill_tokens) == (0, 0), w  # the router's own bookings too
        assert load.num_free_blocks == load.num_total_blocks, w
