"""The HTTP API against hostile clients, over real loopback sockets: the server (aiohttp, the
router's OpenAIServer, its generation scripted) runs on its own thread and event loop while
this thread attacks it. Each case ends in a clear 4xx or a closed connection, a real request
is answered meanwhile, and a 1 ms timer on the server's loop shows it never stalled for long
(the bound asserted is loose, 2 s, against stalls of 13 to 19 s before; the measured numbers,
tens of milliseconds, are benchmarks/hostile/front_hostile.py's)."""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.config import HttpDeadlines
from router.frontend import Frontend
from router.http_api import OpenAIServer
from router.http_guard import HttpGuard
from router.request_limits import RequestLimits
from tests.integration.test_http_errors import Generation, Members, token

pytestmark = pytest.mark.timeout(300)

DEADLINES = HttpDeadlines(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=20_000, max_idle_connections=200)
STALL_BOUND_S = 10.0
"""Loose: it catches the stalls of seconds these cases caused (13 s, 19 s), not a loaded
machine's scheduling (0.5 s seen beside a CI run; 2.75 s in the ten-thousand-connection flood
of a fresh-clone run beside two more pytest workers, 6.8 s on a slowed machine); the measured
stalls are the benchmark's."""


class Served:
    """An OpenAIServer on a thread of its own, with a lateness probe on its loop."""

    def __init__(self, frontend: Frontend, guard: HttpGuard | None = None,
                 deadlines: HttpDeadlines = DEADLINES) -> None:
        self.generation, self.members = Generation(), Members()
        self.generation.script = ([token(5, "a"), token(6, "b")], None)
        self.lateness: list[float] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = OpenAIServer(self.generation, frontend, self.members, None, 16 << 20,  # type: ignore[arg-type]
                                       guard=guard, limits=RequestLimits(), deadlines=deadlines)
            self.port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0, False))
            self.probe = self.loop.create_task(self._probe())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(30)

    async def _probe(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lateness.append(time.perf_counter() - t - 0.001)

    def worst_stall_s(self) -> float:
        worst, self.lateness = max(self.lateness, default=0.0), []
        return worst

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        answer = json.loads(r.read() or b"{}")
        conn.close()
        return r.status, answer

    def answers(self) -> None:
        """A real request is served."""
        status, answer = self.call("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and answer["choices"][0]["text"] == "ab", answer

    def close(self) -> None:
        async def stop() -> None:
            self.probe.cancel()
            await self.server.stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served(tiny_llama_dir: str) -> Iterator[Served]:
    s = Served(Frontend(tiny_llama_dir))
    yield s
    s.close()


def raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed_within(sock: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after `timeout_s`."""
    sock.settimeout(min(0.2, timeout_s))
    got, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def test_sixteen_mib_of_messages_is_refused_before_it_is_parsed(served: Served) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 570_000}, separators=(",", ":")).encode()
    assert len(body) > 15 << 20
    t0 = time.perf_counter()
    status, answer = served.call("POST", "/v1/chat/completions", body)
    assert status == 400 and "more than 2048 messages (--max-messages)" in answer["error"]["message"]
    assert time.perf_counter() - t0 < 5
    status, answer = served.call("POST", "/tokenize", body)
    assert status == 400 and answer["error"]["param"] == "messages"
    assert served.worst_stall_s() < STALL_BOUND_S
    served.answers()


def test_a_huge_tokenize_and_a_long_name_are_400s(served: Served) -> None:
    status, answer = served.call("POST", "/tokenize", {"prompt": "word " * 3_000_000})
    assert status == 400 and "the model's context is 64 tokens" in answer["error"]["message"]
    status, answer = served.call("POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi", "name": "n" * 65}]})
    assert status == 400 and "messages[0].name has 65 characters; at most 64" in answer["error"]["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    status, answer = served.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                  "tools": tools})
    assert status == 400 and "tools holds more than 128 tools (--max-tools)" in answer["error"]["message"]
    status, answer = served.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                  "chat_template_kwargs": {"k": "v" * 20_000}})
    assert status == 400 and answer["error"]["param"] == "chat_template_kwargs"
    assert served.worst_stall_s() < STALL_BOUND_S


def _refusal_s(port: int, path: str, body: bytes) -> tuple[float, bytes]:
    """Seconds from the body's last byte sent to the answer's first byte, and the answer."""
    with raw(port) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        t0 = time.perf_counter()
        sock.settimeout(60)
        first = sock.recv(65536)
        took = time.perf_counter() - t0
        got = first + (closed_within(sock, 10) or b"")
    return took, got


REFUSAL_BOUND_S = 0.5
"""Loose, for a loaded CI machine: these cost 1-6 s of the loop before (1.0 s for a million stop
strings, 2.2 s for escaped "role" keys, 6.3 s for a million logit_bias entries); the measured
times (milliseconds) are benchmarks/hostile/front_hostile.py's."""

FLOODS = [  # (path, body, what the 400 says): each a list or map far past its limit, 4-16 MiB
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1_000_000)}},
     "logit_bias holds more than 1024 tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 1_200_000}, "stop holds more than 16 stop strings"),
    ("/v1/completions", {"prompt": [[1]] * 1_200_000}, "prompt holds more than 128 prompts"),
    ("/v1/completions", {"prompt": list(range(2_000_000))}, "prompt holds more than 64 token ids"),
    ("/v1/chat/completions", {"messages": [{"r\\u006fle": "user", "content": ""}] * 400_000},
     "messages holds more than 2048 messages (--max-messages)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 500_000}]},
     "messages.*.content holds more than 2048 content parts (--max-messages)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                                  "enum": list(range(1_500_000))}}}}, "holds more than 4096 numbers"),
    ("/detokenize", {"tokens": [5] * 5_000_000}, "tokens holds more than 64 token ids"),
    ("/tokenize", {"messages": [{"r\\u006fle": "user", "content": ""}] * 400_000}, "more than 2048 messages"),
]


@pytest.mark.parametrize("path,body,message", FLOODS, ids=[f"{p}-{m.split()[0]}" for p, _, m in FLOODS])
def test_a_flood_in_any_list_or_map_is_refused_before_it_is_parsed(served: Served, path: str, body: Any,
                                                                    message: str) -> None:
    data = json.dumps(body, separators=(",", ":")).encode().replace(b"\\\\u006f", b"\\u006f")
    assert 4 << 20 < len(data) < 16 << 20  # under the body limit: the scan, not the size, refuses it
    served.worst_stall_s()
    took, answer = _refusal_s(served.port, path, data)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert message in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert took < REFUSAL_BOUND_S
    assert served.worst_stall_s() < REFUSAL_BOUND_S / 2  # a stream on the loop would have gone on
    served.answers()


def test_slowloris_on_the_head_and_on_the_body_is_closed_at_its_deadline(served: Served) -> None:
    head = raw(served.port)
    t0 = time.monotonic()
    head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    sent = 0
    try:
        for _ in range(20):  # a header byte every 0.2 s: never a whole head
            head.sendall(b"X")
            sent += 1
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert closed_within(head, 3.0) is not None and time.monotonic() - t0 < DEADLINES.header_timeout_s + 3
    assert sent < 20
    body = raw(served.port)
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    answer = closed_within(body, DEADLINES.body_timeout_s + 3)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert b"the body did not arrive within 1 s" in answer
    served.answers()


def test_ten_thousand_idle_connections_are_capped_and_a_real_client_is_served(served: Served) -> None:
    idle = []
    try:
        for i in range(10_000):
            idle.append(raw(served.port))
            if i % 2000 == 1999:
                served.answers()  # served while the flood holds every idle slot
        guard = served.server.connections
        assert guard.num_idle <= DEADLINES.max_idle_connections

        def closed() -> int:  # evicted for a newer one, or (a flood slowed by a loaded host) at the header deadline
            return guard.num_evicted + guard.num_timed_out

        deadline = time.monotonic() + 20  # the last connects may still be in the server's accept queue
        while closed() < 10_000 - DEADLINES.max_idle_connections - 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert closed() >= 10_000 - DEADLINES.max_idle_connections - 50
        assert guard.num_evicted >= 5_000  # most made room for newer ones before their deadline
        served.answers()
        answered = sum(closed_within(s, 0.01) is not None for s in idle[-100:])  # the newest still wait
        assert answered < 100
        deadline = time.monotonic() + DEADLINES.header_timeout_s + 10
        while guard.num_idle:  # the rest closed at their deadline
            assert time.monotonic() < deadline, guard.num_idle
            time.sleep(0.1)
        assert guard.num_timed_out > 0
    finally:
        for s in idle:
            s.close()
    assert served.worst_stall_s() < STALL_BOUND_S
    served.answers()


def _third_body_past_two_held(served: Served) -> tuple[list[socket.socket], bytes]:
    """Two connections each declare an 8 MiB body and send one byte of it; once the server
    holds both, a third declares another: its connections, and what the third was told."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{" % (8 << 20))
    slow = [raw(served.port) for _ in range(3)]
    for s in slow[:2]:
        s.sendall(head)
    deadline = time.monotonic() + 20
    while served.server.bodies.num_bytes < 16 << 20:  # both bodies being read (a loaded machine is slow)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    slow[2].sendall(head)
    return slow, closed_within(slow[2], 3.0) or b""


def test_bodies_past_the_bytes_in_flight_are_told_to_retry(tiny_llama_dir: str) -> None:
    served = Served(Frontend(tiny_llama_dir), deadlines=dataclasses.replace(DEADLINES, body_timeout_s=5.0,
                                                                            max_body_bytes_in_flight=20 << 20))
    try:
        slow, answer = _third_body_past_two_held(served)  # 16 MiB of the 20 held, and not sent
        deadline = time.monotonic() + 20
        assert answer.startswith(b"HTTP/1.1 503") and b"request bodies already; retry" in answer, answer
        assert b"Retry-After: 1" in answer
        for s in slow[:2]:
            s.close()
        while served.server.bodies.num_bytes:  # the bytes were given back
            assert time.monotonic() < deadline
            time.sleep(0.05)
        served.answers()
    finally:
        served.close()


def test_one_client_holds_at_most_its_share_of_the_bytes_in_flight(tiny_llama_dir: str) -> None:
    """16 slow clients declaring 16 MiB each once held the whole budget; now one address is
    told 429 past its share, and another is still read."""
    served = Served(Frontend(tiny_llama_dir), deadlines=dataclasses.replace(
        DEADLINES, body_timeout_s=5.0, max_body_bytes_in_flight=256 << 20, max_body_bytes_per_client=16 << 20))
    try:
        slow, answer = _third_body_past_two_held(served)  # 16 MiB held from 127.0.0.1
        deadline = time.monotonic() + 20
        assert answer.startswith(b"HTTP/1.1 429") and b"this client is sending" in answer, answer
        assert b"Retry-After: 1" in answer
        other = socket.create_connection(("127.0.0.1", served.port), timeout=10, source_address=("127.0.0.2", 0))
        body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
        other.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        assert (closed_within(other, 10.0) or b"").startswith(b"HTTP/1.1 200")  # another address is served
        other.close()
        for s in slow[:2]:
            s.close()
        while served.server.bodies.num_bytes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert served.server.bodies._by_client == {}  # every byte given back, per client too
    finally:
        served.close()
