"""The block pool: sole owner of reference counts, the free queue and the prefix cache.

Data flow (all CPU, plain Python):
  ref_cnt[block]      -> how many holders (requests, hand-offs) use a block
  _free (OrderedDict) -> probation: blocks with ref_cnt 0, least recently freed first;
                         a block here may still carry a hash (cached, evictable)
  _protected          -> cached ref_cnt-0 blocks that were hit again after they were
                         stored (a shared prefix), least recently freed first
  _cached             -> block hash -> block id, for full blocks whose KV is computed
  _events             -> KV events (stored / removed) for the router's index

Allocation pops from the front of probation, then of protected, and evicts the
block's hash if it had one. A block with no hash joins probation at the front (it
holds nothing worth keeping); callers free a request's blocks tail first, so a
request's last blocks are evicted before its first ones. The two segments (SLRU) keep
a prefix that has proved shared alive through a stream of one-off prompts, whose
blocks would otherwise push it out of a plain LRU; protected holds at most
`protected_fraction` of the pool, its oldest blocks dropping back to probation.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Literal

from engine.types import BlockHash, BlockId, InvariantError

_is_block = partial(is_not, None)
"""A lookup's result is a block id (0 is one, so not `bool`)."""

KVEventKind = Literal["stored", "removed"]


@dataclass(frozen=True)
class KVEvent:
    """A change to the set of cached blocks, numbered per worker without gaps."""

    event_id: int
    kind: KVEventKind
    block_hashes: list[BlockHash] = field(default_factory=list)
    parent_block_hash: BlockHash | None = None
    """For `stored`: hash of the block before the first stored one (None at the root)."""


@dataclass(frozen=True)
class PoolUsage:
    num_total: int
    num_free: int
    """ref_cnt 0 and no hash."""
    num_cached: int
    """ref_cnt 0 with a hash: evictable."""
    num_in_use: int


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, protected_fraction: float = 0.5) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1), got {protected_fraction}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_protected = int(num_blocks * protected_fraction)
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._reused = [False] * num_blocks
        """Hit in the prefix cache since it was stored (goes to protected when freed)."""
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(i), None) for i in range(num_blocks)
        )
        self._protected: OrderedDict[BlockId, None] = OrderedDict()
        self._cached: dict[BlockHash, BlockId] = {}
        self._num_hashed_in_use = 0
        """Blocks with a hash and a holder: the cached ones not evictable (`usage` in O(1))."""
        self._events: list[KVEvent] = []
        self._next_event_id = 0

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached)."""
        return len(self._free) + len(self._protected)

    def ref_cnt(self, block_id: BlockId) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._hash[block_id]

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        return self._cached.get(block_hash)

    def lookup_run(self, block_hashes: Iterable[BlockHash]) -> list[BlockId]:
        """The cached blocks of the leading run of `block_hashes` (up to the first miss)."""
        return list(takewhile(_is_block, map(self._cached.get, block_hashes)))

    # -- ownership -----------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Take `num_blocks` from the front of the free queue, or None if too few."""
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        evicted: list[BlockHash] = []
        free, hashes, reused, ref_cnt = self._free, self._hash, self._reused, self._ref_cnt
        for _ in range(num_blocks):  # a hot loop (a long prompt takes thousands): locals only
            block_id, _ = (free or self._protected).popitem(last=False)
            old = hashes[block_id]
            if old is not None:
                del self._cached[old]
                hashes[block_id] = None
                evicted.append(old)
            reused[block_id] = False
            ref_cnt[block_id] = 1
            block_ids.append(block_id)
        if evicted:
            self._emit("removed", evicted)
        return block_ids

    def touch(self, block_ids: Iterable[BlockId], hit: bool = True) -> None:
        """Add a holder to blocks found in the prefix cache (`hit` False: a reader that is no
        prefix hit, e.g. an offload, which leaves the block's standing in the cache as it was)."""
        ref_cnt, hashes, reused, free, protected = self._ref_cnt, self._hash, self._reused, self._free, self._protected
        held = 0
        for block_id in block_ids:  # hot, as in allocate
            count = ref_cnt[block_id]
            hashed = hashes[block_id] is not None
            if count == 0:
                del (protected if block_id in protected else free)[block_id]
                held += hashed
            ref_cnt[block_id] = count + 1
            if hit:
                reused[block_id] = hashed
        self._num_hashed_in_use += held

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one holder from each block; blocks reaching 0 join a free queue: a reused
        cached block protected's tail, another cached block probation's tail, a block
        with no hash probation's front."""
        free, protected, hashes, ref_cnt, reused = self._free, self._protected, self._hash, self._ref_cnt, self._reused
        max_protected = self.max_protected
        released = 0
        try:
            for block_id in block_ids:  # a hot loop, as in allocate
                count = ref_cnt[block_id]
                if count > 1:
                    ref_cnt[block_id] = count - 1
                    continue
                if count <= 0:
                    raise InvariantError(f"block {block_id} freed while not in use")
                ref_cnt[block_id] = 0
                if hashes[block_id] is None:
                    free[block_id] = None
                    free.move_to_end(block_id, last=False)
                    continue
                released += 1
                if max_protected and reused[block_id]:
                    protected[block_id] = None
                    if len(protected) > max_protected:
                        oldest, _ = protected.popitem(last=False)
                        reused[oldest] = False  # must prove itself again
                        free[oldest] = None
                else:
                    free[block_id] = None
        finally:
            self._num_hashed_in_use -= released

    # -- prefix cache --------------------------------------------------------------
    def cache_blocks(
        self,
        block_ids: Sequence[BlockId],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Register full, computed blocks under their hashes (one `stored` event).

        A hash already cached under another block keeps its first block; the
        duplicate block stays uncached and is freed normally.
        """
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        hashes, cached, ref_cnt = self._hash, self._cached, self._ref_cnt
        held = 0
        try:
            for block_id, block_hash in zip(block_ids, block_hashes, strict=True):  # hot, as in allocate
                if hashes[block_id] is not None or block_hash in cached:
                    continue
                hashes[block_id] = block_hash
                cached[block_hash] = block_id
                held += ref_cnt[block_id] > 0
                stored.append(block_hash)
        finally:
            self._num_hashed_in_use += held
        if stored:
            self._emit("stored", stored, parent_block_hash)

    # -- events and checks ---------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def usage(self) -> PoolUsage:
        """O(1): heartbeats read it every half second, on pools of tens of thousands of blocks."""
        unheld = len(self._free) + len(self._protected)
        cached = len(self._cached) - self._num_hashed_in_use
        return PoolUsage(self.num_blocks, unheld - cached, cached, self.num_blocks - unheld)

    def check_invariants(self) -> PoolUsage:
        """free + cached + in_use == total, and every index agrees with ref counts."""
        u = self.usage()
        in_use = sum(1 for c in self._ref_cnt if c > 0)
        cached = sum(1 for b in self._free if self._hash[b] is not None) + len(self._protected)
        if (u.num_in_use, u.num_cached) != (in_use, cached):
            raise InvariantError(f"block counts {u} disagree with the blocks: {in_use} in use, {cached} cached")
        if u.num_free + u.num_cached + u.num_in_use != u.num_total:
            raise InvariantError(f"block accounting broken: {u}")
        for b, c in enumerate(self._ref_cnt):
            if c < 0 or (c == 0) != (BlockId(b) in self._free or BlockId(b) in self._protected):
                raise InvariantError(f"block {b}: ref_cnt {c} disagrees with free queue")
            if b in self._protected and (b in self._free or self._hash[b] is None):
                raise InvariantError(f"block {b}: protected but also in probation or without a hash")
        for h, b in self._cached.items():
            if self._hash[b] != h:
                raise InvariantError(f"cache maps a hash to block {b} which holds another")
        if sum(h is not None for h in self._hash) != len(self._cached):
            raise InvariantError("a block carries a hash the cache does not know")
        return u

    def check_holders(self, block_tables: Iterable[Sequence[BlockId]]) -> PoolUsage:
        """check_invariants, plus: each ref count equals the number of tables holding the block."""
        usage = self.check_invariants()
        holders = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                holders[b] += 1
        for b, (held, refs) in enumerate(zip(holders, self._ref_cnt, strict=True)):
            if held != refs:
                raise InvariantError(f"block {b}: ref_cnt {refs} but {held} holders")
        return usage

    def _emit(
        self, kind: KVEventKind, hashes: list[BlockHash], parent: BlockHash | None = None
    ) -> None:
        self._events.append(KVEvent(self._next_event_id, kind, hashes, parent))
        self._next_event_id += 1
