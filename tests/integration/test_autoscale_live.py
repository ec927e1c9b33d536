"""The autoscaler live: a load ramp through the public gRPC path grows the prefill pool once
its queue time passes the TTFT budget, and the pool shrinks back after the load stops; no
request fails on the way. On an idle machine that is one action each way. On a loaded one
(CI beside two busy loops) the clients' requests may spend their time in decode, the prefill
queue empties for the down delay and the pool shrinks and grows again while they run: the
actions then alternate, a cooldown apart, and still end with the pool back at one."""
from __future__ import annotations

import itertools
import random
import threading
import time

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from control.autoscaler import AutoscaleConfig
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)


def test_a_load_ramp_grows_prefill_and_it_shrinks_after(tiny_llama_dir: str) -> None:
    autoscale = AutoscaleConfig(prefill_min=1, prefill_max=2, decode_min=1, decode_max=1, ttft_slo_ms=20.0,
                                up_delay_s=1.0, down_delay_s=4.0, cooldown_s=2.0)
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=16 * 2**20,
                            max_num_batched_tokens=256, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.25, supervise_interval_s=0.5, drain_timeout_s=10.0,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")), autoscale=autoscale)
    cluster = LocalCluster(config)
    cluster.start()
    stop = threading.Event()
    failures: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while not stop.is_set():
                prompt = [rng.randrange(3, 500) for _ in range(1500)]
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                             sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
                try:
                    list(stub.Generate(request, timeout=120))
                except grpc.RpcError as e:
                    failures.append(f"{e.code().name}: {e.details()}")

    try:
        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 90
        while cluster.controller_status()["targets"]["prefill"] < 2:
            assert time.monotonic() < deadline, cluster.controller_status()["actions"]
            time.sleep(0.5)
        grown = [a for a in cluster.controller_status()["actions"] if "autoscaler: prefill 1 -> 2" in a]
        assert grown and "prefill queue" in grown[0]
        stop.set()
        for t in clients:
            t.join(150)
        deadline = time.monotonic() + 90
        while (status := cluster.controller_status())["targets"]["prefill"] > 1 or len(
                [w for w in status["workers"] if w.startswith("prefill")]) > 1:
            assert time.monotonic() < deadline, status["actions"]
            time.sleep(0.5)
        actions = [a for a in status["actions"] if "autoscaler:" in a]
        kinds = [("prefill 1 -> 2" in a, "prefill 2 -> 1" in a) for a in actions]
        assert len(kinds) % 2 == 0 and kinds == [(True, False), (False, True)] * (len(kinds) // 2), actions
        times = [3600 * int(a[:2]) + 60 * int(a[3:5]) + int(a[6:8]) for a in actions]  # "HH:MM:SS what"
        assert all((b - a) % 86400 >= autoscale.cooldown_s - 1 for a, b in itertools.pairwise(times)), actions
        assert failures == []
    finally:
        stop.set()
        cluster.stop()
