"""RegistryFeed: the router's background reader of Redis (heartbeats and KV event streams).

Runs as one asyncio task: every `load_refresh_s` it re-reads heartbeats into the
`LoadBook`; in between it blocks (at most `index_poll_ms`) on the workers' KV event
streams and replays them into the `KVIndex`. When Redis is away it logs once, marks
itself unhealthy (routing goes on from the router's own load view), and retries.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis

from cluster.registry import RegistryReader, StreamCursor
from router.kv_index import KVIndex
from router.loads import LoadBook

logger = logging.getLogger(__name__)


class RegistryFeed:
    def __init__(self, reader: RegistryReader, index: KVIndex, loads: LoadBook, worker_ids: list[str],
                 load_refresh_s: float, index_poll_ms: int, retry_s: float = 1.0) -> None:
        self.reader, self.index, self.loads = reader, index, loads
        self.worker_ids = worker_ids
        self.load_refresh_s, self.index_poll_ms, self.retry_s = load_refresh_s, index_poll_ms, retry_s
        self.cursor = StreamCursor()
        self.healthy = False
        self.num_events = 0

    async def run(self) -> None:
        next_refresh = 0.0
        while True:
            try:
                if time.monotonic() >= next_refresh:
                    beats = await self.reader.heartbeats()
                    self.loads.set_heartbeats({w: b for w, b in beats.items() if w in self.worker_ids})
                    next_refresh = time.monotonic() + self.load_refresh_s
                events = await self.reader.read_events(self.cursor, self.worker_ids, self.index_poll_ms)
                for worker_id, ev in events:
                    self.index.apply(worker_id, ev)
                self.num_events += len(events)
                self.index.expire_predictions()
                if not self.healthy:
                    logger.info("router: Redis feed is up (%d workers)", len(self.worker_ids))
                self.healthy = True
            except (redis.RedisError, OSError, TimeoutError, ValueError) as e:
                if self.healthy:
                    logger.warning("router: Redis unavailable (%s); routing on load only", e)
                self.healthy = False
                self.loads.set_heartbeats(None)
                await asyncio.sleep(self.retry_s)
