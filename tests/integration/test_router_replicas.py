"""Router replicas: several router actors serve one port; each routes on the KV index it
replays from Redis, so a prefix cached through one replica is found through the other.
Real Ray, a real redis-server, gRPC on loopback."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
import urllib.request

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from router.service import RouterService
from tests.integration.cluster_checks import wait_threads
from tests.integration.reference import make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

NUM_CHANNELS = 16
"""Separate connections; the chance that the kernel sends all of them to one of two replicas is 2**-15."""
MORE_CHANNELS = 48
"""Connections tried after those while one replica has served none of them (2**-63 in all)."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=2, num_routers=2,
        router=RouterConfig(port=0, http_port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)),
        worker_num_cpus=0.5)
    with LocalCluster(config) as c:
        yield c


def generate(address: str, prompt: list[int]) -> list[pb.GenerateResponse]:
    """On a connection of its own: channels to one address otherwise share one from gRPC's
    process-wide pool while the last channel's is still being closed."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
        return list(pb_grpc.GenerationStub(channel).Generate(req, timeout=60))


def served_since(cluster: LocalCluster, before: dict[str, int]) -> dict[str, int]:
    """Requests each router replica has served since `before` (its counts then)."""
    return {s["router_id"]: s["num_requests"] - before.get(s["router_id"], 0) for s in cluster.router_stats()}


def test_replicas_share_the_port_and_each_serves(cluster: LocalCluster, tiny_llama_dir: str) -> None:
    routers = cluster.info["routers"]
    assert sorted(routers) == ["router-0", "router-1"] and len(set(routers.values())) == 1
    assert int(cluster.address.rsplit(":", 1)[1]) > 0  # port 0 asked for a free one; both replicas got it
    rng = random.Random(5)
    batch = [[rng.randrange(3, 500) for _ in range(20 + i)] for i in range(NUM_CHANNELS)]
    before = served_since(cluster, {})  # (other tests' requests)
    got = [generate(cluster.address, p) for p in batch]
    want = make_engine(tiny_llama_dir, block_size=16).generate(batch, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [[t for r in g for t in r.token_ids] for g in got] == [w.token_ids for w in want]
    served = served_since(cluster, before)
    assert sum(served.values()) == NUM_CHANNELS, served
    for i in range(MORE_CHANNELS):
        if min(served.values()) > 0:
            break
        assert len(generate(cluster.address, [7 + i] * 12)) == 6
        served = served_since(cluster, before)
    assert min(served.values()) > 0, served
    assert all(r["usage"]["num_in_use"] == 0 for r in cluster.check_idle())


def test_replicas_share_the_http_port_and_each_serves_it(cluster: LocalCluster) -> None:
    http = cluster.info["http_address"]
    assert int(http.rsplit(":", 1)[1]) > 0
    before = served_since(cluster, {})
    for i in range(NUM_CHANNELS):  # a new connection each: the kernel spreads them over the replicas
        request = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(
            {"prompt": [5 + i] * 12, "max_tokens": 3, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json", "Connection": "close"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
    served = served_since(cluster, before)
    assert sum(served.values()) == NUM_CHANNELS and min(served.values()) > 0, served
    assert {s["http_address"] for s in cluster.router_stats()} == {http}


def test_a_prefix_cached_through_one_replica_is_found_through_the_other(cluster: LocalCluster) -> None:
    rng = random.Random(6)
    stem = [rng.randrange(3, 500) for _ in range(64)]
    before = [s["index_events"] for s in cluster.router_stats()]
    first = generate(cluster.address, stem + [7])[-1]
    deadline = time.monotonic() + 10
    while any(s["index_events"] < n + 2 for s, n in zip(cluster.router_stats(), before, strict=True)):
        assert time.monotonic() < deadline, "a replica did not replay the P and D stored events from Redis"
        time.sleep(0.1)
    # every replica learns the new blocks from Redis; then each fresh connection, whichever
    # replica it reaches, sends the same prefix to the decode worker that holds it
    for i in range(6):
        final = generate(cluster.address, stem + [8 + i, 9])[-1]
        assert final.usage.cached_tokens == 64, (i, final.usage)
        assert final.route.decode_worker == first.route.decode_worker


def test_a_lone_router_refuses_a_taken_port(tiny_llama_dir: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = RouterService("router-x", RouterConfig(port=port, cluster_secret=b"x"), "redis://127.0.0.1:1/0", "t")
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}: the port is in use"):
            asyncio.run(service.start())


def idle(cluster: LocalCluster, worker_id: str, since: float, timeout_s: float = 10.0) -> None:
    """Every router has a heartbeat from `worker_id` sent after `since` (wall clock) and sees
    no request active on it."""
    deadline = time.monotonic() + timeout_s
    while any(s["heartbeat_at"].get(worker_id, 0.0) <= since or s["active"].get(worker_id, 0)
              for s in cluster.router_stats()):
        assert time.monotonic() < deadline, f"{worker_id} still looks busy to a router"
        time.sleep(0.1)


def test_a_killed_replica_is_replaced_the_other_serves_throughout_and_the_new_one_knows_the_cache(
        cluster: LocalCluster) -> None:
    rng = random.Random(9)
    stem = [rng.randrange(3, 500) for _ in range(64)]
    first = generate(cluster.address, stem + [7])[-1]
    deadline = time.monotonic() + 10
    while any(s["index_blocks"].get(first.route.decode_worker, 0) < 4 for s in cluster.router_stats()):
        assert time.monotonic() < deadline, "the replicas did not learn the prefix"
        time.sleep(0.1)
    victim = next(s["pid"] for s in cluster.router_stats() if s["router_id"] == "router-1")
    os.kill(victim, signal.SIGKILL)
    # every thread exited (the leader alone shows Z while the others still hold the files):
    # its listening sockets are gone with it, new connections reach the survivor
    wait_threads(victim, {"Z", "X"}, "gone")
    deadline = time.monotonic() + 90
    while True:
        assert len(generate(cluster.address, [11, 12, 13] * 7)) > 0  # served throughout
        stats = {s["router_id"]: s for s in cluster.router_stats()}
        if "router-1" in stats and stats["router-1"]["pid"] != victim:
            break
        assert time.monotonic() < deadline, cluster.controller_status()["actions"]
        time.sleep(0.25)
    actions = cluster.controller_status()["actions"]
    assert any("router-1 died; replacing it" in a for a in actions)
    assert any("router-1 serving again on 127.0.0.1:" in a for a in actions), actions
    # the replacement replayed the workers' KV events before it took traffic
    assert stats["router-1"]["index_blocks"].get(first.route.decode_worker, 0) >= 4, stats["router-1"]
    assert stats["router-1"]["address"] == cluster.address
    before = {rid: s["num_requests"] for rid, s in stats.items()}
    ended = time.time()
    for i in range(NUM_CHANNELS):
        # the last request's end reaches a router's load view through the worker's heartbeat
        # (every 0.5 s); until it does, the cache-hot worker still looks busy, and one busy
        # request outweighs a 64-token prefix (decode_weight_tokens): routing would be a tie
        idle(cluster, first.route.decode_worker, since=ended)
        final = generate(cluster.address, stem + [20 + i, 9])[-1]
        ended = time.time()
        assert final.usage.cached_tokens == 64 and final.route.decode_worker == first.route.decode_worker
    served = served_since(cluster, before)
    assert min(served.values()) > 0 and sum(served.values()) == NUM_CHANNELS, served
