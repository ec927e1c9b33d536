"""The router's in-memory KV index: which worker holds which cached block (torch-free).

Data flow: each worker appends its block pool's `KVEvent`s (`stored` / `removed` /
`cleared`, numbered per worker without gaps) to a Redis stream; the router's
`RegistryFeed` replays them into `apply()`. At routing time the router adds short-lived
*predicted* entries for the worker it chose, so a burst of requests sharing a prefix
lands together before that worker's events arrive; the worker's own `stored` or
`removed` event for a block replaces the prediction (a worker that evicted a block says
so, and a stale guess would send a request to a local prefill that misses). The index is a routing hint only:
a gap in a worker's event ids (a trimmed stream, a restarted worker) clears that
worker's entries rather than guessing.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from engine.block_pool import KVEvent
from engine.types import BlockHash

logger = logging.getLogger(__name__)

WorkerId = str


class KVIndex:
    def __init__(self, clock: Callable[[], float], predicted_ttl_s: float = 2.0) -> None:
        if predicted_ttl_s <= 0:
            raise ValueError(f"predicted_ttl_s must be positive, got {predicted_ttl_s}")
        self.clock = clock
        self.predicted_ttl_s = predicted_ttl_s
        self._holders: dict[BlockHash, set[WorkerId]] = {}
        self._blocks: dict[WorkerId, set[BlockHash]] = {}
        self._predicted: dict[BlockHash, dict[WorkerId, float]] = {}
        self._expiries: deque[tuple[float, WorkerId, Sequence[BlockHash]]] = deque()
        """Each `predict` call in order (the TTL is fixed, so by expiry), for `expire_predictions`."""
        self._last_event_id: dict[WorkerId, int] = {}
        self.num_gaps = 0
        """Times a worker's events skipped ids and its entries were dropped."""

    # -- feeding -------------------------------------------------------------------------
    def apply(self, worker_id: WorkerId, event: KVEvent) -> None:
        last = self._last_event_id.get(worker_id)
        if last is not None and event.event_id != last + 1:
            self.num_gaps += 1
            logger.info("worker %s: KV event %d after %d; dropping its index entries", worker_id, event.event_id, last)
            self.clear_worker(worker_id)
        self._last_event_id[worker_id] = event.event_id
        if event.kind == "stored":
            holders, mine = self._holders, self._blocks.setdefault(worker_id, set())
            for h in event.block_hashes:  # a hot loop (a long prompt stores thousands): locals only
                held = holders.get(h)
                if held is None:
                    holders[h] = {worker_id}
                else:
                    held.add(worker_id)
            mine.update(event.block_hashes)
            self.retract(worker_id, event.block_hashes)
        elif event.kind == "removed":
            self._remove(worker_id, event.block_hashes)
            self.retract(worker_id, event.block_hashes)
        else:
            self.clear_worker(worker_id)
            for by_worker in self._predicted.values():
                by_worker.pop(worker_id, None)

    def clear_worker(self, worker_id: WorkerId) -> None:
        """Forget what a worker holds (cleared, gap, or the worker left)."""
        self._remove(worker_id, list(self._blocks.pop(worker_id, ())))

    def forget_worker(self, worker_id: WorkerId) -> None:
        self.clear_worker(worker_id)
        self._last_event_id.pop(worker_id, None)
        for by_worker in self._predicted.values():
            by_worker.pop(worker_id, None)

    def last_event_id(self, worker_id: WorkerId) -> int | None:
        return self._last_event_id.get(worker_id)

    def predict(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """The router just sent these blocks' prompt to `worker_id`: count them as cached there for a while."""
        expiry = self.clock() + self.predicted_ttl_s
        predicted = self._predicted
        for h in block_hashes:
            by_worker = predicted.get(h)
            if by_worker is None:
                predicted[h] = {worker_id: expiry}
            else:
                by_worker[worker_id] = expiry
        self._expiries.append((expiry, worker_id, block_hashes))

    def retract(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """The request predicted there failed before its blocks were stored: drop those predictions
        (confirmed entries stay; they come and go with the worker's own events)."""
        predicted = self._predicted
        if not predicted:
            return
        for h in block_hashes:
            by_worker = predicted.get(h)
            if by_worker is not None:
                by_worker.pop(worker_id, None)
                if not by_worker:
                    del predicted[h]

    # -- lookup --------------------------------------------------------------------------
    def overlap(self, block_hashes: Sequence[BlockHash], workers: Iterable[WorkerId]) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of the prompt it holds (confirmed or predicted)."""
        now = self.clock()
        result = {w: 0 for w in workers}
        alive = set(result)
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h, set())
            predicted = self._predicted.get(h, {})
            alive = {w for w in alive if w in holders or predicted.get(w, 0.0) > now}
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    def expire_predictions(self) -> None:
        """Drops the predictions whose time is up: work in proportion to those, not to all
        (the feed calls this after every batch of events)."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, worker_id, block_hashes = self._expiries.popleft()
            for h in block_hashes:
                by_worker = self._predicted.get(h)
                if by_worker is not None and by_worker.get(worker_id) == expiry:  # not predicted again since
                    del by_worker[worker_id]
                    if not by_worker:
                        del self._predicted[h]

    def num_blocks(self, worker_id: WorkerId) -> int:
        return len(self._blocks.get(worker_id, ()))

    def _remove(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        mine, all_holders = self._blocks.get(worker_id), self._holders
        for h in block_hashes:
            holders = all_holders.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del all_holders[h]
        if mine is not None:
            mine.difference_update(block_hashes)
