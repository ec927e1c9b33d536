"""The router's in-memory KV index: which worker holds which cached block (torch-free).

Data flow: each worker appends its block pool's `KVEvent`s (`stored` / `removed`,
numbered per worker without gaps) to a Redis stream; the router's
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
from itertools import takewhile

from engine.core.block_pool import KVEvent
from engine.types import BlockHash

logger = logging.getLogger(__name__)

WorkerId = str


class KVIndex:
    """Per worker: the set of blocks its events say it holds, and its predicted blocks with
    their expiry. Applying an event and predicting are set and dict updates over the whole
    block list at once (a 15k-token prompt is ~1,000 blocks); a lookup walks the prompt's
    leading blocks per worker until one is missing."""

    def __init__(self, clock: Callable[[], float], predicted_ttl_s: float = 2.0) -> None:
        if predicted_ttl_s <= 0:
            raise ValueError(f"predicted_ttl_s must be positive, got {predicted_ttl_s}")
        self.clock = clock
        self.predicted_ttl_s = predicted_ttl_s
        self._blocks: dict[WorkerId, set[BlockHash]] = {}
        self._predicted: dict[WorkerId, dict[BlockHash, float]] = {}
        """Per worker, predicted blocks and until when; a worker with none has no entry."""
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
            self._blocks.setdefault(worker_id, set()).update(event.block_hashes)
            self.retract(worker_id, event.block_hashes)
        else:  # removed
            self._blocks.get(worker_id, set()).difference_update(event.block_hashes)
            self.retract(worker_id, event.block_hashes)

    def clear_worker(self, worker_id: WorkerId) -> None:
        """Forget what a worker holds (a gap in its events, or the worker left)."""
        self._blocks.pop(worker_id, None)

    def forget_worker(self, worker_id: WorkerId) -> None:
        self.clear_worker(worker_id)
        self._last_event_id.pop(worker_id, None)
        self._predicted.pop(worker_id, None)

    def predict(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """The router just sent these blocks' prompt to `worker_id`: count them as cached there for a while."""
        expiry = self.clock() + self.predicted_ttl_s
        mine = self._predicted.get(worker_id)
        if mine is None:
            self._predicted[worker_id] = dict.fromkeys(block_hashes, expiry)
        else:
            mine.update(dict.fromkeys(block_hashes, expiry))
        self._expiries.append((expiry, worker_id, block_hashes))

    def retract(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """The request predicted there failed before its blocks were stored: drop those predictions
        (confirmed entries stay; they come and go with the worker's own events)."""
        mine = self._predicted.get(worker_id)
        if mine:
            for h in mine.keys() & block_hashes:
                del mine[h]
            if not mine:
                del self._predicted[worker_id]

    def predicted(self, worker_id: WorkerId) -> dict[BlockHash, float]:
        """A worker's predicted blocks and until when (a copy)."""
        return dict(self._predicted.get(worker_id, {}))

    # -- lookup --------------------------------------------------------------------------
    def overlap(self, block_hashes: Sequence[BlockHash], workers: Iterable[WorkerId]) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of the prompt it holds (confirmed or predicted)."""
        now = self.clock()
        result = {}
        first = block_hashes[0] if block_hashes else None
        for w in workers:
            mine = self._blocks.get(w, _NONE)
            predicted = self._predicted.get(w)
            if predicted is None:  # the common cases: none held, or a run of held blocks at C speed
                result[w] = len(list(takewhile(mine.__contains__, block_hashes))) if first in mine else 0
                continue
            n = 0
            for h in block_hashes:
                if h not in mine and predicted.get(h, 0.0) <= now:
                    break
                n += 1
            result[w] = n
        return result

    def expire_predictions(self) -> None:
        """Drops the predictions whose time is up: work in proportion to those, not to all
        (the feed calls this after every batch of events)."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, worker_id, block_hashes = self._expiries.popleft()
            mine = self._predicted.get(worker_id)
            if not mine:
                continue
            for h in mine.keys() & block_hashes:
                if mine[h] == expiry:  # not predicted again since
                    del mine[h]
            if not mine:
                del self._predicted[worker_id]

    def num_blocks(self, worker_id: WorkerId) -> int:
        return len(self._blocks.get(worker_id, ()))


_NONE: frozenset[BlockHash] = frozenset()
