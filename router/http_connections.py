"""The HTTP API's connections, bounded: a client that connects and says nothing, or trickles
its request's head, holds a connection only so long, and a flood of them cannot crowd out
clients that send requests.

    connection made --(over `max_connections`: 503 Retry-After, closed)--> idle
    idle (no request in progress: new, or between keep-alive requests)
        --(request head parsed: `busy`)--> busy --(response sent: `idle`)--> idle
        --(`header_timeout_s` idle: closed)   --(over `max_idle`: the longest idle closed)

A real client sends its request as it connects, so it is idle for milliseconds; a flood of
silent connections churns through the idle slots. A request's body is read within its own
deadline (408 past it) and within a budget of body bytes in flight (`BodyReader`); the
numbers are `HttpDeadlines` (router/config.py). `ConnectionGuard` hooks aiohttp's
`web.Server.connection_made/connection_lost`, the two calls its protocol makes as a
connection opens and closes. Torch-free.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from router.attempt import RequestFailed


_BUSY = b'{"error": {"message": "the server holds too many connections; retry", "type": ' \
        b'"service_unavailable_error", "param": null, "code": 503}}'
OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))
"""What a connection past `max_connections` is told before it is closed."""


class ConnectionGuard:
    def __init__(self, max_connections: int, max_idle: int, header_timeout_s: float) -> None:
        if max_connections < 1 or max_idle < 1 or header_timeout_s <= 0:
            raise ValueError("max_connections and max_idle must be at least 1, header_timeout_s positive")
        self.max_connections, self.max_idle, self.header_timeout_s = max_connections, max_idle, header_timeout_s
        self.num_open = 0
        self._idle: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()
        """Idle connections' transports, longest idle first, with the timer that closes each."""
        self.num_refused = self.num_evicted = self.num_timed_out = 0

    def install(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.num_open += 1
            if self.num_open > self.max_connections:
                self.num_refused += 1
                transport.write(OVERLOADED)
                transport.close()
                return
            self.idle(transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.num_open -= 1
            transport = handler.transport
            if transport is not None:
                self._forget(transport)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """A request's head has arrived: its connection is busy until the response is out."""
        transport = request.transport
        if transport is not None:
            self.busy(transport)
        try:
            return await handler(request)
        finally:
            if transport is not None and request.keep_alive:
                self.idle(transport)

    def idle(self, transport: Any) -> None:
        """The connection waits for a request's head: closed if none completes in time."""
        self._forget(transport)
        if transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        self._idle[transport] = loop.call_later(self.header_timeout_s, self._expire, transport)
        while len(self._idle) > self.max_idle:
            oldest, timer = self._idle.popitem(last=False)
            timer.cancel()
            self.num_evicted += 1
            oldest.abort()

    def busy(self, transport: Any) -> None:
        """A request's head arrived: its connection is no longer idle."""
        self._forget(transport)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def counts(self) -> dict[str, int]:
        """For the router's metrics: connections idle now, and those closed so far by why."""
        return {"num_idle": self.num_idle, "num_evicted": self.num_evicted, "num_timed_out": self.num_timed_out}

    def _expire(self, transport: Any) -> None:
        if self._idle.pop(transport, None) is not None:
            self.num_timed_out += 1
            transport.abort()

    def _forget(self, transport: Any) -> None:
        timer = self._idle.pop(transport, None)
        if timer is not None:
            timer.cancel()


class BodyReader:
    """Request bodies, read within their deadline and within a budget of bytes in flight."""

    def __init__(self, max_request_bytes: int, max_in_flight: int, timeout_s: float,
                 max_per_client: int | None = None) -> None:
        self.max_request_bytes, self.max_in_flight, self.timeout_s = max_request_bytes, max_in_flight, timeout_s
        self.max_per_client = max_in_flight if max_per_client is None else max_per_client
        self.num_bytes = 0
        """Bytes of bodies being read now (each counted at its Content-Length)."""
        self._by_client: dict[str, int] = {}
        """Of those, by client address (an entry while it reads)."""

    async def read(self, request: web.Request) -> bytes:
        size = request.content_length
        if size is not None and size > self.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_request_bytes, actual_size=size)
        size = size or self.max_request_bytes
        client = request.remote or ""
        mine = self._by_client.get(client, 0)
        if mine + size > self.max_per_client:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this client is sending {mine} bytes of request "
                                "bodies already; retry when they have arrived", 1.0)
        if self.num_bytes + size > self.max_in_flight:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"the server is reading {self.num_bytes} bytes of "
                                "request bodies already; retry", 1.0)
        self.num_bytes += size
        self._by_client[client] = mine + size
        try:
            return await asyncio.wait_for(request.read(), self.timeout_s)
        except TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"the body did not arrive within {self.timeout_s:g} s") from None
        finally:
            self.num_bytes -= size
            if (left := self._by_client[client] - size) > 0:
                self._by_client[client] = left
            else:
                del self._by_client[client]
