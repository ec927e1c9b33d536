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
the last of these lets go. The manager is the one place that knows them (`check_holders` counts them).

A model whose every layer has a sliding window (Mistral's, Qwen3-MoE's) reads, for its next
query at position p, only keys from p + 1 - window on: the blocks wholly before that go back
to the pool as the window passes (`slide`), after they are registered in the prefix cache
(so a later prompt with the same start still finds them while they stay there). Their
entries in the block table become the null block, which the manager holds for the pool's
life and nothing writes: every attention kernel starts at its window and never reads it; the
torch forms gather it and mask it out, as they do a table's padding. Positions stay where they
were, so the table indexes as before. A request's first blocks (a prefix-cache hit, or the
prompt a decode worker receives) are claimed from its first query's window on.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.block_pool import BlockPool, PoolUsage
from engine.core.hashing import BlockHasher
from engine.core.request import Request
from engine.types import BlockHash, BlockId, RequestId


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slid_blocks(next_query: int, block_size: int, window: int) -> int:
    """Leading blocks that no query at `next_query` or later reads, under a sliding `window`
    on every layer (0: none): wholly before the keys next_query + 1 - window on."""
    if not window:
        return 0
    return max(0, next_query + 1 - window) // block_size


def window_tokens(block_size: int, window: int) -> int:
    """The most KV tokens a sequence holds under a sliding `window` on every layer, however
    long it grows: the window's blocks and one more (`held_blocks` at its largest)."""
    return (_cdiv(window, block_size) + 1) * block_size


def held_blocks(num_tokens: int, block_size: int, window: int) -> int:
    """The blocks a sequence of `num_tokens` (its last one's KV not yet computed) holds for its
    next step: all of them, or with a window those from that token's window on (what a decode
    worker reserves for a prompt, the router books and admission charges)."""
    return _cdiv(num_tokens, block_size) - slid_blocks(max(num_tokens - 1, 0), block_size, window)


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: BlockHasher, window: int = 0) -> None:
        """`window`: the keys behind its query that the model's widest layer reads, where every
        layer has a sliding window (0: some layer reads the whole context, nothing slides)."""
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.window = window
        self.null_block: BlockId | None = None
        """The table entry of a slid-past position (held here for the pool's life; None: no window)."""
        if window:
            null = pool.allocate(1)
            if null is None or pool.num_free_blocks == 0:
                raise ValueError(f"a pool of {pool.num_blocks} blocks has no room beside the null block")
            self.null_block = null[0]
        self._held: dict[RequestId, list[BlockId]] = {}
        """Blocks held past their request, by request id, until `release` / `end_transfer`."""
        self._transfers: set[RequestId] = set()
        """Requests whose blocks a transfer uses (`begin_transfer` .. `end_transfer`)."""

    def blocks_needed(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def num_slid_blocks(self, next_query: int) -> int:
        """Leading blocks that no query at `next_query` or later reads: wholly before its window."""
        return slid_blocks(next_query, self.block_size, self.window)

    def blocks_to_compute(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence holds at once while `num_tokens` of it are computed in
        steps of at most `chunk`: all of them, or with a window (a step at s holds its keys from
        s + 1 - window on, and its own) at most those of window + chunk tokens and one more."""
        if not self.window:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens), self.blocks_needed(self.window + chunk) + 1)

    def find_cached_prefix(self, request: Request) -> tuple[list[BlockId], int]:
        """Longest cached run of the request's full blocks, leaving >= 1 token to compute.

        Returns (block ids, number of tokens they cover). Nothing is claimed yet.
        """
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return [], 0  # prompt log-probabilities need every position computed
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.lookup_run(request.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_block_ids: Sequence[BlockId] = (),
        next_query: int | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` beyond the computed (and cached) tokens.

        On success the cached blocks are claimed and new blocks appended to the
        request's block table; on shortage nothing changes and False is returned. A request's
        first blocks start at the window of `next_query`, the first position that will read
        them (default: the first computed here; a decode worker's remote prompt: its end),
        the entries before it null.
        """
        num_cached = len(cached_block_ids) * self.block_size
        total = request.num_computed_tokens + num_cached + num_new_tokens
        skip = 0
        if not request.block_ids:
            start = request.num_computed_tokens + num_cached if next_query is None else next_query
            skip = min(self.num_slid_blocks(start), self.blocks_needed(total))
        claimed = list(cached_block_ids[skip:])
        num_new_blocks = self.blocks_needed(total) - len(request.block_ids) - max(skip, len(cached_block_ids))
        num_revived = sum(1 for b in claimed if self.pool.ref_cnt(b) == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return False
        if skip:
            assert self.null_block is not None
            request.block_ids.extend([self.null_block] * skip)
            request.num_slid_blocks = skip
        if claimed:
            self.pool.touch(claimed)
            request.block_ids.extend(claimed)
        request.num_cached_blocks = max(request.num_cached_blocks + len(cached_block_ids), skip)
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

    def slide(self, request: Request) -> None:
        """Give back the blocks that every layer's window has passed (registered in the prefix
        cache first, by `cache_computed_blocks`); their table entries become the null block."""
        n = min(self.num_slid_blocks(request.num_computed_tokens), len(request.block_ids))
        if n <= request.num_slid_blocks:
            return
        assert self.null_block is not None
        gone = request.block_ids[request.num_slid_blocks:n]
        request.block_ids[request.num_slid_blocks:n] = [self.null_block] * len(gone)
        request.num_slid_blocks = n
        self.pool.free(reversed(gone))

    def fork(self, parent: Request, child: Request, computed: int) -> tuple[BlockId, BlockId] | None | bool:
        """`child` takes the blocks of `parent`'s first `computed` tokens: the full ones shared
        (a holder more each), the partial last one, which each will write its own tokens into,
        copied to a block of its own. Returns the (source, copy) the caller copies on the
        device, None when nothing needs copying, False when the pool has no block for the copy
        (nothing changed)."""
        num_full = computed // self.block_size
        copy: tuple[BlockId, BlockId] | None = None
        if computed % self.block_size:
            new = self.pool.allocate(1)
            if new is None:
                return False
            copy = (parent.block_ids[num_full], new[0])
        shared = parent.block_ids[:num_full]
        self.pool.touch(self._own(shared))
        child.block_ids = [*shared, *([copy[1]] if copy else [])]
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        child.num_slid_blocks = parent.num_slid_blocks
        return copy

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
        self.pool.free(reversed(self._own(request.block_ids)))
        request.block_ids = []
        request.num_cached_blocks = request.num_slid_blocks = 0

    def take_blocks(self, request: Request) -> list[BlockId]:
        """Detach the block table from the request (an explicit hand-off); caller frees later."""
        block_ids, request.block_ids = request.block_ids, []
        request.num_cached_blocks = request.num_slid_blocks = 0
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
        self.pool.free(reversed(self._own(block_ids)))
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

    def hold_new(self, holder: RequestId, num_blocks: int) -> list[BlockId] | None:
        """`num_blocks` fresh blocks held under `holder` (a fetch from the KV tier writes them)
        until `cache_held` or `release`; None when the pool has too few free."""
        if holder in self._held:
            raise ValueError(f"{holder} already holds blocks")
        block_ids = self.pool.allocate(num_blocks)
        if block_ids is not None:
            self._held[holder] = block_ids
        return block_ids

    def hold_cached(self, holder: RequestId, block_hashes: Sequence[BlockHash]) -> list[BlockId]:
        """The cached blocks of these hashes still in the pool, held under `holder` (an offload
        to the KV tier reads them) until `release`; in the order of `block_hashes`."""
        if holder in self._held:
            raise ValueError(f"{holder} already holds blocks")
        found = [b for b in map(self.pool.lookup, block_hashes) if b is not None]
        self.pool.touch(found, hit=False)
        self._held[holder] = found
        return found

    def cache_held(self, holder: RequestId, block_hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """The blocks `holder` holds now carry these hashes' KV (a fetch landed): registered in
        the prefix cache, then released (cached, free to claim or evict)."""
        block_ids = self._held.get(holder)
        if block_ids is None or len(block_ids) != len(block_hashes):
            raise ValueError(f"{holder} holds {len(block_ids or ())} blocks, not {len(block_hashes)}")
        self.pool.cache_blocks(block_ids, block_hashes, parent)
        self.release(holder)

    def held(self, request_id: RequestId) -> list[BlockId]:
        """The blocks held under `request_id`, in order (none: empty)."""
        return list(self._held.get(request_id, ()))

    @property
    def num_held(self) -> int:
        """Requests whose blocks are held."""
        return len(self._held)

    def check_holders(self, tables: Iterable[Sequence[BlockId]]) -> PoolUsage:
        """The pool's accounting, each block's ref count equal to the tables holding it: these
        (a table's null entries not counted) and the manager's own (held ones, the null block)."""
        own = [self._own(t) for t in [*tables, *self._held.values()]]
        return self.pool.check_holders([*own, *([[self.null_block]] if self.null_block is not None else [])])

    def _own(self, block_ids: list[BlockId]) -> list[BlockId]:
        """A table's blocks, its null entries left out."""
        if self.null_block is None:
            return block_ids
        return [b for b in block_ids if b != self.null_block]

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            start, prompt = len(request.block_hashes) * self.block_size, request.prompt_token_ids
            tail = (prompt[start:] + request.output_token_ids if start < len(prompt)
                    else request.output_token_ids[start - len(prompt):])
            self.hasher.extend_tail(request.block_hashes, tail, request.tenant)
