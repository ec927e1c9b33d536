"""Busy workers are not taken for gone: real Ray workers, a real redis-server, gRPC on loopback.

Routers once dropped a worker whose heartbeat came later than its TTL (a machine busy with
other work), cancelling its calls in flight, and took it back seconds later. Here the
workers' heartbeat writes are refused by Redis itself (an ACL on the `default` user: SET
and PEXPIRE denied, reads allowed), so every heartbeat expires while the workers serve:
the router keeps them (their health checks answer SERVING), a request in flight and new
ones complete; a worker whose process is gone is dropped, as before.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator

import grpc
import pytest
import redis

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from control.auth import registry_key
from control.heartbeat import hb_key
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import wait_for

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=2,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")),
        worker_num_cpus=0.5, replace_dead_workers=False)
    with LocalCluster(config) as c:
        yield c


@contextlib.contextmanager
def heartbeats_refused(cluster: LocalCluster) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(cluster.redis_url)
    client.execute_command("ACL", "SETUSER", "default", "-set", "-pexpire")
    try:
        yield client
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+set", "+pexpire")
        client.close()


def generate(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), timeout=120))


def test_a_heartbeat_under_another_workers_key_is_skipped_and_counted(cluster: LocalCluster) -> None:
    """Heartbeats were keyed by the payload's worker id: anyone writing Redis could shadow a
    worker under a key of their own. Now a heartbeat counts only under its own worker's key."""
    wait_for("the router to see decode-0", lambda: "decode-0" in cluster.router_stats()[0]["members"], 60)
    client = redis.Redis.from_url(cluster.redis_url)
    ns = cluster.config.namespace
    try:
        real = client.get(hb_key(ns, "decode-0"))
        before = cluster.router_stats()[0]["bad_registry_entries"]
        client.set(hb_key(ns, "decode-7"), real, px=20_000)  # decode-0's own bytes, under another key
        wait_for("the router to count the forged heartbeat",
                 lambda: cluster.router_stats()[0]["bad_registry_entries"] > before, 10)
        stats = cluster.router_stats()[0]
        assert "decode-7" not in stats["members"] and "decode-0" in stats["members"]
    finally:
        client.delete(hb_key(ns, "decode-7"))
        client.close()


def test_a_heartbeat_or_store_entry_without_the_clusters_seal_is_skipped_and_counted(cluster: LocalCluster) -> None:
    """Anyone who can write the cluster's Redis once could add workers (a majority of fake ones
    outvoted the real workers' model facts) and name a KV store (workers showed it the cluster
    token). Entries are sealed with the cluster's secret now; one without the seal is skipped."""
    from control.heartbeat import store_key
    from kvfabric.address import local_host_id
    from kvstore.host import find_store
    from tests.unit.helpers import heartbeat

    wait_for("the router to see decode-0", lambda: "decode-0" in cluster.router_stats()[0]["members"], 60)
    client = redis.Redis.from_url(cluster.redis_url)
    ns = cluster.config.namespace
    forged = [f"decode-{i}" for i in range(10, 15)]
    try:
        before = cluster.router_stats()[0]["bad_registry_entries"]
        for w in forged:  # five decode workers of another model, at an address of their choice
            client.set(hb_key(ns, w), heartbeat(w, "decode", address="127.0.0.1:1", model_id="evil", block_size=16,
                                                vocab_size=512, max_model_len=64, num_total_blocks=64).to_wire(),
                       px=20_000)
        wait_for("the router to count the forged heartbeats",
                 lambda: cluster.router_stats()[0]["bad_registry_entries"] >= before + 5, 10)
        stats = cluster.router_stats()[0]
        assert not set(forged) & set(stats["members"]) and "decode-0" in stats["members"]
        client.set(store_key(ns, local_host_id()), b'{"store_id": "evil", "address": "127.0.0.1:1"}', px=20_000)
        assert find_store(cluster.redis_url, ns, timeout_s=0, seal_key=registry_key(
            cluster.config.worker.cluster_secret)) is None  # a worker does not take it
        assert not set(forged) & set(cluster.router_stats()[0]["serving"]["decode"])
    finally:
        client.delete(*(hb_key(ns, w) for w in forged), store_key(ns, local_host_id()))
        client.close()


def test_forged_kv_events_and_router_stats_are_skipped_and_counted(cluster: LocalCluster) -> None:
    """The real writers seal what they write (a worker's KV events, a router's stats); a reader
    with the cluster's key reads those and skips, and counts, an event or stats someone else
    wrote; a reader without the key (`splitserve status`) still reads them."""
    import asyncio

    import msgpack

    from control.heartbeat import kv_key, router_key
    from control.kv_events import event_to_bytes
    from control.reader import RegistryReader, StreamCursor
    from engine.core.block_pool import KVEvent

    wait_for("the router to see decode-0", lambda: "decode-0" in cluster.router_stats()[0]["members"], 60)
    with grpc.insecure_channel(cluster.address) as channel:  # blocks cached: KV events in the workers' streams
        generate(pb_grpc.GenerationStub(channel), list(range(3, 40)), 2)
    client = redis.Redis.from_url(cluster.redis_url)
    ns, key = cluster.config.namespace, registry_key(cluster.config.worker.cluster_secret)
    # the router writes its stats about once a second: a module's first test may get here
    # before the first (run first, in reverse order beside another cluster, it once did)
    wait_for("router-0's stats in Redis", lambda: client.exists(router_key(ns, "router-0")), 30)
    forged_event = KVEvent(999_999, "stored", [b"\x0b\xad" * 8], None)
    try:
        client.xadd(kv_key(ns, "decode-0"), {"e": event_to_bytes(forged_event)})
        client.set(router_key(ns, "router-evil"), msgpack.packb({"router_id": "router-evil", "address": "10.6.6.6:1",
                                                                 "itl_p50_ms": 1e6}), px=20_000)  # well-formed

        async def read(seal_key: bytes | None) -> tuple[list, dict, int]:
            """Every event in the streams (a read returns at most 1,000 a stream: the module's
            other tests, run before this one, may have left more) and the routers' stats."""
            reader = RegistryReader(cluster.redis_url, ns, seal_key=seal_key)
            cursor, events = StreamCursor(), []
            try:
                while True:
                    before = dict(cursor.last_ids)
                    events += await reader.read_events(cursor, ["decode-0", "prefill-0"], block_ms=100)
                    if cursor.last_ids == before:
                        break
                return events, await reader.router_stats(), reader.num_bad_entries
            finally:
                await reader.close()
        events, routers, bad = asyncio.run(read(key))
        assert events and forged_event not in [e for _, e in events]
        assert set(routers) == {"router-0"} and bad == 2
        events, routers, _ = asyncio.run(read(None))  # no key: everything, seals taken off
        assert forged_event in [e for _, e in events] and set(routers) == {"router-0", "router-evil"}
    finally:
        client.delete(router_key(ns, "router-evil"))
        client.close()


def test_workers_whose_heartbeats_expire_while_they_serve_keep_their_requests(cluster: LocalCluster) -> None:
    everyone = ["decode-0", "decode-1", "prefill-0"]
    wait_for("the router to see every worker", lambda: cluster.router_stats()[0]["members"] == everyone, 60)
    with grpc.insecure_channel(cluster.address) as channel, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        stub = pb_grpc.GenerationStub(channel)
        with heartbeats_refused(cluster) as client:
            running = [pool.submit(generate, stub, list(range(3 + i, 40 + i)), 1500) for i in range(2)]
            ns_keys = client.keys("*hb*")
            wait_for("every heartbeat to expire", lambda: not client.keys("*hb*"), 30)
            assert ns_keys  # they were there, and expired: the workers could not renew them
            time.sleep(2.0)  # a few of the router's refreshes with no heartbeat at all
            stats = cluster.router_stats()[0]
            assert stats["members"] == everyone and stats["late_heartbeats_kept"] > 0
            assert stats["serving"] == {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]}
            assert len([t for r in generate(stub, list(range(50, 90)), 8) for t in r.token_ids]) == 8
            for f in running:  # no call cut: each streamed all its tokens, on one route
                responses = f.result(timeout=120)
                assert sum(len(r.token_ids) for r in responses) == 1500
            assert cluster.router_stats()[0]["num_retries"] == 0
            cluster.kill_worker("decode-1")  # its process is gone: no health check answers
            wait_for("the router to drop the dead worker",
                     lambda: cluster.router_stats()[0]["members"] == ["decode-0", "prefill-0"], 30)
        wait_for("the heartbeats to come back", lambda: cluster.router_stats()[0]["late_heartbeats_kept"] > 0
                 and len(redis.Redis.from_url(cluster.redis_url).keys("*hb*")) == 2, 30)
