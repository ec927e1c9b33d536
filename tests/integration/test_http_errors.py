"""The OpenAI front's error answers over real loopback HTTP (aiohttp serving, a real client),
with the generation behind it scripted: 503 while no decode worker serves (/health too),
504 past a deadline, 500 for a fault of ours, 400 for /tokenize text longer than the
context allows, and a failure after the first token as an SSE error event, then [DONE]."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest

from control.heartbeat import ModelFacts
from engine.core.request import FinishReason
from router.attempt import Ask, RequestFailed
from router.frontend import NOT_SERVING, Frontend
from router.http_api import OpenAIServer
from router.reply import Reply, Usage

FACTS = ModelFacts(model_id="m", block_size=16, vocab_size=1000, max_model_len=64, num_total_blocks=64)


@dataclass
class Members:
    facts: ModelFacts | None = FACTS
    decode: list[str] = field(default_factory=lambda: ["decode-0"])

    def serving(self, role: str) -> list[str]:
        return self.decode if role == "decode" else []

    def max_decode_blocks(self) -> int:
        return 64


class Generation:
    """Answers every request with `script`: responses to yield, and an exception to end with."""

    def __init__(self) -> None:
        self.script: tuple[list[Reply], BaseException | None] = ([], None)

    async def stream(self, ask: Ask, headers: Any, timeout_s: Any) -> AsyncIterator[Reply]:
        responses, error = self.script
        for r in responses:
            yield r
        if error is not None:
            raise error


def token(i: int, text: str) -> Reply:
    return Reply("r", token_ids=[i], text=text)


def test_the_fronts_errors_over_http() -> None:
    generation, members = Generation(), Members()

    async def scenario() -> None:
        server = OpenAIServer(generation, Frontend(None), members, None, 1 << 20)  # type: ignore[arg-type]
        port = await server.start("127.0.0.1", 0, False)
        url = f"http://127.0.0.1:{port}"
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        try:
            async with aiohttp.ClientSession() as http:
                async def post(path: str, payload: dict) -> tuple[int, Any, dict]:
                    async with http.post(url + path, json=payload) as r:
                        return r.status, r.headers, await r.json()

                generation.script = ([], RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed"))
                status, _, answer = await post("/v1/completions", body)
                assert (status, answer["error"]["type"], answer["error"]["message"]) == (
                    504, "timeout_error", "the deadline passed")

                generation.script = ([], RuntimeError("a bug"))
                status, _, answer = await post("/v1/completions", body)
                assert (status, answer["error"]["code"]) == (500, "internal")
                assert "internal error in the router" in answer["error"]["message"]

                generation.script = ([token(5, "a"), token(6, "b")],
                                     RequestFailed(grpc.StatusCode.UNAVAILABLE, "every decode worker is gone"))
                async with http.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    events = [line[len(b"data: "):] for line in (await r.read()).split(b"\n\n") if line]
                assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
                assert json.loads(events[2]) == {"error": {"message": "every decode worker is gone",
                                                           "type": "service_unavailable_error", "param": None,
                                                           "code": 503}}
                assert events[3:] == [b"[DONE]"]

                status, _, answer = await post("/tokenize", {"model": "m", "prompt": "x" * (32 * 64 + 1)})
                assert status == 400 and "the model's context is 64 tokens" in answer["error"]["message"]

                members.facts, members.decode = None, []
                generation.script = ([token(5, "a")], None)
                status, headers, answer = await post("/v1/completions", {"prompt": "hi"})
                assert (status, answer["error"]["message"], headers["Retry-After"]) == (503, NOT_SERVING, "1")
                async with http.get(url + "/health") as r:
                    assert r.status == 503 and (await r.json())["error"]["message"] == NOT_SERVING
        finally:
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("code, down", [(grpc.StatusCode.DEADLINE_EXCEEDED, False), (grpc.StatusCode.INTERNAL, False),
                                        (grpc.StatusCode.UNAVAILABLE, True)])
def test_a_worker_status_is_read_as_the_worker_meant_it(code: grpc.StatusCode, down: bool) -> None:
    """DEADLINE_EXCEEDED from a worker is its own idle bound on a stalled request: the worker
    lives (the request is retried elsewhere without marking it down)."""
    from router.attempt import WorkerFailed
    from router.clients import failure_for

    failure = failure_for("decode-0", code, "decode-0: nothing for 120 s")
    assert isinstance(failure, WorkerFailed) and failure.down is down


class Recorded(Generation):
    """`Generation` that also records how each stream ended: closed (its request cancelled,
    which frees its blocks on every worker) or run to its end."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0

    async def stream(self, ask: Ask, headers: Any, timeout_s: Any) -> AsyncIterator[Reply]:
        self.open += 1
        try:
            async for r in super().stream(ask, headers, timeout_s):
                yield r
        finally:
            self.open -= 1


@contextlib.asynccontextmanager
async def chat_server(generation: Generation) -> AsyncIterator[tuple[int, aiohttp.ClientSession]]:
    """The HTTP door over `generation` on a free loopback port (every chat renders [5, 6]), and a client."""
    server = OpenAIServer(generation, Frontend(None), Members(), None, 1 << 20)  # type: ignore[arg-type]
    server.frontend.chat_token_ids = lambda *a, **k: [5, 6]  # type: ignore[method-assign]
    port = await server.start("127.0.0.1", 0, False)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            yield port, http
    finally:
        await server.stop()


def choice_token(i: int, text: str, choice: int) -> Reply:
    return Reply("r", token_ids=[i], text=text, choice=choice)


WHERE = ["first", "midway", "usage"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_fault_mid_stream_ends_it_with_an_error_event_then_done(monkeypatch: pytest.MonkeyPatch, path: str, n: int,
                                                                  where: str) -> None:
    """A fault that is not a RequestFailed (a bug, a conversion error) once ended the pump
    without its end marker: status 200, some chunks, then nothing until the client's timeout.
    Now, at the first chunk, mid-way or at the usage chunk: an error event in OpenAI's shape,
    then [DONE]; a whole answer is a 500; and every stream below is closed."""
    from router.openai_output import Output

    generation = Recorded()
    tokens = [choice_token(5 + c, "ab"[c], c) for c in range(n)]
    if where == "first":  # a response the output cannot place: a conversion error on the first chunk
        generation.script = ([choice_token(5, "a", n + 3)], None)
    elif where == "midway":
        generation.script = (tokens, RuntimeError("a bug below, after the first tokens"))
    else:
        generation.script = ([Reply("r", token_ids=[5 + c], text="ab"[c], choice=c, finish_reason=FinishReason.LENGTH,
                                    usage=Usage(prompt_tokens=2, cached_tokens=0, completion_tokens=1))
                              for c in range(n)], None)
        real = Output.chunk
        monkeypatch.setattr(Output, "chunk", lambda self, r, *a: real(self, r, *a) if r is not None
                            else (_ for _ in ()).throw(ValueError("no usage")))
    body = {"model": "m", "max_tokens": 4, "n": n, "stream_options": {"include_usage": True},
            **({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}

    async def scenario() -> None:
        async with chat_server(generation) as (port, http):
            async with http.post(f"http://127.0.0.1:{port}{path}", json={**body, "stream": True}) as r:
                assert r.status == 200
                events = [line[len(b"data: "):] for line in (await r.read()).split(b"\n\n") if line]
            assert events[-1] == b"[DONE]" and generation.open == 0
            error = json.loads(events[-2])
            assert error == {"error": {"message": "internal error in the router (logged); retry",
                                       "type": "internal_error", "param": None, "code": 500}}
            assert all("error" not in json.loads(e) for e in events[:-2])
            if where == "usage":  # every choice's tokens went out before the usage chunk failed
                assert sum(b'"finish_reason":"length"' in e for e in events) == n
            body.pop("stream_options")
            async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                answer = await r.json()
            if where == "usage":  # a whole answer has no usage chunk: it succeeds
                assert r.status == 200 and len(answer["choices"]) == n
            else:
                assert (r.status, answer["error"]["code"]) == (500, "internal")
            assert generation.open == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", [RuntimeError("a bug below"), RequestFailed(grpc.StatusCode.UNAVAILABLE, "gone")])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_fault_mid_stream_of_an_agent_api_is_its_error_event_then_the_end(path: str, fault: Exception) -> None:
    """The Responses API ends a failed stream with `error` then `response.failed`, the
    Messages API with an `error` event in Anthropic's shape; a whole answer is the error in
    each API's shape; every stream below is closed."""
    generation = Recorded()
    generation.script = ([token(5, "a"), token(6, "b")], fault)
    body = {"model": "m", "input": "hi"} if path == "/v1/responses" else \
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status = 500 if isinstance(fault, RuntimeError) else 503
    message = "internal error in the router (logged); retry" if status == 500 else "gone"

    async def scenario() -> None:
        async with chat_server(generation) as (port, http):
            async with http.post(f"http://127.0.0.1:{port}{path}", json={**body, "stream": True}) as r:
                assert r.status == 200
                events = [dict(line.split(": ", 1) for line in e.split("\n"))
                          for e in (await r.text()).split("\n\n") if e]
            kinds = [e["event"] for e in events]
            if path == "/v1/responses":
                assert kinds[-4:] == ["response.output_text.delta", "response.output_text.delta", "error",
                                      "response.failed"]
                assert json.loads(events[-2]["data"])["message"] == message
                assert json.loads(events[-1]["data"])["response"]["status"] == "failed"
            else:
                assert kinds[-3:] == ["content_block_delta", "content_block_delta", "error"]
                assert json.loads(events[-1]["data"]) == {"type": "error", "error": {
                    "type": "api_error" if status == 500 else "overloaded_error", "message": message}}
            assert generation.open == 0
            async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                answer = await r.json()
            assert r.status == status and generation.open == 0
            if path == "/v1/messages":
                assert answer["type"] == "error" and answer["error"]["message"] == message
            else:
                assert answer["error"]["message"] == message

    asyncio.run(scenario())


def test_a_request_refused_before_the_flow_has_an_access_line_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """The flow writes a request's access line; one refused at the door (its key, its body, its
    model) never reaches the flow and gets its line from the door: route, the gRPC status its
    HTTP answer stands for, the key's tenant. A request that reached the flow gets no second line."""
    from router.api_keys import ApiKeys
    from router.http_guard import HttpGuard

    generation = Generation()
    key = {"Authorization": "Bearer sk-aaaaaaaaaa"}
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}

    async def scenario() -> list[int]:
        guard = HttpGuard(api_keys=ApiKeys.parse(["sk-aaaaaaaaaa:acme"]))
        server = OpenAIServer(generation, Frontend(None), Members(), None, 1 << 20,  # type: ignore[arg-type]
                              guard=guard)
        port = await server.start("127.0.0.1", 0, False)
        url, statuses = f"http://127.0.0.1:{port}", []
        try:
            async with aiohttp.ClientSession() as http:
                async def post(path: str, headers: dict | None = None, **kw: Any) -> None:
                    async with http.post(url + path, headers=headers, **kw) as r:
                        statuses.append(r.status)

                await post("/v1/chat/completions", json=body)  # no key
                await post("/v1/completions", {**key, "Content-Type": "application/json"}, data=b"{not json")
                await post("/v1/messages", key, json={"model": "other", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
                await post("/v1/responses", {**key, "Content-Type": "text/plain"}, data=b"hi")
                generation.script = ([token(5, "a")], None)
                await post("/v1/completions", key, json=body)  # reached the flow: its line is the flow's
                generation.script = ([], RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=1.0))
                await post("/v1/completions", key, json=body)  # refused by the flow: the flow's line too
                async with http.get(url + "/v1/models", headers=key) as r:  # not a generation: no line
                    statuses.append(r.status)
        finally:
            await server.stop()
        return statuses

    with caplog.at_level("INFO", logger="splitserve.access"):
        assert asyncio.run(scenario()) == [401, 400, 404, 415, 200, 429, 200]
    lines = [r.getMessage().rsplit(" ", 1)[0] for r in caplog.records if r.name == "splitserve.access"]
    assert lines == [
        "request - client_id='' tenant='' route=chat status=16 prompt=0 output=0 cached=0",
        "request - client_id='' tenant='acme' route=completion status=3 prompt=0 output=0 cached=0",
        "request - client_id='' tenant='acme' route=messages status=5 prompt=0 output=0 cached=0",
        "request - client_id='' tenant='acme' route=responses status=3 prompt=0 output=0 cached=0"]
