"""Proof of the cluster secret on internal endpoints (torch-free).

Workers' gRPC services and kvfabric listeners serve only peers of their own cluster: a
caller shows `cluster_token(secret)` (an HMAC of the secret, so the secret itself never
travels) in the `x-splitserve-token` call metadata or in the kvfabric hello. Health
checks stay open (a load balancer has no secret).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_METADATA = "x-splitserve-token"
_OPEN_PREFIX = "/grpc.health."


def cluster_token(secret: bytes) -> str:
    return hmac.new(secret, b"splitserve internal endpoint v1", hashlib.sha256).hexdigest()


def metrics_token(secret: bytes) -> str:
    """The bearer token a `/metrics` listener bound beyond loopback asks its scraper for
    (`splitserve metrics-targets --credentials-file` writes it for Prometheus)."""
    return hmac.new(secret, b"splitserve metrics v1", hashlib.sha256).hexdigest()


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SEAL_PREFIX = b"SSR1"
_SEAL_BYTES = len(SEAL_PREFIX) + 32


def registry_key(secret: bytes) -> bytes:
    """The key that seals a cluster's registry entries: its own derivation of the secret (the
    internal endpoints' token travels in call metadata; this key never leaves a process)."""
    return hmac.new(secret, b"splitserve registry v1", hashlib.sha256).digest()


def seal(key: bytes, redis_key: str, payload: bytes) -> bytes:
    """`payload` as stored under `redis_key`: an HMAC of both in front, so an entry written by
    anyone without the secret, or copied under another key, is told apart."""
    return SEAL_PREFIX + hmac.new(key, redis_key.encode() + b"\0" + payload, hashlib.sha256).digest() + payload


class Unsealed(ValueError):
    """A registry entry that is not sealed with this cluster's key for its own Redis key."""


def unseal(key: bytes | None, redis_key: str, data: bytes) -> bytes:
    """The payload of a sealed entry; with `key` None (a reader without the secret: `status`)
    the seal is taken off unchecked. Raises Unsealed."""
    if not data.startswith(SEAL_PREFIX) or len(data) < _SEAL_BYTES:
        raise Unsealed("the entry is not sealed with the cluster's secret")
    payload = data[_SEAL_BYTES:]
    if key is not None and not hmac.compare_digest(data[:_SEAL_BYTES], seal(key, redis_key, payload)[:_SEAL_BYTES]):
        raise Unsealed("the entry's seal is not the cluster's (another secret, or another key's entry)")
    return payload


def opened(key: bytes | None, redis_key: str, data: bytes) -> bytes:
    """A registry entry's payload: its seal checked with `key`; without one (a reader without
    the secret), the seal taken off unchecked, and an unsealed entry shown as it is. Raises Unsealed."""
    if key is None and not data.startswith(SEAL_PREFIX):
        return data
    return unseal(key, redis_key, data)


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
