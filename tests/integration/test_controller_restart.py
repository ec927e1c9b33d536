"""The controller is not a single point of failure: kill -9 of its process (real Ray, a real
redis-server, gRPC on loopback) leaves every worker and router serving; Ray restarts it, and
the new one adopts the running actors by name (no duplicates; the node's KV store too),
finishes what the dead one had begun (a drain, a launch) and supervises again. The tests
share one cluster and run in order."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import threading
import time

import pytest
import ray
import redis

from cluster import named_actors
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.config import StepFloor
from kvfabric.region import segments_of
from kvstore.host import read_stores
from proto import generate_pb2 as pb
from router.policy import RoutingConfig
from tests.integration.cluster_checks import decode_pids, generate, greedy, tokens, wait_for

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

LONG = 64
"""Tokens per request: six of them stream for seconds (`FLOOR`)."""
FLOOR = StepFloor(base_s=0.08)
"""Each engine step takes at least this long: the tiny model's requests stream for ~5 s, as a
real model's would, without the CPU a real model burns."""


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str) -> str:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def cluster(model_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=16 * 2**20, step_profile_s=0,
                            kv_lease_s=3.0,
                            step_floor=FLOOR),
        num_prefill=1, num_decode=1, num_routers=2, namespace="ctl-restart", kv_store_mib=16,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")),
        worker_num_cpus=0.25, supervise_interval_s=0.5, drain_timeout_s=30.0)
    with LocalCluster(config) as c:
        yield c


def timed(stub, prompt: list[int], max_tokens: int,  # type: ignore[no-untyped-def]
          first: threading.Event) -> tuple[list[int], list[float]]:
    """A greedy request's tokens and the monotonic time each response arrived (`first` is set
    at the first)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    got, at = [], []
    for r in stub.Generate(request, timeout=180):
        got += r.token_ids
        at.append(time.monotonic())
        first.set()
    return got, at


def kill9_controller(cluster: LocalCluster) -> int:
    """kill -9 of the controller's process; returns the pid of the one Ray started in its place."""
    pid = cluster.controller_pid()
    os.kill(pid, signal.SIGKILL)

    def back() -> int | None:
        try:
            status = cluster.controller_status()
        except ray.exceptions.RayError:
            return None  # restarting
        return int(status["pid"]) if status["pid"] != pid and any("controller restarted" in a
                                                                 for a in status["actions"]) else None

    return wait_for("the controller to come back", back, 60)


def count(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    """Per role: (named actors in Ray, heartbeats in Redis)."""
    names = named_actors.list_names(cluster.config.namespace)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        beats = [k.decode().rsplit(":", 1)[1] for k in client.keys(f"{cluster.config.namespace}:hb:*")]
    finally:
        client.close()
    return {role: (sum(named_actors.role_of(n) == role for n in names), sum(named_actors.role_of(b) == role
                                                                            for b in beats))
            for role in ("prefill", "decode", "router")}


def serving(cluster: LocalCluster, role: str) -> list[str]:
    return sorted(w for w, s in cluster.controller_status()["workers"].items() if w.startswith(role) and s == "serving")


def busy(cluster: LocalCluster, worker_id: str) -> int:
    return sum(s["active"].get(worker_id, 0) for s in cluster.router_stats())


def at_rest(cluster: LocalCluster, prefill: int, decode: int) -> bool:
    """The pools are at these sizes, every member serving, nothing more in Ray or in Redis."""
    status = cluster.controller_status()
    states = list(status["workers"].values())
    seen = count(cluster)
    return (states.count("serving") == len(states) == prefill + decode
            and seen == {"prefill": (prefill, prefill), "decode": (decode, decode), "router": (2, 0)})


def test_requests_streaming_through_a_controller_kill_finish_exactly(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                     model_dir: str) -> None:
    cluster.scale("decode", 1)  # whatever ran before: the pools at 1 and 1
    wait_for("the pools at rest", lambda: at_rest(cluster, 1, 1), 120)
    before = {w["worker_id"]: w["pid"] for w in cluster.workers()}
    store = wait_for("the node's KV store registered", lambda: read_stores(cluster.redis_url, "ctl-restart"), 60)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(20 + i)] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        firsts = [threading.Event() for _ in prompts]
        futures = [pool.submit(timed, stub, p, LONG, e) for p, e in zip(prompts, firsts, strict=True)]
        assert all(e.wait(60) for e in firsts)  # all six streaming
        killed_at = time.monotonic()
        kill9_controller(cluster)
        results = [f.result() for f in futures]
    for p, (got, at) in zip(prompts, results, strict=True):
        assert at[-1] > killed_at  # streamed through the kill
        assert got == greedy(model_dir, p, LONG)
    assert {w["worker_id"]: w["pid"] for w in cluster.workers()} == before  # adopted, not relaunched
    wait_for("the pools at rest", lambda: at_rest(cluster, 1, 1), 30)
    # the node's store adopted too: the same one serving, no second started
    after = read_stores(cluster.redis_url, "ctl-restart")
    assert [(e["store_id"], e["address"]) for e in after] == [(e["store_id"], e["address"]) for e in store]
    assert sum(n.startswith("kvstore-") for n in named_actors.list_names("ctl-restart")) == 1


def test_the_restarted_controller_replaces_a_killed_worker_and_scales(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                      model_dir: str) -> None:
    cluster.scale("decode", 1)  # whatever ran before: one decode worker, to kill
    [victim] = wait_for("one decode worker", lambda: at_rest(cluster, 1, 1) and serving(cluster, "decode"), 120)
    cluster.kill_worker(victim)
    wait_for(f"{victim} replaced", lambda: [w for w in serving(cluster, "decode") if w != victim], 120)
    wait_for("the pools at rest", lambda: at_rest(cluster, 1, 1), 30)
    cluster.scale("decode", 2)
    wait_for("two decode workers", lambda: at_rest(cluster, 1, 2), 120)
    prompt = list(range(5, 40))
    assert tokens(generate(stub, prompt, 8)) == greedy(model_dir, prompt, 8)


def test_a_controller_killed_in_the_middle_of_a_drain_finishes_it(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                  model_dir: str) -> None:
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 500) for _ in range(24 + i)] for i in range(6)]
    cluster.scale("decode", 2)  # whatever ran before: two decode workers, one to drain
    wait_for("two decode workers", lambda: at_rest(cluster, 1, 2), 120)
    pids = decode_pids(cluster)
    # each decode worker's shared memory: its KV pool and its KV tier's staging area
    assert len(pids) == 2 and all(len(segments_of({pid})) == 2 for pid in pids.values())
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, stub, p, LONG) for p in prompts]
        wait_for("requests running on both decode workers (the drained one has some to finish)",
                 lambda: all(busy(cluster, w) for w in serving(cluster, "decode")), 30)
        cluster.scale("decode", 1)
        wait_for("a drain under way", lambda: "draining" in cluster.controller_status()["workers"].values(), 30)
        kill9_controller(cluster)
        results = [f.result() for f in futures]
    for p, got in zip(prompts, results, strict=True):
        assert tokens(got) == greedy(model_dir, p, LONG)
    wait_for("the pool back at 1 decode worker", lambda: at_rest(cluster, 1, 1), 60)
    [(kept, kept_pid)] = decode_pids(cluster).items()
    assert len(segments_of({kept_pid})) == 2  # the one decode worker's pool and staging; the drained one's are gone
    assert segments_of({pid for w, pid in pids.items() if w != kept}) == set()
    assert cluster.controller_status()["num_drains"] >= 1


def test_a_controller_killed_in_the_middle_of_a_launch_adopts_the_new_worker(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                              model_dir: str) -> None:
    cluster.scale("decode", 2)
    wait_for("a launch under way", lambda: "starting" in cluster.controller_status()["workers"].values(), 30, )
    kill9_controller(cluster)
    wait_for("the pool at 2 decode workers", lambda: at_rest(cluster, 1, 2), 120)
    pids = decode_pids(cluster)
    # each decode worker's shared memory: its KV pool and its KV tier's staging area
    assert len(pids) == 2 and all(len(segments_of({pid})) == 2 for pid in pids.values())
    prompt = list(range(7, 50))
    assert tokens(generate(stub, prompt, 8)) == greedy(model_dir, prompt, 8)
