"""What routers and the controller publish in the registry, typed (msgspec) as heartbeats are.

    RouterService.stats_now (router/service.py, every second) --`to_wire`, sealed-->
        {ns}:router:{router_id} --RegistryReader.router_stats, `router_stats_from_wire`-->
        the autoscaler's gauge (control/pool_gauge.py), `splitserve status`
    Controller.status (every tick) --`to_wire`--> {ns}:controller --`controller_status_from_wire`-->
        `splitserve status`, `metrics-targets`

A field of the wrong type, or bytes that are no such map, is a `BadEntry` naming the fault
(the reader skips and counts the entry); fields a newer version adds are ignored.
"""
from __future__ import annotations

from typing import Any

import msgspec

from control.heartbeat import BadEntry


class RouterStats(msgspec.Struct, kw_only=True, frozen=True):
    """One router replica's books, as `splitserve status` shows them."""

    router_id: str
    address: str
    """Its gRPC host:port."""
    http_address: str = ""
    metrics_address: str = ""
    pid: int = 0
    # requests (router/servicer.py Generation.stats)
    num_requests: int = 0
    num_refused: int = 0
    num_invalid: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # tries (router/flow.py RequestFlow.stats)
    num_local_prefill: int = 0
    num_remote_prefill: int = 0
    num_retries: int = 0
    num_busy_waits: int = 0
    num_kv_waits: int = 0
    # admission (router/admission.py)
    num_admitted: int = 0
    num_queued: int = 0
    inflight_tokens: float = 0.0
    """Tokens the admitted requests are charged."""
    used_tokens: float = 0.0
    budget_tokens: float = 0.0
    forecast_wait_s: float = 0.0
    """The longest a queued request is forecast to wait for admission."""
    queued_by_priority: dict[str, int] = {}
    tenant_tokens: dict[str, int] = {}
    refusals: dict[str, int] = {}
    forecast_scale: float | None = None
    itl_p50_ms: float | None = None
    # the registry as this router sees it (router/feed.py, router/members.py)
    redis_healthy: bool = True
    members: list[str] = []
    serving: dict[str, list[str]] = {}
    down_workers: list[str] = []
    late_heartbeats_kept: int = 0
    bad_registry_entries: int = 0
    refused_addresses: int = 0
    heartbeat_at: dict[str, float] = {}
    active: dict[str, int] = {}
    """Requests this router runs on each worker."""
    index_events: int = 0
    index_gaps: int = 0
    index_blocks: dict[str, int] = {}
    store_blocks: dict[str, int] = {}
    rss_mib: float = 0.0


class ControllerStatus(msgspec.Struct, kw_only=True, frozen=True):
    """The controller's pools and its last actions."""

    targets: dict[str, int]
    """The autoscaler's (or the configured) worker count per role."""
    workers: dict[str, str]
    """Worker id -> its state."""
    dead: list[str] = []
    drains: list[dict[str, Any]] = []
    """The last finished drains' reports."""
    num_drains: int = 0
    actions: list[str] = []
    decision: str | None = None
    """The autoscaler's last reason."""
    autoscale: bool = False
    metrics_address: str = ""
    pid: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_ROUTER = msgspec.msgpack.Decoder(RouterStats)
_CONTROLLER = msgspec.msgpack.Decoder(ControllerStatus)


def to_wire(entry: RouterStats | ControllerStatus) -> bytes:
    return _ENCODER.encode(entry)


def router_stats_from_wire(data: bytes) -> RouterStats:
    return _decode(_ROUTER, data, "a router's stats")


def controller_status_from_wire(data: bytes) -> ControllerStatus:
    return _decode(_CONTROLLER, data, "the controller's status")


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str):  # type: ignore[no-untyped-def]
    if not isinstance(data, bytes):
        raise BadEntry(f"{what} is msgpack bytes, not {type(data).__name__}")
    try:
        return decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadEntry(f"{what}: {e}") from None
