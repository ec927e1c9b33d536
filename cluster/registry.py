"""The Redis control plane: worker heartbeats, KV event streams, router stats.

Keys under one namespace `ns` (msgpack values, never pickle):
  {ns}:hb:{worker_id}      a worker's heartbeat; expires after its TTL, so a missing key is a gone worker
  {ns}:kv:{worker_id}      Redis Stream of the worker's KV events (field `e`: ``event_to_wire``)
  {ns}:router:{router_id}  a router's stats (queues, prefix hit rate); expires like a heartbeat

Workers write through a `Publisher` thread, so their engine never waits on Redis; the
router reads with `RegistryReader` (redis.asyncio) in a background task. This module
and cluster/config.py are the leaves of `cluster` that the roles import; the rest of
`cluster` wires the roles together. Redis being
away costs routers their KV index and load reports, never a request.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import msgpack
import redis
import redis.asyncio

from engine.block_pool import KVEvent
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.types import BlockHash

logger = logging.getLogger(__name__)

STREAM_MAXLEN = 100_000
"""Approximate cap of a worker's KV event stream; a router that falls behind it sees a gap and resyncs."""


def hb_key(ns: str, worker_id: str) -> str:
    return f"{ns}:hb:{worker_id}"


def kv_key(ns: str, worker_id: str) -> str:
    return f"{ns}:kv:{worker_id}"


def router_key(ns: str, router_id: str) -> str:
    return f"{ns}:router:{router_id}"


def event_to_wire(ev: KVEvent) -> dict[str, object]:
    d: dict[str, object] = {"id": ev.event_id, "kind": ev.kind, "hashes": list(ev.block_hashes)}
    if ev.parent_block_hash is not None:
        d["parent"] = ev.parent_block_hash
    return d


def event_from_wire(d: dict[str, object]) -> KVEvent:
    kind = d["kind"]
    if kind not in ("stored", "removed", "cleared"):
        raise ValueError(f"unknown KV event kind {kind!r}")
    parent = d.get("parent")
    return KVEvent(int(d["id"]), kind, [BlockHash(bytes(h)) for h in d.get("hashes", ())],  # type: ignore[arg-type, union-attr]
                   BlockHash(bytes(parent)) if parent is not None else None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    role: str
    """prefill | decode"""
    address: str = ""
    """Decode workers: the gRPC target of their DecodeWorker service."""
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    """Evictable: free for new requests, still a prefix-cache hit until reused."""
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_prompt_tokens: int = 0
    """Cumulative prompt tokens seen, and how many of them were prefix-cache hits."""
    num_cached_tokens: int = 0
    sent_at: float = 0.0
    """Wall-clock time of the report (s since the epoch)."""

    def to_wire(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> Heartbeat:
        d = msgpack.unpackb(data)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def engine_heartbeat(loop: EngineLoop, worker_id: str, role: str, address: str,
                     num_prompt_tokens: Callable[[], tuple[int, int]]) -> Heartbeat | None:
    """A worker's heartbeat, read on its engine thread; None (skip this beat) if that thread is busy or gone.

    `num_prompt_tokens()` returns the worker's cumulative (prompt, prefix-cached) token counts.
    """
    def read(engine: LLMEngine) -> Heartbeat:
        u = engine.block_pool.usage()
        s = engine.scheduler
        queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in [*s.waiting, *s.running])
        prompt, cached = num_prompt_tokens()
        return Heartbeat(worker_id, role, address, u.num_total, u.num_free, u.num_cached, len(s.running),
                         len(s.waiting), queued, prompt, cached, time.time())

    try:
        return loop.call(read).result(timeout=2.0)
    except (RuntimeError, concurrent.futures.TimeoutError):
        return None


class Publisher:
    """A worker's Redis writer: heartbeats every `interval_s`, KV events as they come (batched)."""

    def __init__(
        self, redis_url: str, namespace: str, worker_id: str, heartbeat: Callable[[], Heartbeat | None],
        interval_s: float = 0.5, ttl_s: float = 3.0, max_buffered_events: int = 100_000,
    ) -> None:
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.ns, self.worker_id, self.heartbeat = namespace, worker_id, heartbeat
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._events: deque[KVEvent] = deque(maxlen=max_buffered_events)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._healthy = True
        self.num_published_events = 0
        self._thread = threading.Thread(target=self._run, name=f"publisher-{worker_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish_events(self, events: list[KVEvent]) -> None:
        """Thread-safe, never blocks; beyond the buffer the oldest are dropped (routers see a gap)."""
        if events:
            self._events.extend(events)
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.client.delete(hb_key(self.ns, self.worker_id))
        except redis.RedisError:
            pass
        self.client.close()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self._wake.wait(timeout=max(next_beat - time.monotonic(), 0.0))
            self._wake.clear()
            beat = time.monotonic() >= next_beat
            try:
                self._flush(beat)
            except redis.RedisError as e:
                if self._healthy:
                    logger.warning("worker %s: Redis unavailable (%s); retrying", self.worker_id, e)
                self._healthy = False
                self._stop.wait(min(self.interval_s, 1.0))
                continue
            if not self._healthy:
                logger.info("worker %s: Redis reachable again", self.worker_id)
            self._healthy = True
            if beat:
                next_beat = time.monotonic() + self.interval_s

    def _flush(self, beat: bool) -> None:
        batch = list(self._events)[:1000]
        pipe = self.client.pipeline(transaction=False)
        for ev in batch:
            pipe.xadd(kv_key(self.ns, self.worker_id), {"e": msgpack.packb(event_to_wire(ev))},
                      maxlen=STREAM_MAXLEN, approximate=True)
        hb = self.heartbeat() if beat else None
        if hb is not None:
            pipe.set(hb_key(self.ns, self.worker_id), hb.to_wire(), px=int(self.ttl_s * 1000))
        elif beat:  # the engine is busy in a long step: the process lives, keep the last beat alive
            pipe.pexpire(hb_key(self.ns, self.worker_id), int(self.ttl_s * 1000))
        pipe.execute()
        for _ in batch:
            self._events.popleft()
        self.num_published_events += len(batch)
        if self._events:
            self._wake.set()


@dataclass
class StreamCursor:
    """Where a reader is in each worker's KV stream."""

    last_ids: dict[str, str] = field(default_factory=dict)


class RegistryReader:
    """Async reads for routers and `splitserve status`; every call is bounded by the client's timeouts."""

    def __init__(self, redis_url: str, namespace: str, timeout_s: float = 2.0) -> None:
        self.client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ns = namespace

    async def heartbeats(self) -> dict[str, Heartbeat]:
        keys = [k async for k in self.client.scan_iter(match=hb_key(self.ns, "*"), count=500)]
        if not keys:
            return {}
        values = await self.client.mget(keys)
        beats = [Heartbeat.from_wire(v) for v in values if v is not None]
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
                out.append((worker, event_from_wire(msgpack.unpackb(data[b"e"]))))
        return out

    async def set_router_stats(self, router_id: str, stats: dict[str, object], ttl_s: float) -> None:
        await self.client.set(router_key(self.ns, router_id), msgpack.packb(stats), px=int(ttl_s * 1000))

    async def router_stats(self) -> dict[str, dict[str, object]]:
        keys = [k async for k in self.client.scan_iter(match=router_key(self.ns, "*"), count=100)]
        values = await self.client.mget(keys) if keys else []
        prefix = len(router_key(self.ns, ""))
        return {k.decode()[prefix:]: msgpack.unpackb(v) for k, v in zip(keys, values, strict=True) if v is not None}

    async def close(self) -> None:
        await self.client.aclose()
