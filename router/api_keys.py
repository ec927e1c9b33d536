"""API keys: who may call a router, and as which tenant.

    --api-key KEY[:TENANT] (repeatable), --api-key-file FILE (a KEY[:TENANT] a line, # comments),
    $SPLITSERVE_API_KEY (KEY[:TENANT], comma-separated)  -->  ApiKeys (SHA-256 digests only)
    HTTP `Authorization: Bearer KEY` / gRPC metadata `authorization: Bearer KEY`
        --(digest, compared with every key's in constant time)--> the key's tenant, or refused

A key that names a tenant makes every request it signs that tenant's: the body's `user` /
`tenant` is not read, so quotas and fair shares cannot be dodged by renaming. A key without
a tenant leaves the body's. The router holds digests, never the keys: a config or a log that
shows it shows nothing to sign with. Torch-free.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from control.auth import check_private

logger = logging.getLogger(__name__)

ENV = "SPLITSERVE_API_KEY"
KEY_PATTERN = re.compile(r"[\x21-\x7e]{8,512}")
"""A key: 8 to 512 printable ASCII characters, no spaces (those of a header value)."""
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,128}")
MISSING = "this server requires an API key: send it as 'Authorization: Bearer KEY'"
WRONG = "the API key is not valid for this server"
OPEN_GRPC_PREFIX = "/grpc.health."
"""gRPC methods open without a key (health checks: load balancers have none)."""


class Unauthenticated(Exception):
    """No key, or a key this router does not know (401 / UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Identity:
    tenant: str | None
    """The tenant the key names; None: the request's own."""
    owner: str = ""
    """Whose stored objects (stored responses) the request sees: the key's tenant, else the key
    itself (a digest of it)."""


@dataclass(frozen=True)
class ApiKeys:
    digests: tuple[tuple[bytes, str | None], ...]
    """(SHA-256 of a key, the tenant it names or None), one per key."""

    def __post_init__(self) -> None:
        if not self.digests:
            raise ValueError("ApiKeys needs at least one key")

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.digests)} keys)"

    @classmethod
    def parse(cls, specs: Iterable[str]) -> ApiKeys:
        """From KEY or KEY:TENANT entries (a tenant is the text after the last colon)."""
        out = []
        for i, spec in enumerate(specs):
            key, _, tenant = spec.rpartition(":") if ":" in spec else (spec, "", "")
            if not KEY_PATTERN.fullmatch(key):
                raise ValueError(f"API key {i + 1} (of those given) is not 8 to 512 printable ASCII characters "
                                 "without spaces")
            if tenant and not TENANT_PATTERN.fullmatch(tenant):
                raise ValueError(f"an API key's tenant must match {TENANT_PATTERN.pattern}, got {tenant[:40]!r}")
            if tenant:  # said, not silent: a key with a colon in it reads as KEY:TENANT
                logger.info("API key %d (of those given) is the %d characters before its last colon, for tenant %r",
                            i + 1, len(key), tenant)
            out.append((_digest(key), tenant or None))
        return cls(tuple(out))

    def check(self, authorization: str | None) -> Identity:
        """The identity an `Authorization` value (`Bearer KEY`) carries; Unauthenticated if none."""
        if not authorization:
            raise Unauthenticated(MISSING)
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(MISSING)
        presented, found, tenant = _digest(key.strip()), False, None
        for digest, named in self.digests:  # every key compared, whichever matches
            same = hmac.compare_digest(digest, presented)
            found |= same
            tenant = named if same else tenant
        if not found:
            raise Unauthenticated(WRONG)
        return Identity(tenant, tenant or "key:" + presented.hex()[:32])


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load(flags: Iterable[str], file: str | None, environ: dict[str, str] | None = None) -> ApiKeys | None:
    """The keys from the flags, the file and $SPLITSERVE_API_KEY together; None when none is given."""
    env = (os.environ if environ is None else environ).get(ENV, "")
    specs = [*flags, *(s.strip() for s in env.split(",") if s.strip())]
    if file is not None:
        path = Path(file)
        check_private(path, "--api-key-file")
        specs += [line.strip() for line in path.read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    return ApiKeys.parse(specs) if specs else None


class KeyCheck(grpc.aio.ServerInterceptor):
    """The gRPC door: every call but health checks shows a key in its `authorization`
    metadata (`Bearer KEY`), else it ends UNAUTHENTICATED before its handler runs. Methods in
    `own_check` check it in their handler, where its tenant is read (checked once, not twice)."""

    def __init__(self, keys: ApiKeys, own_check: frozenset[str] = frozenset()) -> None:
        self.keys = keys
        self.own_check = own_check

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_GRPC_PREFIX) or method in self.own_check:
            return handler
        try:
            self.keys.check(authorization(handler_call_details.invocation_metadata))
        except Unauthenticated as e:
            return _refusal(handler, str(e))
        return handler


def authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The `authorization` value of gRPC call metadata."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


def _refusal(handler: Any, message: str) -> Any:
    """A handler of the refused one's kind that ends the call UNAUTHENTICATED."""
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (an async generator: abort raises first)

    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[kind](streaming if kind[1] else unary, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
