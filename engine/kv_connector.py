"""The engine's one seam for KV that moves into or out of it (after vLLM v1's connector split,
our own): the P/D hand-off on both roles and the KV tier's fetches and offloads go through a
`KVConnector`, never into the engine's pool, block pool or cache manager.

One owner of a block's life: the engine's KVCacheManager. A mover borrows blocks under a holder
id (a request's id, or a fetch's or an offload's own) and gives them back here; kvfabric's
reservations hold ids lent this way, nothing more.

- Scheduler side, KV that arrives from elsewhere:
  - `reserve`: destination blocks for a prompt prefilled elsewhere (the request waits for them);
  - `landed`: they hold the prompt's KV, the first token came with it;
  - `end`: the request ends before or after its KV landed (the transfer failed, the client
    went away); with `writer_may_write` (a one-sided writer was not fenced yet) its blocks stay
    quarantined until `fenced` says the writer can write no more;
  - the KV tier's `lend_new`, `cached_run` and `publish`: a fetch lands in fresh blocks, which
    join the prefix cache.
- Worker side, KV that leaves:
  - `lend`: a push reads the request's blocks whatever becomes of the request meanwhile;
  - the KV tier's `lend_cached`: an offload reads cached blocks;
  - `give_back` ends any loan (a push done, a fence, an offload or fetch over).
- `memory`: where the KV lives, for a transfer layer to register or map (`KVMemory`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.block_pool import BlockHash, BlockId
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import RemoteBlocks, RequestOutput
from engine.core.request import SamplingParams
from engine.types import InvalidRequestError, RequestId

if TYPE_CHECKING:  # annotations only: the simulator's engine loads this without torch
    from engine.model.kv_pool import KVPool
    from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class KVMemory:
    """Where an engine's KV lives, as a transfer layer registers or maps it."""

    model_id: str
    pool: KVPool
    """Rank 0's pool (the only one without tensor parallelism)."""
    num_kv_heads: int
    """The model's KV heads (all ranks together)."""
    shards: tuple[int, ...]
    """The first of the model's KV heads in each rank's pool."""
    followers: tuple[dict[str, Any], ...]
    """The other ranks' pools as each exported them ({}: not exported, a GPU rank's)."""

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def on_gpu(self) -> bool:
        return self.pool.tensor.device.type == "cuda"


class KVLoans:
    """Blocks lent to whoever moves KV, over one KVCacheManager (`kv()`: the manager now; an
    engine attaches a new one when it sizes its pool). The KV tier's and a push's half of the
    seam; the simulator's engine (sim/engine_sim.py) plugs in here too. Every method runs on
    the engine's thread, as the engine's own verbs do."""

    def __init__(self, kv: Callable[[], KVCacheManager], abort: Callable[[str], bool]) -> None:
        """`abort`: the engine's own, for `end`."""
        self._kv = kv
        self._abort = abort

    # -- KV that leaves: a prefill's push -------------------------------------------------------
    def lend(self, request_id: str) -> None:
        """A push reads the request's blocks (whether or not the request is here yet) until
        `give_back`: if the request ends or is preempted meanwhile, they are held."""
        self._kv().begin_transfer(RequestId(request_id))

    # -- the KV tier ----------------------------------------------------------------------------
    def cached_run(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of these leading hashes the pool has cached now."""
        return len(self._kv().pool.lookup_run(block_hashes))

    def lend_new(self, holder: str, num_blocks: int) -> list[BlockId] | None:
        """Fresh blocks for a fetch to fill, until `publish` or `give_back`; None: too few free."""
        return self._kv().hold_new(RequestId(holder), num_blocks)

    def publish(self, holder: str, block_hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """The blocks `holder` borrowed now hold these hashes' KV: they join the prefix cache
        (after `parent`) and the loan ends."""
        self._kv().cache_held(RequestId(holder), block_hashes, parent)

    def lend_cached(self, holder: str, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockId, BlockHash]]:
        """Those of these hashes' blocks still cached, for an offload to read until `give_back`
        (none: no loan), in the order of `block_hashes`."""
        kv, rid = self._kv(), RequestId(holder)
        blocks = kv.hold_cached(rid, block_hashes)
        if not blocks:
            kv.release(rid)
        hashes = [kv.pool.block_hash(b) for b in blocks]
        return [(b, h) for b, h in zip(blocks, hashes, strict=True) if h is not None]  # all: found by their hashes

    # -- any loan ---------------------------------------------------------------------------------
    def give_back(self, holder: str) -> bool:
        """The mover is done with what `holder` borrowed (a push done, an offload or a fetch
        over): the blocks go back to the pool (a request still running keeps its own). True
        when any were held."""
        return self._kv().end_transfer(RequestId(holder))

    def end(self, request_id: str, writer_may_write: bool = False) -> bool:
        """The request ends in any state (its transfer failed, or it was aborted). While a
        one-sided writer may still write its blocks (`writer_may_write`), they stay quarantined
        until `fenced`; else they are free now. True when it or its held blocks were here."""
        if writer_may_write:
            self.lend(request_id)
        return self._abort(request_id)

    def fenced(self, request_id: str) -> bool:
        """The writer of a failed transfer can write no more: its quarantined blocks back."""
        return self.give_back(request_id)

    @property
    def num_lent(self) -> int:
        """Holders whose blocks are lent out now."""
        return self._kv().num_held


class KVConnector(KVLoans):
    """One LLMEngine's seam (`LLMEngine.connector`): its loans, where its KV lives, and the
    decode side of the hand-off. Every method runs on the engine's thread."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(lambda: engine.kv, engine.abort)
        self._engine = engine

    @property
    def memory(self) -> KVMemory:
        e = self._engine
        return KVMemory(e.model_id, e.kv_pool, e.model_config.num_kv_heads, e.kv_shards, tuple(e.follower_pools))

    # -- KV that arrives: a remote prefill -----------------------------------------------------
    def reserve(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                priority: int = 0, tenant: str = "", tenant_weight: float = 1.0) -> RemoteBlocks | None:
        """A request whose prompt's KV is computed elsewhere, waiting in blocks reserved here
        (past its cached prefix); None when the pool cannot hold the prompt now."""
        e = self._engine
        request = e._new_request(prompt, params, request_id, priority, tenant, tenant_weight)
        if not e.scheduler.add_remote_request(request):
            e.outputs.forget(request.request_id)
            return None
        return RemoteBlocks(request.request_id, list(request.block_ids), request.num_cached_tokens,
                            request.num_cached_blocks)

    def landed(self, request_id: RequestId, first_token_id: int,
               choice_tokens: Sequence[int] = ()) -> list[RequestOutput]:
        """The reserved blocks hold the prompt's KV; the first token came with it, and with n
        choices the others' first tokens (`choice_tokens`): it forks into them here."""
        e = self._engine
        request = e.scheduler.requests.get(request_id)
        if request is None:
            raise InvalidRequestError(f"unknown request {request_id}")
        outputs = []
        for r in e.forks.landed(request, first_token_id, choice_tokens):
            e.stop_if_complete(r, 1)  # a constrained request's matcher takes the first token
            outputs.append(e.outputs.output(r, e.scheduler, e.role))
        return outputs
