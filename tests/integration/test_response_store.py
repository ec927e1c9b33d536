"""The Responses API's stored responses in a real redis-server (router/response_store.py):
a tenant's alone, kept for the TTL, capped per tenant by dropping its oldest, atomically
across two stores (two router replicas) writing at once; an unreachable Redis is
StoreUnavailable, never a hang."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest

from cluster.redis_server import EmbeddedRedis
from router.response_store import ResponseStore, ResponseTooLarge, StoredResponse, StoreUnavailable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = EmbeddedRedis()
    try:
        yield server.url
    finally:
        server.stop()


def stored(n: int, size: int = 0) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "pad": "x" * size}, [{"role": "user", "content": str(n)}])


def test_a_response_is_its_tenant_s_alone_and_deleted_once(redis_url: str) -> None:
    async def scenario() -> None:
        store = ResponseStore(redis_url, "t1", ttl_s=60, max_bytes_per_tenant=1 << 20)
        try:
            assert await store.put("acme", "resp_1", stored(1)) == 0
            assert await store.get("acme", "resp_1") == stored(1)
            assert await store.get("globex", "resp_1") is None and await store.get(None, "resp_1") is None
            assert await store.delete("globex", "resp_1") is False
            assert await store.delete("acme", "resp_1") is True and await store.get("acme", "resp_1") is None
            assert await store.delete("acme", "resp_1") is False
        finally:
            await store.close()

    asyncio.run(scenario())


def test_responses_expire_after_the_ttl(redis_url: str) -> None:
    async def scenario() -> None:
        store = ResponseStore(redis_url, "t2", ttl_s=0.3, max_bytes_per_tenant=1 << 20)
        try:
            await store.put("acme", "resp_1", stored(1))
            assert await store.get("acme", "resp_1") is not None
            await asyncio.sleep(0.5)
            assert await store.get("acme", "resp_1") is None
            # the expired one no longer counts against the cap: its books were swept
            await store.put("acme", "resp_2", stored(2))
            sizes = await store.client.hgetall(store._keys("acme", "x")[2])
            assert list(sizes) == [b"resp_2"]
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_tenant_past_its_cap_drops_its_oldest_and_others_keep_theirs(redis_url: str) -> None:
    async def scenario() -> None:
        one = len(msgspec.msgpack.encode(stored(1, 1000)))
        store = ResponseStore(redis_url, "t3", ttl_s=60, max_bytes_per_tenant=3 * one)
        try:
            await store.put("globex", "resp_g", stored(9, 1000))
            for n in range(3):
                assert await store.put("acme", f"resp_{n}", stored(n, 1000)) == 0
                time.sleep(0.002)  # distinct store times: the oldest is the first
            assert await store.put("acme", "resp_3", stored(3, 1000)) == 1  # the oldest dropped to fit
            assert [await store.get("acme", f"resp_{n}") is not None for n in range(4)] == [False, True, True, True]
            assert await store.get("globex", "resp_g") is not None
            with pytest.raises(ResponseTooLarge):
                await store.put("acme", "resp_big", stored(4, 4 * one))
            assert [await store.get("acme", f"resp_{n}") is not None for n in range(4)] == [False, True, True, True]
        finally:
            await store.close()

    asyncio.run(scenario())


def test_two_replicas_storing_at_once_keep_the_cap(redis_url: str) -> None:
    async def scenario() -> None:
        one = len(msgspec.msgpack.encode(stored(10, 1000)))
        stores = [ResponseStore(redis_url, "t4", ttl_s=60, max_bytes_per_tenant=5 * one) for _ in range(2)]
        try:
            await asyncio.gather(*(stores[n % 2].put("acme", f"resp_{n}", stored(n + 10, 1000)) for n in range(20)))
            kept = [n for n in range(20) if await stores[0].get("acme", f"resp_{n}") is not None]
            sizes = await stores[0].client.hgetall(stores[0]._keys("acme", "x")[2])
            assert len(kept) == 5 and sorted(sizes) == sorted(f"resp_{n}".encode() for n in kept)
        finally:
            for s in stores:
                await s.close()

    asyncio.run(scenario())


def test_an_unreachable_redis_is_store_unavailable_within_the_timeout() -> None:
    async def scenario() -> None:
        store = ResponseStore("redis://127.0.0.1:1/0", "t5", ttl_s=60, max_bytes_per_tenant=1 << 20, timeout_s=0.5)
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.put("acme", "resp_1", stored(1))
            with pytest.raises(StoreUnavailable):
                await store.get("acme", "resp_1")
            assert time.monotonic() - start < 5
        finally:
            await store.close()

    asyncio.run(scenario())
