"""RegistryFeed: the router's background reader of Redis (heartbeats and KV event streams).

Runs as one asyncio task: every `load_refresh_s` it re-reads heartbeats into the
`Members` table (who serves, where, with which model) and the `LoadBook`; in between
it blocks (at most `index_poll_ms`) on the members' KV event streams and replays them
into the `KVIndex`, and the streams of the KV stores the members fetch from (their
heartbeats name them) into the index of the tier (`stores`). When Redis is away it logs once, marks itself unhealthy (routing
goes on from the last membership and the router's own load view), and retries.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis

from control.heartbeat import Heartbeat
from control.reader import RegistryReader, StreamCursor
from router.kv_index import KVIndex
from router.loads import LoadBook
from router.members import Members

logger = logging.getLogger(__name__)


MAX_SILENT_S = 30.0
"""Longest a member whose heartbeat expired is kept because it still answers its health check."""


class RegistryFeed:
    def __init__(self, reader: RegistryReader, members: Members, index: KVIndex, loads: LoadBook,
                 load_refresh_s: float, index_poll_ms: int, on_left: Callable[[str], Awaitable[None]] | None = None,
                 retry_s: float = 1.0, stores: KVIndex | None = None,
                 confirm: Callable[[str, str], Awaitable[bool]] | None = None, max_silent_s: float = MAX_SILENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_left(address)`: a worker left (its connections can close); `stores`: what each
        host's KV store holds, by store id (None: not read); `confirm(address, role)`: whether a
        worker whose heartbeat expired still serves there (its health check): it stays a
        member, on its last heartbeat, for up to `max_silent_s` (None: it leaves at once)."""
        self.reader, self.members, self.index, self.loads = reader, members, index, loads
        self.confirm, self.max_silent_s, self.clock = confirm, max_silent_s, clock
        self._last: dict[str, tuple[Heartbeat, float]] = {}
        """Each member's newest heartbeat and when it was read."""
        self.num_silent_kept = 0
        """Refreshes that kept a member with no heartbeat because it still served (a late beat)."""
        self.stores = stores
        self._store_ids: set[str] = set()
        self.load_refresh_s, self.index_poll_ms, self.retry_s = load_refresh_s, index_poll_ms, retry_s
        self.on_left = on_left
        self.cursor = StreamCursor()
        self.healthy = False
        self.num_refreshes = 0
        self.num_events = 0

    async def refresh(self) -> None:
        """Reads the heartbeats once into the members table and the load book."""
        beats = await self.reader.heartbeats()
        beats.update(await self._silent_but_serving(beats))
        before = set(self.members.ids())
        for member in self.members.update(beats):
            self.index.forget_worker(member.worker_id)
            self.cursor.last_ids.pop(member.worker_id, None)
            if self.on_left is not None:
                await self.on_left(member.address)
        now = set(self.members.ids())
        for w in sorted(now - before):
            logger.info("router: worker %s joined (%s at %s)", w, beats[w].role, beats[w].address)
        for w in sorted(before - now):
            logger.info("router: worker %s left", w)
        if self.stores is not None:
            self.members.store_addresses = await self.reader.store_entries()
            now_stores = set(self.members.stores())
            for gone in self._store_ids - now_stores:  # no member fetches from it any more
                self.stores.forget_worker(gone)
                self.cursor.last_ids.pop(gone, None)
            self._store_ids = now_stores
        self.loads.num_blocks = self.members.num_blocks()
        self.loads.set_heartbeats({w: b for w, b in beats.items() if w in self.members})
        self.num_refreshes += 1

    async def _silent_but_serving(self, beats: dict[str, Heartbeat]) -> dict[str, Heartbeat]:
        """The serving members whose heartbeat expired but that answer their health check
        SERVING (on a busy machine a beat can come late), on their last heartbeat."""
        now = self.clock()
        for w, hb in beats.items():
            self._last[w] = (hb, now)
        silent = {w: hb for w, (hb, at) in self._last.items() if w not in beats and w in self.members
                  and hb.state == "serving" and now - at <= self.max_silent_s}
        self._last = {w: v for w, v in self._last.items() if w in beats or w in silent}
        if not silent or self.confirm is None:
            return {}
        alive = await asyncio.gather(*(self.confirm(hb.address, hb.role) for hb in silent.values()))
        kept = {w: hb for (w, hb), ok in zip(silent.items(), alive, strict=True) if ok}
        for w in kept:
            self.num_silent_kept += 1
            logger.info("router: worker %s's heartbeat is late (%.1f s) but it serves: kept", w, now - self._last[w][1])
        return kept

    async def catch_up(self, timeout_s: float) -> int:
        """Membership, then the members' KV event streams replayed into the index until a read
        finds nothing new (or `timeout_s` passes): what a router does before it takes traffic.
        Returns the events applied."""
        await self.refresh()
        deadline, applied = time.monotonic() + timeout_s, 0
        while self.members.ids() and time.monotonic() < deadline:
            if not (n := await self._read_events()):
                break
            applied += n
        return applied

    async def _read_events(self) -> int:
        """One read of the members' KV event streams (blocks up to `index_poll_ms`), applied to the index."""
        events = await self.reader.read_events(self.cursor, [*self.members.ids(), *sorted(self._store_ids)],
                                               self.index_poll_ms)
        for member_id, ev in events:
            if member_id in self._store_ids and self.stores is not None:
                self.stores.apply(member_id, ev)
            else:
                self.index.apply(member_id, ev)
        self.num_events += len(events)
        return len(events)

    async def run(self) -> None:
        next_refresh = 0.0
        while True:
            try:
                if time.monotonic() >= next_refresh:
                    await self.refresh()
                    next_refresh = time.monotonic() + self.load_refresh_s
                if not self.members.ids():  # nobody to read from yet: wait for the next refresh
                    await asyncio.sleep(max(next_refresh - time.monotonic(), 0.0))
                    continue
                await self._read_events()
                self.index.expire_predictions()
                if not self.healthy:
                    logger.info("router: Redis feed is up (%d workers)", len(self.members.ids()))
                self.healthy = True
            except (redis.RedisError, OSError, TimeoutError, ValueError) as e:
                if self.healthy:
                    logger.warning("router: Redis unavailable (%s); routing on load only", e)
                self.healthy = False
                self.loads.set_heartbeats(None)
                await asyncio.sleep(self.retry_s)
