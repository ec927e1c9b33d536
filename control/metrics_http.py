"""`/metrics` for Prometheus, served on the process's own asyncio loop (torch-free).

Each router and worker process owns one `CollectorRegistry` (never the global one: tests
run several components in one process) and serves it here. Serving on the event loop,
not prometheus_client's server thread, means a collector reads the component's asyncio-side
state (admission queue, flow counters) without locks; engine-side numbers come in through
`refresh`, an async callable awaited before each scrape (the worker asks its engine thread
for a snapshot, bounded by a timeout). Counters and histograms observed on other threads
are prometheus_client's own, which lock.

Only `GET /metrics` (and `/`) answer 200; anything else 404, a malformed request 400. A
request must arrive within `READ_TIMEOUT_S` and fit in `MAX_REQUEST_BYTES`. Bound beyond
loopback, a listener given a `token` (control/auth.py `metrics_token` of the cluster secret)
answers only a request showing `Authorization: Bearer <token>`; others get 401.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from control.auth import is_loopback

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None = None,
                 token: str | None = None) -> None:
        self.registry = registry
        self.refresh = refresh
        self.token = token
        self._required: bytes | None = None
        """The Authorization header a scrape must show (None: any scrape is answered)."""
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listens on host:port (0: a free port); returns the port."""
        self._required = b"bearer " + self.token.encode() if self.token and not is_loopback(host) else None
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            status, body, kind = await self._answer(head)
            extra = b"WWW-Authenticate: Bearer\r\n" if status.startswith("401") else b""
            writer.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n"
                         % (status.encode(), kind.encode(), len(body), extra) + body)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # the scraper went away or sent garbage: nothing to answer
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return "400 Bad Request", b"not an HTTP request\n", "text/plain"
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET" or path not in (b"/metrics", b"/"):
            return "404 Not Found", b"only GET /metrics is served here\n", "text/plain"
        if self._required is not None and not _shows(head, self._required):
            return "401 Unauthorized", b"this /metrics needs the cluster's scrape token (splitserve metrics-targets " \
                b"--credentials-file)\n", "text/plain"
        if self.refresh is not None:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - serve what is there; the gauges say when they were read
                logger.warning("metrics: refreshing before a scrape failed", exc_info=True)
        return "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST


def _shows(head: bytes, authorization: bytes) -> bool:
    """Whether the request's Authorization header is `authorization` (scheme case-blind)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, credentials = value.strip().partition(b" ")
            return hmac.compare_digest(scheme.lower() + b" " + credentials.strip(), authorization)
    return False
