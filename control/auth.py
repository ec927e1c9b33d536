"""Proof of the cluster secret on internal endpoints (torch-free).

Workers' gRPC services and kvfabric listeners serve only peers of their own cluster: a
caller shows `cluster_token(secret)` (an HMAC of the secret, so the secret itself never
travels) in the `x-splitserve-token` call metadata or in the kvfabric hello. Health
checks stay open (a load balancer has no secret).
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_METADATA = "x-splitserve-token"
_OPEN_PREFIX = "/grpc.health."


def cluster_token(secret: bytes) -> str:
    return hmac.new(secret, b"splitserve internal endpoint v1", hashlib.sha256).hexdigest()


def token_matches(shown: object, token: str) -> bool:
    return isinstance(shown, str) and hmac.compare_digest(shown.encode(), token.encode())


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses UNAUTHENTICATED every call (but health checks) that does not show the token."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(_OPEN_PREFIX):
            return await continuation(handler_call_details)
        shown = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA)
        if token_matches(shown, self.token):
            return await continuation(handler_call_details)
        return grpc.unary_stream_rpc_method_handler(_refuse)


async def _refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "this is a splitserve worker: only its cluster's routers may call it (no or wrong "
                        f"{TOKEN_METADATA}: give the caller the cluster secret)")


def check_private(path: Path, what: str) -> None:
    """A secret file must be readable by its owner alone (as ssh insists)."""
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{what} {path} is readable by others (mode {mode:o}); chmod 600 it")
