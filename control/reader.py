"""Async reads of the registry for routers and `splitserve status`; every call is bounded by the client's timeouts.

Keys under one namespace `ns` (msgpack values, never pickle):
  {ns}:hb:{worker_id}      a worker's `Heartbeat`; expires after its TTL, so a missing key is a gone worker
  {ns}:kv:{worker_id}      Redis Stream of the worker's KV events (field `e`: `event_to_bytes`)
  {ns}:router:{router_id}  a router's `RouterStats` (queues, prefix hit rate); expires like a heartbeat
  {ns}:controller          the controller's `ControllerStatus` (control/router_stats.py)
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis.asyncio

from control.auth import Unsealed, opened, seal
from control.heartbeat import (BadEntry, Heartbeat, controller_key, hb_key, kv_key, router_key, store_entry,
                               store_key)
from control.kv_events import event_from_bytes
from control.router_stats import (ControllerStatus, RouterStats, controller_status_from_wire, router_stats_from_wire,
                                  to_wire)
from control.redis_url import readable
from engine.core.block_pool import KVEvent

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class StreamCursor:
    """Where a reader is in each worker's KV stream."""

    last_ids: dict[str, str] = field(default_factory=dict)


class RegistryReader:
    """Async reads for routers and `splitserve status`; every call is bounded by the client's timeouts."""

    def __init__(self, redis_url: str, namespace: str, timeout_s: float = 2.0, seal_key: bytes | None = None) -> None:
        """`seal_key`: the cluster's registry key (`control.auth.registry_key`): heartbeats and
        KV store entries count only sealed with it for their own key (anyone who can write the
        Redis could otherwise steer routing); None, for a reader without the secret (`status`):
        shown unchecked."""
        self.client = redis.asyncio.Redis.from_url(readable(redis_url), socket_timeout=timeout_s,
                                                   socket_connect_timeout=timeout_s)
        self.ns = namespace
        self.seal_key = seal_key
        self.num_bad_entries = 0
        """Malformed heartbeats and KV events skipped (each key's logged once)."""
        self._warned: set[object] = set()

    async def heartbeats(self) -> dict[str, Heartbeat]:
        keys = [k async for k in self.client.scan_iter(match=hb_key(self.ns, "*"), count=500)]
        if not keys:
            return {}
        values = await self.client.mget(keys)
        beats = [b for k, v in zip(keys, values, strict=True) if v is not None and (b := self._parse(
                 k, v, lambda data, k=k: _beat_of(_text(k)[len(hb_key(self.ns, "")):], self._opened(k, data))))
                 is not None]
        return {b.worker_id: b for b in beats}

    async def read_events(self, cursor: StreamCursor, worker_ids: list[str], block_ms: int) -> list[tuple[str, KVEvent]]:
        """KV events after the cursor for these workers (waits up to block_ms for the first)."""
        if not worker_ids:
            return []
        streams = {kv_key(self.ns, w): cursor.last_ids.get(w, "0-0") for w in worker_ids}
        reply = await self.client.xread(streams, count=1000, block=block_ms)
        out: list[tuple[str, KVEvent]] = []
        prefix = len(kv_key(self.ns, ""))
        for stream, entries in reply or []:
            worker = (stream.decode() if isinstance(stream, bytes) else stream)[prefix:]
            for entry_id, data in entries:
                cursor.last_ids[worker] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                ev = self._parse(stream, data.get(b"e"),
                                 lambda d, s=stream: event_from_bytes(self._opened(s, d)))  # type: ignore[misc]
                if ev is not None:
                    out.append((worker, ev))
        return out

    def _opened(self, key: object, data: object) -> bytes:
        """An entry's payload: its seal checked (with a key) or taken off (without one)."""
        if not isinstance(data, bytes):
            raise BadEntry(f"a registry entry is bytes, not {type(data).__name__}")
        try:
            return opened(self.seal_key, _text(key), data)
        except Unsealed as e:
            raise BadEntry(str(e)) from None

    def _parse(self, key: object, data: object, parse: Callable[[object], T]) -> T | None:
        try:
            return parse(data)
        except BadEntry as e:
            self.num_bad_entries += 1
            if key not in self._warned and len(self._warned) < 10_000:  # once a key: a bad one is re-read each poll
                self._warned.add(key)
                logger.warning("registry: skipping a malformed entry in %r: %s", key, e)
            return None

    async def store_entries(self) -> dict[str, str]:
        """The registered KV stores (kvstore/host.py): store id -> gRPC address."""
        keys = [k async for k in self.client.scan_iter(match=store_key(self.ns, "*"), count=100)]
        values = await self.client.mget(keys) if keys else []
        entries = [e for k, v in zip(keys, values, strict=True) if v is not None
                   and (e := self._parse(k, v, lambda data, k=k: _store_entry(self._opened(k, data)))) is not None]
        return dict(entries)

    async def set_router_stats(self, router_id: str, stats: RouterStats, ttl_s: float) -> None:
        """A router's stats, sealed with the key this reader was given (if any)."""
        key, data = router_key(self.ns, router_id), to_wire(stats)
        await self.client.set(key, data if self.seal_key is None else seal(self.seal_key, key, data),
                              px=int(ttl_s * 1000))

    async def router_stats(self) -> dict[str, RouterStats]:
        """Routers' stats by router id: with a key, only those it sealed (others are skipped and counted)."""
        keys = [k async for k in self.client.scan_iter(match=router_key(self.ns, "*"), count=100)]
        values = await self.client.mget(keys) if keys else []
        prefix = len(router_key(self.ns, ""))
        stats = ((_text(k)[prefix:], self._parse(k, v, lambda data, k=k: router_stats_from_wire(self._opened(k, data))))
                 for k, v in zip(keys, values, strict=True) if v is not None)
        return {r: s for r, s in stats if s is not None}

    async def close(self) -> None:
        await self.client.aclose()


def _store_entry(data: object) -> tuple[str, str]:
    """A KV store's entry (control/heartbeat.py `store_entry`): (store id, address); BadEntry else."""
    if not isinstance(data, (bytes, str)):
        raise BadEntry("a KV store's entry is JSON text")
    try:
        entry = store_entry(data)
    except ValueError as e:
        raise BadEntry(str(e)) from None
    return entry.store_id, entry.address


ClusterState = tuple[dict[str, Heartbeat], dict[str, RouterStats], ControllerStatus | None]
"""Heartbeats by worker, router stats by router, and the controller's status (None: none)."""


async def read_cluster(redis_url: str, namespace: str) -> ClusterState:
    """One read of a cluster's registry for the CLI (`status`, `metrics-targets`); raises on a Redis failure."""
    reader = RegistryReader(redis_url, namespace)
    try:
        raw = await reader.client.get(controller_key(namespace))
        try:
            controller = controller_status_from_wire(raw) if raw else None
        except BadEntry as e:
            logger.warning("registry: the controller's status is malformed: %s", e)
            controller = None
        return await reader.heartbeats(), await reader.router_stats(), controller
    finally:
        await reader.close()


def _text(key: object) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)


def _beat_of(worker_id: str, data: object) -> Heartbeat:
    """A heartbeat stored under its worker's own key: one naming another worker (written to
    shadow it, or to outvote the real workers' model facts) is a bad entry."""
    beat = Heartbeat.from_wire(data)
    if beat.worker_id != worker_id:
        raise BadEntry(f"the heartbeat under {worker_id!r} names worker {beat.worker_id[:100]!r}")
    if not beat.worker_id.isprintable():
        raise BadEntry(f"worker id {beat.worker_id[:100]!r} is not printable")
    return beat
