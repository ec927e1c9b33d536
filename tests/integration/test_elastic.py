"""Elastic pools on a real local cluster (Ray actors, redis-server, gRPC): workers join at
runtime and serve, scale-down drains while requests stream (nothing fails, routers send the
draining worker nothing new), a killed worker is replaced, and a worker that cannot be
placed is cancelled and reported. The tests share one cluster and run in order."""
from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from kvfabric.region import segments_of
from router.policy import RoutingConfig
from tests.integration.cluster_checks import decode_pids, generate, greedy, tokens, wait_for

pytestmark = pytest.mark.timeout(600)

PLACE_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=3.0),
        num_prefill=1, num_decode=1, num_routers=2,  # the kernel spreads the clients' connections over both
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)),
        worker_num_cpus=0.25, supervise_interval_s=0.5, drain_timeout_s=20.0, place_timeout_s=PLACE_TIMEOUT_S,
        role_resources={"prefill": {"prefill-slot": 1.0}})  # this node has room for exactly one prefill worker
    with LocalCluster(config) as c:
        yield c


def serving(cluster: LocalCluster, role: str) -> list[str]:
    return sorted(w for w, s in cluster.controller_status()["workers"].items() if w.startswith(role) and s == "serving")


def at_size(cluster: LocalCluster, role: str, n: int) -> list[str]:
    """The pool of `role` scaled to `n` and every router seeing exactly those serving (each test
    sets the size it needs: the module's tests pass alone and in any order)."""
    cluster.scale(role, n)

    def settled() -> list[str] | None:  # n serving, and none starting or draining
        workers = serving(cluster, role)
        states = cluster.controller_status()["workers"]
        return workers if len(workers) == n and all(s == "serving" for s in states.values()) else None

    workers = wait_for(f"{n} serving {role} workers", settled, 120)
    wait_for("the routers to see them", lambda: all(
        sorted(s["serving"][role]) == workers for s in cluster.router_stats()), 30)
    return workers


def test_a_decode_worker_added_at_runtime_serves_and_gets_its_cached_prefix(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                            tiny_llama_dir: str) -> None:
    cluster.scale("decode", 2)
    [new] = wait_for("a second decode worker", lambda: [w for w in serving(cluster, "decode") if w != "decode-0"])
    wait_for("every router sees it", lambda: all(new in s["members"] for s in cluster.router_stats()), 10)
    rng = random.Random(3)
    for _ in range(12):  # cache-aware routing: a fresh prompt lands on the empty worker soon
        prompt = [rng.randrange(3, 500) for _ in range(48)]
        got = generate(stub, prompt, 6)
        assert tokens(got) == greedy(tiny_llama_dir, prompt, 6)
        if got[-1].route.decode_worker == new:
            break
    assert got[-1].route.decode_worker == new
    wait_for("its KV events reach both routers' index",  # the 32-token prefix is two blocks
             lambda: all(s["index_blocks"].get(new, 0) >= 2 for s in cluster.router_stats()), 10)
    for i in range(4):  # whichever router takes it, the cached prefix on `new` draws the request there
        wait_for("the routers see no request running (a heartbeat may lag a finished one)",
                 lambda: not any(n for s in cluster.router_stats() for n in s["active"].values()), 10)
        sibling = prompt[:32] + [rng.randrange(3, 500) for _ in range(16)]
        got = generate(stub, sibling, 6)
        assert got[-1].route.decode_worker == new and got[-1].usage.cached_tokens >= 32, i
        assert tokens(got) == greedy(tiny_llama_dir, sibling, 6)
    assert all(s["index_events"] > 0 for s in cluster.router_stats())


def test_scale_down_while_requests_stream_fails_nothing(cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(24 + i)] for i in range(6)]
    at_size(cluster, "decode", 2)  # whatever ran before: two decode workers, one to drain
    pids = decode_pids(cluster)
    assert len(pids) == 2 and all(len(segments_of({pid})) == 1 for pid in pids.values())
    drains_before = len(cluster.controller_status()["drains"])
    streaming = [threading.Event() for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, stub, p, 300, e) for p, e in zip(prompts, streaming, strict=True)]
        for e in streaming:
            assert e.wait(60), "a request never streamed"
        cluster.scale("decode", 1)
        results = [f.result() for f in futures]
    for p, got in zip(prompts, results, strict=True):
        assert tokens(got) == greedy(tiny_llama_dir, p, 300)  # one unbroken stream each, wherever it ended
    [drain] = wait_for("the drain to finish", lambda: cluster.controller_status()["drains"][drains_before:], 60)
    assert drain["late_calls"] == 0  # routers were told before: nothing new reached the draining worker
    assert len(serving(cluster, "decode")) == 1
    [kept] = serving(cluster, "decode")
    assert segments_of({pid for w, pid in pids.items() if w != kept}) == set()  # its KV pool is gone
    assert len(segments_of({pids[kept]})) == 1
    live = [r for r in cluster.check_idle() if not r.get("dead")]  # (workers killed by other tests are dead)
    assert kept in {r["worker_id"] for r in live} and all(r["usage"]["num_in_use"] == 0 for r in live)


def test_a_killed_decode_worker_is_replaced_and_serves(cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    [victim] = at_size(cluster, "decode", 1)
    started = time.monotonic()
    cluster.kill_worker(victim)
    [replacement] = wait_for("a replacement", lambda: [w for w in serving(cluster, "decode") if w != victim])
    back_s = time.monotonic() - started
    assert victim in cluster.controller_status()["dead"] and back_s < 60
    wait_for("the routers see it", lambda: all(replacement in s["members"] for s in cluster.router_stats()), 10)
    prompt = [random.Random(5).randrange(3, 500) for _ in range(40)]
    got = generate(stub, prompt, 8)
    assert tokens(got) == greedy(tiny_llama_dir, prompt, 8) and got[-1].route.decode_worker == replacement


def test_a_killed_prefill_worker_under_load_is_replaced_and_no_request_is_lost(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                                 tiny_llama_dir: str) -> None:
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 500) for _ in range(200 + 10 * i)] for i in range(8)]
    [victim] = at_size(cluster, "prefill", 1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, stub, p, 24) for p in prompts]
        next(concurrent.futures.as_completed(futures, timeout=120))  # it served; the rest run or wait
        cluster.kill_worker(victim)
        results = [f.result() for f in futures]
    for p, got in zip(prompts, results, strict=True):
        assert tokens(got) == greedy(tiny_llama_dir, p, 24)
    prefilled_by = [got[-1].route.prefill_worker or "local" for got in results]
    assert victim in prefilled_by and any(w != victim for w in prefilled_by), prefilled_by  # killed mid-run
    wait_for("a replacement", lambda: [w for w in serving(cluster, "prefill") if w != victim], 60)
    assert victim in cluster.controller_status()["dead"]


def test_a_worker_that_cannot_be_placed_is_cancelled_and_reported(cluster: LocalCluster, stub) -> None:  # type: ignore[no-untyped-def]
    cluster.scale("prefill", 2)  # the node's one prefill slot is taken
    wait_for("the cancellation", lambda: any("cancelled prefill-" in a for a in cluster.controller_status()["actions"]),
             PLACE_TIMEOUT_S + 30)
    status = cluster.controller_status()
    assert status["targets"]["prefill"] == 1 and len(serving(cluster, "prefill")) == 1
    cluster.scale("decode", 2)  # later decisions are not blocked
    wait_for("a second decode worker", lambda: len(serving(cluster, "decode")) == 2)


def test_a_pool_target_from_redis_that_is_no_pool_size_is_refused(cluster: LocalCluster) -> None:
    """The controller once took any value under a target key: a garbage one raised in its loop,
    a huge one would have launched that many workers. Now both are refused and logged."""
    import redis

    from control.heartbeat import target_key

    before = cluster.controller_status()["targets"]
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        client.set(target_key(cluster.config.namespace, "decode"), "100000", ex=60)
        client.set(target_key(cluster.config.namespace, "prefill"), "lots", ex=60)
        wait_for("the controller to read both", lambda: not client.exists(
            target_key(cluster.config.namespace, "decode"), target_key(cluster.config.namespace, "prefill")), 30)
    finally:
        client.close()
    status = cluster.controller_status()
    assert status["targets"] == before and not any("100000" in a for a in status["actions"])
