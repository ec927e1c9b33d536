"""A Redis outage on a running cluster: the embedded redis-server is killed -9, requests keep
being served meanwhile, the local cluster starts it again on its port, and the workers'
heartbeats, the routers' feed and the controller's view all come back."""
from __future__ import annotations

import os
import random
import signal
import time

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.reference import make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(300)


def test_a_killed_embedded_redis_is_restarted_and_serving_never_stops(tiny_llama_dir: str) -> None:
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)))
    cluster = LocalCluster(config)
    cluster.start()
    try:
        assert cluster.redis is not None
        old_pid = cluster.redis.pid
        rng = random.Random(9)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            def check() -> None:
                prompt = [rng.randrange(3, 500) for _ in range(30)]
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                             sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
                got = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
                want = make_engine(tiny_llama_dir, block_size=16).generate(
                    [prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
                assert got == want

            check()
            os.kill(old_pid, signal.SIGKILL)
            check()  # served while Redis is down (or just back): the hot path never waits on it
            deadline = time.monotonic() + 30
            while cluster.num_redis_restarts < 1 or not cluster.redis.alive():
                assert time.monotonic() < deadline, "the embedded redis-server was not restarted"
                time.sleep(0.2)
            assert cluster.redis.pid != old_pid
            deadline = time.monotonic() + 30
            while not all(s["redis_healthy"] for s in cluster.router_stats()):
                assert time.monotonic() < deadline, cluster.router_stats()
                time.sleep(0.2)
            import redis as redis_client

            client = redis_client.Redis.from_url(cluster.redis_url)
            deadline = time.monotonic() + 10
            while len(client.keys("splitserve:hb:*")) < 2:  # the workers' heartbeats are back
                assert time.monotonic() < deadline, client.keys("*")
                time.sleep(0.2)
            client.close()
            check()
    finally:
        cluster.stop()
