"""The shared KV tier: blocks a worker computed live on in its host's KV store after its pool
evicted them, and any worker on the host fetches them instead of computing them again, with
the tokens of a recompute; another tenant's prompt never finds them; a store that dies
mid-fetch costs only the fetch, and a restarted one is found again through Redis; a worker
split over ranks offloads and fetches each rank's heads. After each test no block is held in
any pool, no slot of the store is unaccounted for, and no reservation is left on either side.

Workers are engines on their loops with a `KVTier` (tests/integration/tier_peer.py); the
store serves its gRPC API here, or in a child process the test kills.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from engine.core.request import SamplingParams
from kvstore.service import open_store, serve, store_layout
from kvstore.store import KVStore
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.conftest import skip_without_nixl
from tests.integration.fabric_peer import Peer
from tests.integration.reference import make_engine, random_prompts
from tests.integration.tier_peer import TierWorker, cached_run, store_main

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 6
BLOCK = 4


def reference_tokens(model_dir: str, prompts: list[list[int]], kv_cache_dtype: str = "auto") -> list[list[int]]:
    engine = make_engine(model_dir, caching=False, kv_cache_dtype=kv_cache_dtype)
    return [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@contextlib.asynccontextmanager
async def served_store(model_dir: str, capacity_blocks: int, num_workers: int, pool_blocks: int = 40,
                       disk_dir: str | None = None, disk_blocks: int = 0, device: str = "cpu",
                       kv_transport: str | None = None, kv_cache_dtype: str = "auto"
                       ) -> AsyncIterator[tuple[KVStore, tuple]]:
    """A store of `capacity_blocks` (and `disk_blocks` spilled in `disk_dir`) serving here, and
    `num_workers` workers of `pool_blocks` on `device` using it; all closed after. `kv_transport`:
    the store's and the workers' (nixl: offloads and fetches through NIXL); `kv_cache_dtype`: theirs."""
    layout = store_layout(model_dir, make_engine(model_dir, num_blocks=8).model_id, BLOCK, "float32",
                          kv_cache_dtype=kv_cache_dtype)
    store = open_store(layout, capacity_blocks * layout.block_bytes, "127.0.0.1", None, None, disk_dir=disk_dir,
                       disk_bytes=disk_blocks * layout.block_bytes, kv_transport=kv_transport)
    server, port = await serve(store, "127.0.0.1", 0, None)
    workers = tuple(TierWorker(model_dir, f"127.0.0.1:{port}", num_blocks=pool_blocks, device=device,
                               kv_transport=kv_transport, kv_cache_dtype=kv_cache_dtype) for _ in range(num_workers))
    try:
        yield store, workers
    finally:
        for w in workers:
            await w.close()
        await server.stop(0)
        store.close()


async def wait_for(check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kv_transport,kv_cache_dtype", [(None, "auto"), ("nixl", "auto"), (None, "fp8")])
def test_an_evicted_prefix_comes_back_from_the_store_with_the_tokens_of_a_recompute(
        tiny_llama_dir: str, kv_transport: str | None, kv_cache_dtype: str) -> None:
    """(fp8: the pools' e4m3 blocks, half the bytes, stored and fetched back as they are.)"""
    skip_without_nixl(kv_transport)
    prompt, *others = random_prompts([41, 38, 38, 38, 38], 512, seed=3)
    want, *_ = reference_tokens(tiny_llama_dir, [prompt], kv_cache_dtype)

    async def run() -> None:
        async with served_store(tiny_llama_dir, 4096, 2, kv_transport=kv_transport,
                                kv_cache_dtype=kv_cache_dtype) as (store, (a, b)):
            if kv_cache_dtype == "fp8":
                assert store.layout.dtype_bytes == 1 and store.layout.model_id.endswith("+kv-fp8")
            assert await a.generate(prompt) == (0, want, 0)  # the store is empty: computed, then offered
            await wait_for(lambda: asyncio.sleep(0, store.lookup(a.engine.hasher.hash_prompt(prompt)[:10]) == 10))
            for other in others:  # 40 blocks of pool: these evict the first prompt's blocks
                await a.generate(other)
            assert await a.on_engine(lambda e: cached_run(e, prompt)) == 0
            # its 10 full blocks (the 41st token is computed) come from the store, into the pool's cache
            assert await a.generate(prompt) == (10, want, 40)
            assert await b.generate(prompt) == (10, want, 40)  # another worker of the host fetches them too
            assert await b.generate(prompt, tenant="t2") == (0, want, 0)  # another tenant's hashes: not found
            for w in (a, b):
                await w.settled()
                assert w.tier.counters.num_fetch_failures == 0
                # what its heartbeat tells routers: one fetch of 10 blocks timed (no slope yet:
                # its seconds as the line's fixed part), none from another host, and its prefill
                store_id, speed = w.tier.heartbeat()
                assert store_id == w.tier.store_id and len(speed.fetch) == 2 and speed.fetch[1] == 0.0
                assert 0 < speed.fetch[0] < 5 and not speed.far_fetch and 0 < speed.token_s < 1
            stats = await pb_grpc.KVStoreStub(a.tier._aio_channel).Stats(pb.StatsRequest())
            assert stats.num_fetched == 20 and stats.num_hit_blocks >= 20 and stats.num_stored >= 10 + 4 * 9
            assert stats.bytes_out == 20 * store.layout.block_bytes
            store.check()
            assert store.receiver.num_reservations() == 0
            if kv_transport == "nixl":  # offloads into the store and fetches out of it, both through NIXL
                assert {p.transport for p in a.tier.offloads.sender._peers.values()} == {"nixl"}
                assert {p.transport for p in store.sender._peers.values()} == {"nixl"}

    asyncio.run(run())


def test_the_routers_hint_stands_for_the_lookup_and_a_stale_one_costs_only_the_fetch(tiny_llama_dir: str) -> None:
    """A worker routed with a hint (the router's index of the store: 10 blocks) fetches them
    with no lookup; a hint the store no longer backs fails the fetch, and the prompt is
    computed with the tokens of a recompute, nothing held after."""
    prompt, other = random_prompts([41, 38], 512, seed=3)
    want, want_other = reference_tokens(tiny_llama_dir, [prompt, other])

    async def run() -> None:
        async with served_store(tiny_llama_dir, 4096, 2) as (store, (a, b)):
            await a.generate(prompt)  # computed, then offered
            await wait_for(lambda: asyncio.sleep(0, store.lookup(a.engine.hasher.hash_prompt(prompt)[:10]) == 10))
            lookups = store.stats.num_lookups
            hint = pb.StoreHint(store_id=b.tier.store_id, num_blocks=10, pool_blocks=0)
            assert await b.generate(prompt, hint=hint) == (10, want, 40)
            assert store.stats.num_lookups == lookups and store.stats.num_fetched == 10  # one call: the fetch
            stale = pb.StoreHint(store_id=b.tier.store_id, num_blocks=9, pool_blocks=0)  # blocks it never held
            assert await b.generate(other, hint=stale) == (0, want_other, 0)
            assert b.tier.counters.num_fetch_failures == 1 and store.stats.num_fetch_failures == 1
            for w in (a, b):
                await w.settled()
            store.check()
            assert store.receiver.num_reservations() == 0

    asyncio.run(run())


def test_a_full_store_evicts_a_conversations_later_blocks_before_its_first(tiny_llama_dir: str) -> None:
    """A store of 12 blocks, a 9-block conversation and then a 6-block one: the second needs
    3 slots, taken from the first's tail; the first's leading blocks are still a hit."""
    first, second = random_prompts([37, 25], 512, seed=8)

    async def run() -> None:
        async with served_store(tiny_llama_dir, 12, 1) as (store, (w,)):
            hashes = w.engine.hasher.hash_prompt
            await w.generate(first, max_tokens=1)
            await wait_for(lambda: asyncio.sleep(0, store.num_blocks == 9))
            await w.generate(second, max_tokens=1)
            await wait_for(lambda: asyncio.sleep(0, store.lookup(hashes(second)) == 6))
            assert store.lookup(hashes(first)) == 6  # its first 6 of 9 blocks: the last 3 went
            assert store.stats.num_evicted == 3
            await w.settled()
            store.check()

    asyncio.run(run())


def test_a_store_killed_mid_fetch_costs_only_the_fetch(tiny_llama_dir: str) -> None:
    prompt, = random_prompts([41], 512, seed=5)
    want, = reference_tokens(tiny_llama_dir, [prompt])
    model_id = make_engine(tiny_llama_dir, num_blocks=8).model_id
    peer = Peer(store_main, tiny_llama_dir, model_id, 4, 3.0)  # each fetch's copy waits 3 s: time to kill it
    address = f"127.0.0.1:{peer.hello}"

    async def run() -> None:
        a = TierWorker(tiny_llama_dir, address)
        b = TierWorker(tiny_llama_dir, address)
        try:
            await a.generate(prompt)
            stub = pb_grpc.KVStoreStub(a.tier._aio_channel)

            async def stored() -> bool:
                return (await stub.Stats(pb.StatsRequest())).num_stored >= 10
            await wait_for(stored)
            fetch = asyncio.create_task(b.generate(prompt))

            async def copying() -> bool:  # the store opened b's reservation and is in its copy
                table = b.tier.receiver.table
                return any(r.state.value == "open" for r in table._by_id.values())
            await wait_for(copying)
            os.kill(peer.process.pid, signal.SIGKILL)
            assert await fetch == (0, want, 0)  # computed instead, the same tokens
            assert b.tier.counters.num_fetch_failures == 1
            await b.settled()
            await a.settled()
        finally:
            for w in (a, b):
                await w.close()

    try:
        asyncio.run(run())
    finally:
        peer.process.kill()
        peer.process.join(5)


def test_a_prefix_spilled_to_disk_comes_back_with_the_tokens_of_a_recompute(tiny_llama_dir: str, tmp_path) -> None:
    """The store's memory holds 12 blocks, its spill file 64: the first prompt's 10 blocks are
    pushed to disk by the later prompts' offers and read back for its fetch."""
    prompt, *others = random_prompts([41, 38, 38, 38], 512, seed=9)
    want, *_ = reference_tokens(tiny_llama_dir, [prompt])

    async def run() -> None:
        async with served_store(tiny_llama_dir, 12, 1, pool_blocks=24, disk_dir=str(tmp_path), disk_blocks=64) \
                as (store, (w,)):
            hashes = w.engine.hasher.hash_prompt(prompt)[:10]
            assert await w.generate(prompt) == (0, want, 0)
            for other in others:
                await w.generate(other)
            await wait_for(lambda: asyncio.sleep(0, all(h in store.disk for h in hashes)))
            # the later prompts' offers done on both sides: a slot still reserved for one leaves
            # no room to read the 10 back (the store refuses the fetch, rightly; the test raced it)
            await w.settled()
            await wait_for(lambda: asyncio.sleep(0, not store._incoming and not store._quarantine))
            assert await w.on_engine(lambda e: cached_run(e, prompt)) == 0
            assert await w.generate(prompt) == (10, want, 40)
            assert store.stats.num_unspilled == 10  # every one read back from the file
            await w.settled()
            store.check()

    asyncio.run(run())


def test_a_call_that_ends_mid_fetch_leaves_nothing_held(tiny_llama_dir: str) -> None:
    """The worker's call is cancelled while the store copies its fetch (slowly): the fetch's
    reservation is revoked, its staging slots stay held until the store's writer is fenced (its
    copy ends), then go back; no pool block was ever taken; the next request is served."""
    prompt, = random_prompts([41], 512, seed=12)
    want, = reference_tokens(tiny_llama_dir, [prompt])
    model_id = make_engine(tiny_llama_dir, num_blocks=8).model_id
    peer = Peer(store_main, tiny_llama_dir, model_id, 4, 2.0)
    address = f"127.0.0.1:{peer.hello}"

    async def run() -> None:
        a = TierWorker(tiny_llama_dir, address)
        b = TierWorker(tiny_llama_dir, address)
        try:
            await a.generate(prompt)
            stub = pb_grpc.KVStoreStub(a.tier._aio_channel)

            async def stored() -> bool:
                return (await stub.Stats(pb.StatsRequest())).num_stored >= 10
            await wait_for(stored)
            call = asyncio.create_task(b.generate(prompt))

            async def copying() -> bool:
                return any(r.state.value == "open" for r in b.tier.receiver.table._by_id.values())
            await wait_for(copying)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert b.tier.staging.num_free == b.tier.staging.capacity - 10  # the store may still be writing
            assert await b.on_engine(lambda e: e.check_invariants().num_in_use) == 0  # no pool block meanwhile
            await b.settled()  # fenced once its copy ended: released, nothing in use, no reservation
            assert await b.generate(prompt) == (10, want, 40)  # the store is intact: the next fetch lands
            await b.settled()
        finally:
            for w in (a, b):
                await w.close()

    try:
        asyncio.run(run())
    finally:
        peer.process.kill()
        peer.process.join(5)


def test_a_long_prompt_is_hashed_off_the_event_loop_with_the_same_hits(tiny_llama_dir: str, monkeypatch) -> None:
    """Past LONG_PROMPT_TOKENS (lowered here to 8) the prompt is hashed on a worker thread: the
    same blocks are found and land."""
    import kvstore.tier

    monkeypatch.setattr(kvstore.tier, "LONG_PROMPT_TOKENS", 8)
    prompt, = random_prompts([41], 512, seed=21)
    want, = reference_tokens(tiny_llama_dir, [prompt])

    async def run() -> None:
        async with served_store(tiny_llama_dir, 4096, 2) as (store, (a, b)):
            await a.generate(prompt)
            await wait_for(lambda: asyncio.sleep(0, store.lookup(a.engine.hasher.hash_prompt(prompt)[:10]) == 10))
            assert await b.generate(prompt) == (10, want, 40)
            await b.settled()

    asyncio.run(run())


def test_a_worker_finds_its_hosts_restarted_store_in_redis(tiny_llama_dir: str) -> None:
    """The host's store stops and another starts on a new port (a restarted store, empty): the
    worker's next lookup finds nothing listening, it reads the host's entry in Redis again,
    and its offloads and fetches go to the new store from then on."""
    from cluster.redis_server import EmbeddedRedis
    from kvstore.host import StoreConfig, StoreHost, find_store

    first, second, *others = random_prompts([41, 41, 38, 38, 38, 38], 512, seed=14)
    want_first, want_second = reference_tokens(tiny_llama_dir, [first, second])
    redis, namespace = EmbeddedRedis(), "tier-restart"
    config = StoreConfig(tiny_llama_dir, 512 * store_layout(tiny_llama_dir, "", BLOCK, "float32").block_bytes,
                         block_size=BLOCK, model_id=make_engine(tiny_llama_dir, num_blocks=8).model_id)

    async def run() -> None:
        old = StoreHost(config, redis.url, namespace)
        await old.start()
        w = TierWorker(tiny_llama_dir, "", redis=(redis.url, namespace))
        new: StoreHost | None = None
        try:
            assert w.tier.address == old.address and w.tier.store_id == old.store_id
            assert await w.generate(first) == (0, want_first, 0)
            await wait_for(lambda: asyncio.sleep(0, old.store.num_blocks >= 10))
            await old.stop()
            new = StoreHost(config, redis.url, namespace)
            await new.start()
            assert new.address != old.address

            async def registered() -> bool:
                entry = await asyncio.to_thread(find_store, redis.url, namespace, 0)
                return entry is not None and entry.address == new.address
            await wait_for(registered)
            # the old store is gone: computed (its lookup failed), and the worker looked again
            assert await w.generate(second) == (0, want_second, 0)
            assert w.tier.counters.num_fetch_failures == 1
            assert w.tier.address == new.address and w.tier.store_id == new.store_id
            hashes = w.engine.hasher.hash_prompt(second)[:10]
            await wait_for(lambda: asyncio.sleep(0, new.store.lookup(hashes) == 10))  # offloaded to the new one
            for other in others:  # evict the second prompt's blocks from the pool
                await w.generate(other)
            assert await w.on_engine(lambda e: cached_run(e, second)) == 0
            assert await w.generate(second) == (10, want_second, 40)  # fetched from the new store
            assert new.store.lookup(w.engine.hasher.hash_prompt(first)[:10]) == 0  # the old one's blocks died with it
            await w.settled()
            new.store.check()
            assert new.store.receiver.num_reservations() == 0
        finally:
            await w.close()
            if new is not None:
                await new.stop()

    try:
        asyncio.run(run())
    finally:
        redis.stop()


def test_a_split_worker_offloads_and_fetches_its_ranks_heads(tiny_llama_dir: str) -> None:
    """A worker split over 2 ranks (each holds 1 of the tiny Llama's 2 KV heads) and a whole
    one share the store, which holds every head of a block: what the split worker offloaded
    (each rank's heads from its own pool) the whole one fetches, and the other way round
    (each rank gets its heads from the staged block); tokens equal the whole model's."""
    split_first, whole_first, *others = random_prompts([41, 41, 38, 38, 38, 38], 512, seed=15)
    want_split, want_whole = reference_tokens(tiny_llama_dir, [split_first, whole_first])
    layout = store_layout(tiny_llama_dir, make_engine(tiny_llama_dir, num_blocks=8).model_id, BLOCK, "float32")

    async def run() -> None:
        store = open_store(layout, 4096 * layout.block_bytes, "127.0.0.1", None, None)
        server, port = await serve(store, "127.0.0.1", 0, None)
        split = TierWorker(tiny_llama_dir, f"127.0.0.1:{port}", tp=2)
        whole = TierWorker(tiny_llama_dir, f"127.0.0.1:{port}")
        try:
            assert split.tier.pools.layout.world == 2 and split.tier.pools.layout.num_kv_heads == 1
            assert await split.generate(split_first) == (0, want_split, 0)
            assert await whole.generate(whole_first) == (0, want_whole, 0)
            for w, p in ((split, split_first), (whole, whole_first)):
                hashes = w.engine.hasher.hash_prompt(p)[:10]
                await wait_for(lambda hashes=hashes: asyncio.sleep(0, store.lookup(hashes) == 10))
            assert await whole.generate(split_first) == (10, want_split, 40)  # the split worker's heads, whole
            assert await split.generate(whole_first) == (10, want_whole, 40)  # a whole block, cut per rank
            for other in others:  # and its own, back after eviction
                await split.generate(other)
            assert await split.on_engine(lambda e: cached_run(e, split_first)) == 0
            assert await split.generate(split_first) == (10, want_split, 40)
            for w in (split, whole):
                await w.settled()
                assert w.tier.counters.num_fetch_failures == 0
            store.check()
            assert store.receiver.num_reservations() == 0
        finally:
            for w in (split, whole):
                await w.close()
            await server.stop(0)
            store.close()

    asyncio.run(run())


def test_a_pool_the_tier_reaches_through_host_rows_offloads_and_fetches_whole_blocks(tiny_llama_dir: str,
                                                                                    monkeypatch) -> None:
    """The path a GPU worker's tier takes (kvstore/pinned_rows.py), on host tensors: its offloads
    are copied out of the pool into host rows, 3 at a time here (a 10-block offload in 4 turns),
    and pushed from there; its fetches are copied from staging into the pool by one indexed
    copy. A worker that reads its pool directly fetches what it offloaded, and the other way
    round, with the tokens of a recompute."""
    import kvstore.tier

    monkeypatch.setattr(kvstore.tier, "HOST_ROWS", 3)
    mine, theirs, *others = random_prompts([41, 41, 38, 38, 38, 38], 512, seed=16)
    want_mine, want_theirs = reference_tokens(tiny_llama_dir, [mine, theirs])

    async def run() -> None:
        async with served_store(tiny_llama_dir, 4096, 1) as (store, (direct,)):
            bounced = TierWorker(tiny_llama_dir, direct.tier.address, through_host=True)
            try:
                assert bounced.tier.host is not None and bounced.tier.host.capacity == 3
                assert await bounced.generate(mine) == (0, want_mine, 0)
                assert await direct.generate(theirs) == (0, want_theirs, 0)
                for w, p in ((bounced, mine), (direct, theirs)):
                    hashes = w.engine.hasher.hash_prompt(p)[:10]
                    await wait_for(lambda hashes=hashes: asyncio.sleep(0, store.lookup(hashes) == 10))
                assert await direct.generate(mine) == (10, want_mine, 40)  # pushed from the host rows
                assert await bounced.generate(theirs) == (10, want_theirs, 40)  # copied in from staging
                for other in others:
                    await bounced.generate(other)
                assert await bounced.on_engine(lambda e: cached_run(e, mine)) == 0
                assert await bounced.generate(mine) == (10, want_mine, 40)
                for w in (bounced, direct):
                    await w.settled()
                    assert w.tier.counters.num_fetch_failures == 0 and w.tier.counters.num_offload_failures == 0
                store.check()
                assert store.receiver.num_reservations() == 0
            finally:
                await bounced.close()

    asyncio.run(run())
