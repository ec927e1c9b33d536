"""A worker's Redis writer: heartbeats every `interval_s` and its KV event stream, on its own thread.

The engine never waits on Redis: events are handed over with `publish_events` (never
blocks; beyond the buffer the oldest are dropped and routers see a gap), and the
heartbeat callable is read on this thread. Redis being away costs routers their KV
index and load reports, never a request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis

from control.auth import seal
from control.heartbeat import Heartbeat, hb_key, kv_key
from control.kv_events import STREAM_MAXLEN, event_to_bytes
from control.redis_url import readable
from engine.core.block_pool import KVEvent

logger = logging.getLogger(__name__)


class Publisher:
    """A worker's Redis writer: heartbeats every `interval_s`, KV events as they come (batched)."""

    def __init__(
        self, redis_url: str, namespace: str, worker_id: str, heartbeat: Callable[[], Heartbeat | None],
        interval_s: float = 0.5, ttl_s: float = 3.0, max_buffered_events: int = 100_000,
        seal_key: bytes | None = None,
    ) -> None:
        """`seal_key`: the cluster's registry key (`control.auth.registry_key`): heartbeats and
        KV events are sealed with it, and routers read only sealed ones."""
        self.seal_key = seal_key
        self.client = redis.Redis.from_url(readable(redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
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
        if self._thread.is_alive():  # a worker stopped while it was still starting never started it
            self._thread.join(timeout=5)
        try:  # gone: its heartbeat and its KV event stream (nobody replays a gone worker's cache)
            self.client.delete(hb_key(self.ns, self.worker_id), kv_key(self.ns, self.worker_id))
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
        stream = kv_key(self.ns, self.worker_id)
        for ev in batch:
            data = event_to_bytes(ev)
            pipe.xadd(stream, {"e": data if self.seal_key is None else seal(self.seal_key, stream, data)},
                      maxlen=STREAM_MAXLEN, approximate=True)
        hb = self.heartbeat() if beat else None
        if hb is not None:
            key = hb_key(self.ns, self.worker_id)
            wire = hb.to_wire() if self.seal_key is None else seal(self.seal_key, key, hb.to_wire())
            pipe.set(key, wire, px=int(self.ttl_s * 1000))
        elif beat:  # the engine is busy in a long step: the process lives, keep the last beat alive
            pipe.pexpire(hb_key(self.ns, self.worker_id), int(self.ttl_s * 1000))
        pipe.execute()
        for _ in batch:
            self._events.popleft()
        self.num_published_events += len(batch)
        if self._events:
            self._wake.set()
