"""A worker's side of its host's KV store (kvstore/store.py): what the pool caches is offered
to the store, what a prompt would compute is first looked for there.

    engine thread  each step's `stored` KV events -> `on_events`: offered to the store by the
                   offload lane (kvstore/offload.py), the blocks held until their push ends
    event loop     `admit(prompt, add)`, before the request joins the engine:
                     the prompt's block hashes (the hasher is pure: off the engine thread)
                     k blocks: the router's hint (its index of the store), else a Lookup;
                     staging slots (kvstore/staging.py, shared memory)
                     reserved on this worker's tier receiver -> Fetch: the store pushes them
                     into the slots and sends `ready`
                     engine thread, one call: pool blocks for the staged ones past the pool's
                     own run, filled, cached under their hashes, then `add`: the request finds
                     them as any prefix hit; the slots go back

Nothing here waits on the engine thread but the one call that adds the request, and the
engine thread never waits on the store: a fetch holds no pool block while it waits on the
network. A store that is down, slow or evicting costs one fetch: the request computes its
prompt as it would without a tier, with the same tokens. Fetched blocks are cached as
computed ones are, by the hashes of the tenant who asked: no other tenant's prompt finds them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from control.auth import TOKEN_METADATA
from control.tls import MemberTLS, member_channel, member_channel_sync, server_context
from control.heartbeat import StoreEntry, TierSpeed
from engine.core.block_pool import KVEvent
from engine.llm_engine import LLMEngine
from engine.types import BlockHash, RequestId
from kvfabric import FabricReceiver, KVArrived, ReceiverConfig, TransferFailed, settle
from kvfabric.pools import memory_pools, offers_nixl
from kvstore.host import find_store
from kvstore.pinned_rows import HostCopies
from kvstore.offload import Offloads
from kvstore.staging import Staging
from kvstore.tier_meters import FetchGate, FetchTimes, TierCounters
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import ticket_to_pb

logger = logging.getLogger(__name__)

LONG_PROMPT_TOKENS = 4096
"""A prompt longer than this is hashed on a worker thread (hashing takes about 0.3 ms per 4k tokens)."""

HOST_ROWS = 32
"""Host rows (pinned) a device pool's offloads go through (kvstore/pinned_rows.py): 64 MiB of
Llama-3-8B's bfloat16 blocks of 16 tokens."""

RESOLVE_EVERY_S = 5.0
"""Least time between two searches for a store that went away."""

T = TypeVar("T")

EngineCall = Callable[[Callable[[LLMEngine], Any]], "concurrent.futures.Future[Any]"]
"""Runs a function on the engine thread (EngineLoop.call)."""


class KVTier:
    def __init__(self, engine: LLMEngine, call: EngineCall, address: str, token: str | None = None,
                 tls: MemberTLS | None = None, host: str = "127.0.0.1", advertise_host: str | None = None, timeout_s: float = 5.0,
                 min_blocks: int = 1, max_offload_blocks: int = 4096, store_id: str = "",
                 resolve: Callable[[], StoreEntry | None] | None = None, staging_blocks: int = 1024,
                 through_host: bool | None = None, kv_transport: str | None = None) -> None:
        """`address`: the store's gRPC host:port; `store_id`: its KV event stream's id
        (heartbeats name it, routers index it); `resolve`: finds the host's store again after it
        went away (a restarted store listens elsewhere); `staging_blocks`: how many fetched
        blocks may wait for the engine at once (more: a fetch is skipped); `through_host`: the
        pool's blocks cross host rows of their own (kvstore/pinned_rows.py) both ways, as a GPU
        pool's must (None: where the pool is on a GPU); `tls`: the worker's identity for mutual TLS
        with the store (None: plain); `kv_transport`: the worker's (nixl: fetches land and
        offloads leave through NIXL)."""
        self.engine, self.call, self.address, self.store_id = engine, call, address, store_id
        self.resolve = resolve
        self._resolved_at = 0.0
        self.timeout_s, self.min_blocks = timeout_s, min_blocks
        self.metadata = ((TOKEN_METADATA, token),) if token else ()
        self.tls = tls
        memory = engine.connector.memory
        self.pools = memory_pools(memory)
        self.pools.local("the KV tier")
        self.staging = Staging(self.pools, staging_blocks)
        """Where fetched blocks land before the engine copies them into its pool."""
        if through_host is None:
            through_host = memory.on_gpu
        if through_host and self.pools.layout.world > 1:
            raise ValueError("a split worker's pools on GPUs stay private to their ranks: run it without the KV tier")
        self.host = HostCopies(memory.pool.tensor, HOST_ROWS) if through_host else None
        """A device pool's way to and from host memory (None: the pool is host memory)."""
        self.receiver = FabricReceiver(self.staging.layout, self.staging.region, ReceiverConfig(
            host=host, advertise_host=advertise_host, token=token, tls=server_context(tls),
            nixl=offers_nixl("cpu", kv_transport)), shm=self.staging.segment)
        self.counters = TierCounters()
        self.times = FetchTimes()
        self.gate = FetchGate(self.times, lambda: engine.prefill_cost.token_s, memory.block_size)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._fetches: dict[str, concurrent.futures.Future[Any]] = {}
        """Fetch id -> its receiver event (KVArrived or TransferFailed), set by the events thread."""
        self._staged: dict[str, list[int]] = {}
        """Fetch id -> its staging slots, until they are copied or given back."""
        self._stub: pb_grpc.KVStoreStub | None = None
        self._aio_channel: grpc.aio.Channel | None = None
        self._far: dict[str, pb_grpc.KVStoreStub] = {}
        self._far_channels: list[grpc.aio.Channel] = []
        self._stop = threading.Event()
        self.offloads = Offloads(call, self.pools, self.host, self.counters, lambda: self.address, token, tls, kv_transport,
                                 self.metadata, timeout_s, max_offload_blocks)
        self._events = threading.Thread(target=self._receiver_events, name="kvtier-events", daemon=True)
        self._events.start()

    # -- fetch (the worker's event loop) -----------------------------------------------------
    async def admit(self, prompt: Sequence[int], tenant: str, add: Callable[[LLMEngine], T],
                    hint: Any = None) -> T:
        """`add` (the request joining the engine) run on the engine thread right after the
        blocks a store held for `prompt` were copied into the pool and cached there: nothing
        can evict them in between. `hint`: the router's `StoreHint` (where the blocks are)."""
        landing = await self._fetch(prompt, tenant, hint)

        def land_then_add(e: LLMEngine) -> T:
            if landing is not None:
                self._land(e, landing)
            return add(e)
        # shielded: a call cancelled now still lands (the slots go back) and adds its request,
        # which the caller's own cleanup, queued after this, aborts
        return await asyncio.shield(asyncio.wrap_future(self.call(land_then_add)))

    async def _fetch(self, prompt: Sequence[int], tenant: str, hint: Any = None) -> _Landing | None:
        """The store's blocks of the prompt past the pool's run (as the router saw it: from
        `hint.pool_blocks`, else from the first) in staging slots; None: nothing was fetched."""
        # the hasher is pure: hashed off the engine thread, and a long prompt off the event loop too
        hashes = _prompt_hashes(self.engine, prompt, tenant) if len(prompt) <= LONG_PROMPT_TOKENS else \
            await asyncio.to_thread(_prompt_hashes, self.engine, prompt, tenant)
        if not hashes:
            return None
        if hint is not None and not hint.num_blocks:  # the router saw none of them in any store: no lookup
            self.counters.num_skipped_lookups += 1
            return None
        start = min(hint.pool_blocks, len(hashes)) if hint is not None else 0
        far = hint is not None and bool(hint.address) and hint.store_id != self.store_id
        stub = self._far_store(hint.address) if far else self._store()
        began = time.perf_counter()
        held_there = await self._held(stub, hashes, hint, far)
        if held_there is None or held_there - start < self.min_blocks:
            return None
        if not self.gate.pays(far, held_there - start):
            self.counters.num_fetches_priced_out += 1
            return None
        slots = self.staging.take(held_there - start)
        if slots is None:
            self.counters.num_staging_full += 1
            return None
        fid = RequestId(f"kvstore-fetch-{next(self._ids)}")
        if not await self._pull(stub, far, fid, slots, hashes[start:held_there]):
            return None
        self.times.observe(far, len(slots), time.perf_counter() - began)
        if far:
            self.counters.num_far_fetched_blocks += len(slots)
        return _Landing(fid, hashes[:held_there], start, slots)

    async def _held(self, stub: pb_grpc.KVStoreStub, hashes: list[BlockHash], hint: Any, far: bool) -> int | None:
        """How many of the prompt's leading blocks the store holds: the router's index of it
        (its event stream, in the hint) stands for a lookup; None: the lookup failed."""
        if hint is not None:
            return min(hint.num_blocks, len(hashes))
        try:
            reply = await stub.Lookup(pb.LookupRequest(block_hashes=hashes), timeout=self.timeout_s,
                                      metadata=self.metadata)
        except grpc.RpcError as e:
            await self._unavailable(e, far)
            self._failed(f"lookup: {e.code().name}")
            return None
        return min(reply.num_blocks, len(hashes))

    async def _pull(self, stub: pb_grpc.KVStoreStub, far: bool, fid: RequestId, slots: list[int],
                    hashes: list[BlockHash]) -> bool:
        """The store pushes the blocks of `hashes` into the staging `slots`; whether they
        arrived (if not, the slots go back: now, or on the store writer's fence)."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._fetches[fid] = done
            self._staged[fid] = slots
        self.counters.num_fetches += 1
        try:
            ticket = self.receiver.expect(fid, slots, 0)
            try:
                answer = await stub.Fetch(pb.FetchRequest(ticket=ticket_to_pb(ticket), block_hashes=hashes),
                                          timeout=self.timeout_s, metadata=self.metadata)
                error = answer.error
            except grpc.RpcError as e:
                await self._unavailable(e, far)
                error = f"fetch: {e.code().name}"
            event, held = await self._outcome(fid, done, error)
        except BaseException:  # the call was cancelled (or a bug): its slots back, now or on the fence
            with self._lock:
                self._fetches.pop(fid, None)
            if not self.receiver.cancel(fid, "the request ended"):
                self._unstage(fid)
            raise
        if isinstance(event, KVArrived):
            return True
        self._failed(error or f"fetch: {type(event).__name__ if event else 'no answer'}")
        if not held:  # else the slots go back on the writer's fence (the events thread)
            self._unstage(fid)
        return False

    async def _outcome(self, fid: str, done: concurrent.futures.Future[Any], error: str) -> tuple[Any, bool]:
        """The fetch's receiver event (None: none came) and whether its slots stay held until
        the store's writer is fenced."""
        held: bool | None = None
        if error:  # the store gave up: revoke what it may still hold open
            held = self.receiver.cancel(fid, error)
        if held is None:  # nothing active: the event came, or comes now
            try:
                event = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), self.timeout_s)
                return event, isinstance(event, TransferFailed) and event.blocks_held
            except TimeoutError:
                held = self.receiver.cancel(fid, "no answer from the store")
        with self._lock:
            self._fetches.pop(fid, None)
        if done.done():
            event = done.result()
            return event, isinstance(event, TransferFailed) and event.blocks_held
        return None, bool(held)

    def _failed(self, why: str) -> int:
        self.counters.num_fetch_failures += 1
        logger.debug("kv store %s: computing instead (%s)", self.address, why)
        return 0

    def _unstage(self, fid: str) -> None:
        with self._lock:
            slots = self._staged.pop(fid, None)
        if slots:
            self.staging.give(slots)

    def _land(self, e: LLMEngine, landing: _Landing) -> int:
        """Engine thread: the staged blocks past the pool's run now, in fresh pool blocks,
        cached under their hashes; the slots back. Returns the blocks that landed."""
        try:
            run = e.connector.cached_run(landing.hashes)
            if run < landing.start or run >= len(landing.hashes):  # a gap before them (evicted meanwhile), or nothing new
                return 0
            fid = landing.fid
            blocks = e.connector.lend_new(fid, len(landing.hashes) - run)
            if blocks is None:
                return 0
            slots, block_ids = landing.slots[run - landing.start:], [int(b) for b in blocks]
            if self.host is not None:  # one rank, whole blocks: the staged rows as they are
                self.host.upload(self.staging.region.array[slots], block_ids)
            else:
                self.staging.copy_into(self.pools, slots, block_ids)
            e.connector.publish(fid, landing.hashes[run:], landing.hashes[run - 1] if run else None)
            self.counters.num_fetched_blocks += len(blocks)
            return len(blocks)
        finally:
            self._unstage(landing.fid)

    def _store(self) -> pb_grpc.KVStoreStub:
        if self._stub is None:  # on the worker's event loop, where its calls run
            self._aio_channel = member_channel(self.address, self.tls)
            self._stub = pb_grpc.KVStoreStub(self._aio_channel)
        return self._stub

    def _far_store(self, address: str) -> pb_grpc.KVStoreStub:
        """Another host's store (the router's hint): one channel each, kept (a few hosts' stores)."""
        stub = self._far.get(address)
        if stub is None:
            channel = member_channel(address, self.tls)
            self._far_channels.append(channel)
            stub = self._far[address] = pb_grpc.KVStoreStub(channel)
        return stub

    async def _unavailable(self, e: grpc.RpcError, far: bool) -> None:
        """A call to the host's store that found nobody: look for the store again."""
        if e.code() == grpc.StatusCode.UNAVAILABLE and not far:
            await self._find_again()

    async def _find_again(self) -> None:
        """The store did not answer: look for the host's store again (at most every 5 s); a new
        address replaces the old one here and, from its next offer, on the offload lane."""
        if self.resolve is None or time.monotonic() - self._resolved_at < RESOLVE_EVERY_S:
            return
        self._resolved_at = time.monotonic()
        entry = await asyncio.to_thread(self.resolve)
        if entry is None or entry.address == self.address:
            return
        logger.info("kv store: %s replaces %s", entry.address, self.address)
        old, self._aio_channel, self._stub = self._aio_channel, None, None
        self.address, self.store_id = entry.address, entry.store_id
        if old is not None:
            await old.close()

    def heartbeat(self) -> tuple[str, TierSpeed]:
        """The store the worker fetches from, and what it measured of fetching against computing."""
        near, far = self.times.lines
        return self.store_id, TierSpeed(self.engine.prefill_cost.token_s, list(near or ()), list(far or ()))

    def on_events(self, e: LLMEngine, events: list[KVEvent]) -> None:
        """Engine thread, with each step's KV events: what the pool newly cached, offered to
        the store (kvstore/offload.py)."""
        self.offloads.on_events(e, events)

    # -- the receiver's events ----------------------------------------------------------------
    def _receiver_events(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.receiver.poll(0.2)
            except Exception:  # noqa: BLE001  (closed under us)
                return
            settle(events, self)

    # kvfabric.EventOwner: a fetch's event answers its `_pull`, which gives back the slots of
    # one that failed; a quarantined fetch's slots come back when its writer is fenced
    def arrived(self, ev: KVArrived) -> None:
        self._answer(ev)

    def failed(self, ev: TransferFailed) -> None:
        self._answer(ev)

    def quarantined(self, ev: TransferFailed) -> None:
        self._answer(ev)

    def fenced(self, request_id: str) -> None:
        self._unstage(request_id)

    def _answer(self, ev: KVArrived | TransferFailed) -> None:
        with self._lock:
            done = self._fetches.pop(ev.request_id, None)
        if done is not None and not done.done():
            done.set_result(ev)

    async def close(self) -> None:
        self._stop.set()
        self.offloads.close()
        if self._aio_channel is not None:
            await self._aio_channel.close()
        for channel in self._far_channels:
            await channel.close()
        self.receiver.close()
        self.staging.close()
        self.pools.close()


def start_tier(engine: LLMEngine, call: EngineCall, kv_store: str | None, redis_url: str | None, namespace: str,
               token: str | None, tls: MemberTLS | None, host: str, advertise_host: str | None,
               seal_key: bytes | None = None, kv_transport: str | None = None) -> KVTier | None:
    """A worker's tier: `kv_store` "local" (this host's store, from Redis: its entry must be
    sealed with `seal_key`, when given) or HOST:PORT; None when none is configured or none is
    registered for this host (then it serves without one)."""
    if not kv_store:
        return None
    if kv_store == "local":
        entry = find_store(redis_url, namespace, seal_key=seal_key)
        if entry is None:
            logger.warning("no KV store is registered for this host: serving without the shared KV tier")
            return None
        return KVTier(engine, call, entry.address, token, tls, host, advertise_host, store_id=entry.store_id,
                      resolve=lambda: find_store(redis_url, namespace, timeout_s=0, seal_key=seal_key),
                      kv_transport=kv_transport)
    return KVTier(engine, call, kv_store, token, tls, host, advertise_host,
                  store_id=_store_id(kv_store, token, tls), kv_transport=kv_transport)


def _store_id(address: str, token: str | None, tls: MemberTLS | None) -> str:
    """A store named by address: its id, from its Stats (empty when it does not answer now)."""
    try:
        with member_channel_sync(address, tls) as channel:
            metadata = ((TOKEN_METADATA, token),) if token else ()
            return str(pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=5, metadata=metadata).store_id)
    except grpc.RpcError as e:
        logger.warning("kv store %s did not answer (%s): its blocks stay out of the routers' view", address,
                       e.code().name)
        return ""


@dataclass(frozen=True)
class _Landing:
    """A fetch that arrived: the prompt's hashes through the store's run, the first of them
    staged (`start`), and the staging slots of those from `start` on."""

    fid: str
    hashes: list[BlockHash]
    start: int
    slots: list[int]


def _prompt_hashes(e: LLMEngine, prompt: Sequence[int], tenant: str) -> list[BlockHash]:
    """The hashes of the prompt's full blocks that could be a prefix hit (at least one token
    is always computed); none when the engine caches no prefix. The hasher and the engine's
    block size are fixed at its start: any thread may read them."""
    if not e.config.cache.enable_prefix_caching:
        return []
    bs = e.config.cache.block_size
    limit = (len(prompt) - 1) // bs
    return e.hasher.hash_prompt(list(prompt[:limit * bs]), tenant) if limit > 0 else []
