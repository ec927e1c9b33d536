"""The forms a chat request takes from the HTTP door to the workers, counted: the router
holds one form of a request (`Ask`, then `Prepared` with the engine's `SamplingParams`) and
one form of a reply (`Reply`, its finish reason the engine's `FinishReason`); protobuf is
built only where a message leaves the process (a worker's `Prefill`/`Decode` call).

A new in-process protobuf hop (a `GenerateRequest` built only to be read back, as the HTTP
door once did; a `GenerateResponse` the HTTP door reads) fails the count. The router is
real (its HTTP door on loopback, `Generation`, admission, `RequestFlow`); its two workers
are the flow tests' in-process fakes (tests/unit/router_fakes.py), their events built
before the count starts.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp
import pytest

from engine.core.request import FinishReason, SamplingParams
from proto import generate_pb2 as pb
from router.admission import AdmissionConfig
from router.attempt import Ask, Prepared
from router.clients import WorkerRequest
from router.flow import RequestFlow
from router.frontend import Frontend
from router.gate import AdmissionGate
from router.http_api import OpenAIServer
from router.openai_output import Output
from router.reply import Reply
from router.servicer import Generation
from tests.unit.router_fakes import arrived, first, make_flow, pushed, reserved, tokens

OUTPUT = [100, 101, 102]


class Counted:
    """Stands in for a protobuf message class in `proto.generate_pb2` for the test: counts
    each message built through it, and is still the class to `isinstance`."""

    def __init__(self, real: type, counts: collections.Counter[str]) -> None:
        self.real, self.counts = real, counts

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.counts[self.real.__name__] += 1
        return self.real(*args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_chat_request_takes_one_form_in_the_router_and_becomes_protobuf_only_for_the_workers(
        tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    events = {"p0": [first(OUTPUT[0]), pushed()],
              "d0": [reserved(), arrived(), tokens(OUTPUT[1:2]), tokens(OUTPUT[2:], pb.FINISH_REASON_LENGTH)]}

    def script(worker: str) -> Any:
        return lambda request: list(events[worker])

    flow, streams = make_flow({"p0": script("p0"), "d0": script("d0")})
    seen: dict[str, list[type]] = collections.defaultdict(list)
    generation = Seen(Frontend(tiny_llama_dir), AdmissionGate(AdmissionConfig(), time.monotonic), flow, flow.members,
                      seen=seen)
    real_run, real_add = RequestFlow.run, Output.add

    async def run(self: RequestFlow, prep: Prepared, *rest: Any) -> Any:
        seen["flow"] += [type(prep), type(prep.params)]
        async for reply in real_run(self, prep, *rest):
            yield reply

    monkeypatch.setattr(RequestFlow, "run", run)
    monkeypatch.setattr(Output, "add", lambda self, r: (seen["output"].append(type(r)), real_add(self, r))[1])
    counts: collections.Counter[str] = collections.Counter()
    for name in pb.DESCRIPTOR.message_types_by_name:
        monkeypatch.setattr(pb, name, Counted(getattr(pb, name), counts))

    async def scenario() -> dict[str, Any]:
        server = OpenAIServer(generation, generation.frontend, flow.members, None, 1 << 20)  # type: ignore[arg-type]
        port = await server.start("127.0.0.1", 0, False)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "temperature": 0.5, "logprobs": False}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
        finally:
            await server.stop()
            generation.off_loop.close()

    answer = asyncio.run(scenario())
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 3
    # in the router: one form of the request, one of each reply
    assert seen["stream"] == [Ask, SamplingParams]
    assert seen["flow"] == [Prepared, SamplingParams]
    assert seen["output"] == [Reply] * 4  # three tokens, then the last reply with usage
    assert seen["finish"] == [FinishReason.LENGTH]
    # protobuf only for the two worker calls: their requests and the sampling each carries
    assert counts == {"PrefillRequest": 1, "DecodeRequest": 1, "SamplingParams": 2}, counts
    sent = _worker_requests(streams.calls)
    assert isinstance(sent["p0"], pb.PrefillRequest) and isinstance(sent["d0"], pb.DecodeRequest)
    for request in sent.values():  # the sampling as the client asked, converted once for the wire
        assert (request.sampling.max_tokens, request.sampling.temperature) == (3, 0.5)


class Seen(Generation):
    """`Generation` that records what crosses its door: the request's form, the replies'."""

    def __init__(self, *args: Any, seen: dict[str, list[Any]]) -> None:
        super().__init__(*args)
        self.seen = seen

    async def stream(self, ask: Ask, *rest: Any) -> Any:  # type: ignore[override]
        self.seen["stream"] += [type(ask), type(ask.params)]
        async for reply in super().stream(ask, *rest):
            if reply.finish_reason is not None and reply.usage is not None:
                self.seen["finish"].append(reply.finish_reason)
            yield reply


def _worker_requests(calls: list[tuple[str, WorkerRequest, Any]]) -> dict[str, WorkerRequest]:
    return {w: r for w, r, _ in calls}
