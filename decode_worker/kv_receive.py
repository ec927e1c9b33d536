"""Decode side of a hand-off: reserve blocks for remote prompts and admit them once their KV arrived.

Data flow: `reserve()` asks the engine for destination blocks (its cached prefix is
reused, so only missing blocks travel) and puts them under a kvfabric lease -> `Ticket`
for the router to hand to a prefill worker. `pump()` applies the receiver's events to
the engine through its connector (engine/kv_connector.py): `KVArrived` -> `landed` (the
request joins the continuous batch with its first token) -> `Landed`; `TransferFailed` ->
`end` (its blocks freed or, when a one-sided writer may still write, quarantined);
`BlocksFenced` -> `fenced` (the quarantined blocks freed).
An abort is the request's last word: the receiver drops its arrival or failure not yet
pumped (`FabricReceiver.cancel(final=True)`), so an aborted request, or one reserved again
under the same id, never sees a stale one. What the request holds is the engine's to know.
The engine's pool comes from `kvfabric.pools.kv_allocator`: shared memory on CPU (`shm`
senders on this host copy straight into it, others use `tcp`), an IPC-exportable
cudaMalloc on GPU (`cuda_ipc` on this host, `nccl` across hosts). A tensor-parallel
engine's followers keep their heads in pools of their own, in shared memory on CPU: the
receiver offers them all (`kvfabric.pools.memory_pools`), so each rank's heads land in its
own pool, from whichever prefill rank holds them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.outputs import RequestOutput
from engine.core.request import SamplingParams
from engine.types import RequestId
from kvfabric import FabricError, FabricReceiver, KVArrived, ReceiverConfig, Ticket, TransferFailed, settle
from kvfabric.pools import exports, memory_pools, worker_pools

if TYPE_CHECKING:  # annotations only: the module loads without torch (decode_worker/worker.py says why)
    from engine.llm_engine import LLMEngine
    from kvfabric.pools import KVAllocator


@dataclass(frozen=True)
class RemoteFailure:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Landed:
    """A request's KV and first token arrived; it joined the batch."""

    request_id: str
    output: RequestOutput
    """The engine's output for the first token (the prefill worker's)."""
    transfer_window_s: float
    """The transfer's open to its `ready`, on this worker's clock."""
    trace: str = ""
    """The sender's W3C traceparent from the kvfabric `open` (empty: none)."""


class RemoteKV:
    def __init__(self, engine: LLMEngine, allocator: KVAllocator | None, config: ReceiverConfig | None = None) -> None:
        """`allocator`: the one the engine's pool came from (`kvfabric.pools.kv_allocator`; one
        without an export, or None: a CPU pool not in shared memory, tcp and nixl only)."""
        self.engine = engine
        self.connector = engine.connector
        """The only way to the engine's blocks (engine/kv_connector.py)."""
        memory = self.connector.memory
        self.refusal: str | None = None
        """Why this worker takes no pushed KV (a split worker whose ranks' pools it cannot map)."""
        try:
            self.pools = memory_pools(memory)
        except FabricError as e:  # it prefills its own prompts; no sender passes the handshake of rank 0's heads
            self.refusal = str(e)
            self.pools = worker_pools(memory.model_id, memory.pool)
        self.block_size = memory.block_size
        offered = exports(allocator)
        if "shm" in offered:
            offered["shm_ranks"] = self.pools.segments
        self.receiver = FabricReceiver(self.pools.layout, self.pools.regions, config, engine.clock, **offered)
        self._results: list[Landed | RemoteFailure] = []
        """What the events `pump` is settling gave, until it returns them."""

    def reserve(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0, tenant: str = "", tenant_weight: float = 1.0,
    ) -> Ticket | None:
        """Destination blocks under a lease, or None when the pool cannot hold the prompt now."""
        res = self.connector.reserve(prompt, params, request_id, priority, tenant, tenant_weight)
        if res is None:
            return None
        return self.receiver.expect(res.request_id, [int(b) for b in res.block_ids], res.num_skip_blocks)

    def pump(self, timeout_s: float = 0.0) -> list[Landed | RemoteFailure]:
        """Apply transfer events to the engine (`kvfabric.settle`); returns arrivals and failures."""
        settle(self.receiver.poll(timeout_s), self)
        results, self._results = self._results, []
        return results

    # -- kvfabric.EventOwner: the receiver's events, on the engine thread ---------------------
    def arrived(self, ev: KVArrived) -> None:
        rid = RequestId(ev.request_id)
        for out in self.connector.landed(rid, ev.first_token_id, ev.choice_token_ids):
            self._results.append(Landed(rid, out, ev.arrived_at - ev.opened_at, ev.trace))

    def failed(self, ev: TransferFailed) -> None:
        self._ended(ev, writer_may_write=False)

    def quarantined(self, ev: TransferFailed) -> None:
        self._ended(ev, writer_may_write=True)

    def _ended(self, ev: TransferFailed, writer_may_write: bool) -> None:
        self.connector.end(ev.request_id, writer_may_write)
        self._results.append(RemoteFailure(ev.request_id, ev.reason))

    def fenced(self, request_id: str) -> None:
        self.connector.fenced(request_id)

    def abort(self, request_id: str) -> bool:
        """End a request in any state; blocks a sender may still write stay held until fenced."""
        held = self.receiver.cancel(request_id, final=True)
        return self.connector.end(request_id, writer_may_write=bool(held))

    def close(self) -> None:
        self.receiver.close()
        self.pools.close()
