"""What the HTTP API checks before a handler reads a byte of the body, in this order:

    Host header   a router bound to loopback answers only loopback names (localhost,
                  127.0.0.1, [::1]): a web page whose name rebinds to 127.0.0.1 reads
                  nothing; bound wider, the `allowed_hosts` list where one is given    -> 421
    API key       `Authorization: Bearer KEY` when keys are set (router/api_keys.py), but
                  on `open_paths` (/health: load balancers have no key)               -> 401
    Content-Type  a POST is `application/json` (a web page's form or text/plain POST,
                  which browsers send without asking, is refused)                      -> 415

Each refusal is an error in OpenAI's shape (Anthropic's on /v1/messages: router/http_api.py).
The key's identity (its tenant) is left on the request as `request[IDENTITY]`. Torch-free.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from control.auth import LOOPBACK_NAMES, is_loopback
from router.api_keys import ApiKeys, Identity, Unauthenticated
from router.http_errors import error

IDENTITY = web.RequestKey("identity", Identity)
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
"""Anthropic's routes: a key may come as `x-api-key`, and errors take Anthropic's shape."""


@dataclass(frozen=True)
class HttpGuard:
    api_keys: ApiKeys | None = None
    open_paths: tuple[str, ...] = ("/health",)
    allowed_hosts: tuple[str, ...] | None = None
    """Host names (no port) requests may name; None: any."""

    @classmethod
    def for_bind(cls, host: str, api_keys: ApiKeys | None, open_paths: tuple[str, ...],
                 allowed_hosts: tuple[str, ...]) -> HttpGuard:
        """Loopback binds answer loopback names only (and any `allowed_hosts`); wider binds
        the `allowed_hosts` when given, else any name."""
        allowed = tuple(h.lower() for h in allowed_hosts)
        if is_loopback(host):
            return cls(api_keys, open_paths, (*LOOPBACK_NAMES, *allowed))
        return cls(api_keys, open_paths, allowed or None)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if self.allowed_hosts is not None and _host_name(request.host) not in self.allowed_hosts:
            return error(421, f"this server does not answer to the host name {request.host[:100]!r}",
                         code="misdirected_request")
        if self.api_keys is not None and request.path not in self.open_paths:
            try:
                request[IDENTITY] = self.api_keys.check(_authorization(request))
            except Unauthenticated as e:
                response = error(401, str(e), code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        if request.method == "POST" and request.content_type != "application/json":
            return error(415, f"the body must be JSON sent as 'Content-Type: application/json', not "
                              f"{request.content_type[:100]!r}", code="unsupported_media_type")
        return await handler(request)


def _authorization(request: web.Request) -> str | None:
    """The request's `Authorization`; on Anthropic's /v1/messages routes, `x-api-key: KEY` as Anthropic's
    clients send it, when there is no `Authorization`."""
    value = request.headers.get("Authorization")
    if value is None and request.path in ANTHROPIC_PATHS and (key := request.headers.get("x-api-key")):
        return "Bearer " + key
    return value


def identity(request: web.Request) -> Identity | None:
    return request.get(IDENTITY)


def _host_name(host: str) -> str:
    """The name of a Host header value, without its port (IPv6 literals without brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
