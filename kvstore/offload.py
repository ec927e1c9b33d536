"""A worker's offloads to its host's KV store: what its pool caches goes on living there.

    engine thread  each step's `stored` KV events -> `on_events`: the blocks held under a
                   holder of their own (KVCacheManager.hold_cached, off the engine's requests;
                   the pool's eviction order is not changed) and queued
    the lane       Offer(hashes) -> the blocks the store wants, pushed over kvfabric (a device
                   pool's through host rows, kvstore/pinned_rows.py) -> `ready`
                   -> the hold released on the engine thread, whatever happened

At most `max_blocks` blocks are held for offloads at once; past that, newly cached blocks are
not offered (counted): a slow store costs what it does not get, never the pool's room.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.core.block_pool import KVEvent
from engine.llm_engine import LLMEngine
from engine.types import BlockHash, RequestId
from control.tls import MemberTLS, client_context, member_channel_sync
from kvfabric import FabricError, FabricSender, SenderConfig
from kvfabric.pools import WorkerPools
from kvstore.pinned_rows import HostCopies
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import ticket_from_pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offer:
    """Blocks the engine thread lent for one offload, queued for the lane."""

    holder: RequestId
    """The id they are held under (given back when the lane is done with them)."""
    hashes: list[BlockHash]
    blocks: list[int]
    """The pool's block ids, in the order of `hashes`."""


class Offloads:
    def __init__(self, call: Callable[[Callable[[LLMEngine], Any]], Any], pools: WorkerPools,
                 host: HostCopies | None, counters: Any, address: Callable[[], str], token: str | None,
                 tls: MemberTLS | None, transport: str | None, metadata: tuple[tuple[str, str], ...], timeout_s: float,
                 max_blocks: int) -> None:
        """`call`: runs a function on the engine thread; `counters`: the tier's (offered,
        offloaded, failures, skipped); `address`: the store's gRPC address now (it changes when
        the tier finds a restarted store)."""
        self.call, self.pools, self.host, self.counters, self.address = call, pools, host, counters, address
        self.metadata, self.timeout_s, self.max_blocks, self.tls = metadata, timeout_s, max_blocks, tls
        self.sender = FabricSender(pools.layout, [host.region] if host else pools.regions,
                                   SenderConfig(token=token, tls=client_context(tls), transport=transport))
        self.held = 0
        """Engine thread: blocks held for offloads now."""
        self._ids = itertools.count(1)
        self._queue: queue.SimpleQueue[Offer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._lane, name="kvtier-offload", daemon=True)
        self._thread.start()

    def on_events(self, e: LLMEngine, events: list[KVEvent]) -> None:
        """Engine thread, with each step's KV events: newly cached blocks held and queued."""
        for ev in events:
            if ev.kind != "stored":
                continue
            if self.held >= self.max_blocks:
                self.counters.num_offload_skipped += len(ev.block_hashes)
                continue
            hid = RequestId(f"kvstore-offload-{next(self._ids)}")
            lent = e.connector.lend_cached(hid, ev.block_hashes)
            if not lent:
                continue
            self.held += len(lent)
            self._queue.put(Offer(hid, [h for _, h in lent], [int(b) for b, _ in lent]))

    def close(self) -> None:
        self._queue.put(None)
        self.sender.close()

    def _lane(self) -> None:
        address = self.address()
        channel = member_channel_sync(address, self.tls)
        stub = pb_grpc.KVStoreStub(channel)
        try:
            while (offer := self._queue.get()) is not None:
                if address != self.address():  # the store moved (KVTier._find_again)
                    channel.close()
                    address = self.address()
                    channel = member_channel_sync(address, self.tls)
                    stub = pb_grpc.KVStoreStub(channel)
                try:
                    self._offload(stub, offer.hashes, offer.blocks)
                except (grpc.RpcError, FabricError, ValueError) as e:
                    self.counters.num_offload_failures += 1
                    logger.debug("kv store %s: offload of %d blocks failed: %s", address, len(offer.blocks), e)
                finally:
                    self.call(self._unholder(offer.holder, len(offer.blocks)))
        finally:
            channel.close()

    def _offload(self, stub: pb_grpc.KVStoreStub, hashes: list[BlockHash], blocks: list[int]) -> None:
        self.counters.num_offered_blocks += len(hashes)
        reply = stub.Offer(pb.OfferRequest(block_hashes=hashes), timeout=self.timeout_s, metadata=self.metadata)
        if not reply.HasField("ticket"):
            return
        transfer = self.sender.open(ticket_from_pb(reply.ticket))
        wanted = [blocks[i] for i in reply.wanted]
        try:
            if self.host is None:
                transfer.push(wanted, 0)
            else:  # through the host rows, a turn of them at a time (a push has read its rows when it returns)
                step = self.host.capacity
                for first in range(0, len(wanted), step):
                    turn = wanted[first:first + step]
                    self.host.download(turn)
                    transfer.push(list(range(len(turn))), first)
            transfer.finish(0, len(wanted) * self.pools.layout.block_size)
        except BaseException:
            transfer.abort("the worker's offload failed")
            raise
        self.counters.num_offloaded_blocks += len(reply.wanted)

    def _unholder(self, hid: RequestId, n: int) -> Callable[[LLMEngine], None]:
        def unhold(e: LLMEngine) -> None:
            e.connector.give_back(hid)
            self.held -= n
        return unhold
