"""Per-request block tables over the block pool, with prefix-cache lookups (torch-free).

Request.block_ids is append-only while the request holds its blocks, but for one cut: a
speculative step's blocks past the tokens it accepted (`roll_back`), never cached, go back.
The pool alone touches reference counts. A request's blocks go back to the pool tail first.

Blocks outlive their request when something still reads or writes them: a prefill
worker's push lane (`begin_transfer` when the hand-off opens, `end_transfer` on its
PushDone, never before: a request that ends meanwhile, at its first token, by an abort or a
preemption, leaves its blocks held, not freed), a decode worker's one-sided writer after an
abort (quarantine, the same reference until the writer is fenced), a decode step still in
flight (`hold` ... `release`). Held blocks are off the request, under its id, in use until
the last of these lets go. The manager is the one place that knows them (`held_tables`).
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockPool
from engine.hashing import BlockHasher
from engine.request import Request
from engine.types import BlockId, RequestId


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: BlockHasher) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._held: dict[RequestId, list[BlockId]] = {}
        """Blocks held past their request, by request id, until `release` / `end_transfer`."""
        self._transfers: set[RequestId] = set()
        """Requests whose blocks a transfer uses (`begin_transfer` .. `end_transfer`)."""

    def blocks_needed(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[BlockId], int]:
        """Longest cached run of the request's full blocks, leaving >= 1 token to compute.

        Returns (block ids, number of tokens they cover). Nothing is claimed yet.
        """
        if not self.pool.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.lookup_run(request.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_block_ids: Sequence[BlockId] = (),
    ) -> bool:
        """Make room for `num_new_tokens` beyond the computed (and cached) tokens.

        On success the cached blocks are claimed and new blocks appended to the
        request's block table; on shortage nothing changes and False is returned.
        """
        num_cached = len(cached_block_ids) * self.block_size
        total = request.num_computed_tokens + num_cached + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(request.block_ids) - len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if self.pool.ref_cnt(b) == 0) if cached_block_ids else 0
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return False
        if cached_block_ids:
            self.pool.touch(cached_block_ids)
            request.block_ids.extend(cached_block_ids)
            request.num_cached_blocks += len(cached_block_ids)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            assert new is not None  # checked above
            request.block_ids.extend(new)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        self._update_hashes(request)
        start = request.num_cached_blocks
        parent = request.block_hashes[start - 1] if start else None
        self.pool.cache_blocks(
            request.block_ids[start:num_full], request.block_hashes[start:num_full], parent
        )
        request.num_cached_blocks = num_full

    def roll_back(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (a speculative step's
        rejected slots); they hold no cached block, which needs computed tokens."""
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(request.block_ids) > keep:
            assert request.num_cached_blocks <= keep
            tail = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Give all of the request's blocks back, tail first; held instead while a transfer uses them."""
        if request.request_id in self._transfers:
            self.hold(request)
            return
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def take_blocks(self, request: Request) -> list[BlockId]:
        """Detach the block table from the request (an explicit hand-off); caller frees later."""
        block_ids, request.block_ids = request.block_ids, []
        request.num_cached_blocks = 0
        return block_ids

    def hold(self, request: Request) -> list[BlockId]:
        """The request's blocks, taken off it, stay in use under its id until `release`
        (added to any it already holds); returns what it held before, in order, and now."""
        held = self._held.setdefault(request.request_id, [])
        held.extend(self.take_blocks(request))
        return held

    def release(self, request_id: RequestId) -> bool:
        """The request's held blocks back to the pool, unless a transfer still uses them."""
        if request_id in self._transfers:
            return False
        block_ids = self._held.pop(request_id, None)
        if block_ids is None:
            return False
        self.pool.free(reversed(block_ids))
        return True

    def begin_transfer(self, request_id: RequestId) -> None:
        """A transfer uses the request's blocks (whether or not the request exists yet) until
        `end_transfer`: whenever the request ends or is preempted meanwhile, they are held."""
        self._transfers.add(request_id)

    def end_transfer(self, request_id: RequestId) -> bool:
        """The transfer is done with the request's blocks: those held go back to the pool (a
        request still running keeps its own). True when any were held."""
        self._transfers.discard(request_id)
        return self.release(request_id)

    def held(self, request_id: RequestId) -> list[BlockId]:
        """The blocks held under `request_id`, in order (none: empty)."""
        return list(self._held.get(request_id, ()))

    @property
    def num_held(self) -> int:
        """Requests whose blocks are held."""
        return len(self._held)

    def held_tables(self) -> list[list[BlockId]]:
        return list(self._held.values())

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            start, prompt = len(request.block_hashes) * self.block_size, request.prompt_token_ids
            tail = (prompt[start:] + request.output_token_ids if start < len(prompt)
                    else request.output_token_ids[start - len(prompt):])
            self.hasher.extend_tail(request.block_hashes, tail, request.tenant)
