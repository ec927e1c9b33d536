"""The OpenAI front's error answers over real loopback HTTP (aiohttp serving, a real client),
with the generation behind it scripted: 503 while no decode worker serves (/health too),
504 past a deadline, 500 for a fault of ours, 400 for /tokenize text longer than the
context allows, and a failure after the first token as an SSE error event, then [DONE]."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest

from control.heartbeat import ModelFacts
from proto import generate_pb2 as pb
from router.attempt import RequestFailed
from router.frontend import NOT_SERVING, Frontend
from router.http_api import OpenAIServer

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
        self.script: tuple[list[pb.GenerateResponse], BaseException | None] = ([], None)

    async def stream(self, request: pb.GenerateRequest, headers: Any, timeout_s: Any,
                     route: str = "") -> AsyncIterator[pb.GenerateResponse]:
        responses, error = self.script
        for r in responses:
            yield r
        if error is not None:
            raise error


def token(i: int, text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", token_ids=[i], text=text)


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
