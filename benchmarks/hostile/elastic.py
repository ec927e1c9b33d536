"""Elastic pools under steady load: one JSON line with what this machine can measure.

A local cluster (1 prefill + 1 decode) serves a closed loop of --concurrency clients while
the decode pool goes 1 -> 2 -> 1 for --cycles cycles, then one decode worker is killed:
- scale-up: from the decision to the new worker serving (p50, max);
- drain: from the decision to the drained worker stopped (p50, max);
- requests failed while scaling (target 0), and after the kill (the only decode worker:
  requests wait for its replacement up to RouterConfig.no_worker_wait_s), completed;
- kill -9: from the kill to the pool back at its target.
On two cores more workers add no compute, so this says nothing about the policy's efficiency.

  ./dev python benchmarks/hostile/elastic.py [--cycles 20] [--concurrency 2]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.model.tiny_model import make_tiny_model
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig


def serving(cluster: LocalCluster, role: str) -> list[str]:
    return sorted(w for w, s in cluster.controller_status()["workers"].items() if w.startswith(role) and s == "serving")


def until(predicate, timeout_s: float = 300.0) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` holds (polled every 50 ms)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


class Load:
    """A closed loop of clients; counts completed and failed requests."""

    def __init__(self, address: str, concurrency: int, prompt_len: int, max_tokens: int) -> None:
        self.address, self.prompt_len, self.max_tokens = address, prompt_len, max_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while not self.stop.is_set():
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[rng.randrange(3, 500) for _ in range(self.prompt_len)]),
                    sampling=pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
                try:
                    list(stub.Generate(request, timeout=120))
                    with self._lock:
                        self.completed += 1
                except grpc.RpcError as e:
                    with self._lock:
                        self.failed.append(f"{e.code().name}: {e.details()}")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="llama", size="tiny", seed=0))
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=16 * 2**20),
        num_prefill=1, num_decode=1, worker_num_cpus=0.25, supervise_interval_s=0.25, drain_timeout_s=20.0,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=32)))
    cluster = LocalCluster(config)
    cluster.start()
    up_s, drain_s = [], []
    try:
        load = Load(cluster.address, args.concurrency, args.prompt_len, args.max_tokens)
        for _ in range(args.cycles):
            cluster.scale("decode", 2)
            up_s.append(until(lambda: len(serving(cluster, "decode")) == 2))
            drains = cluster.controller_status()["num_drains"]
            cluster.scale("decode", 1)
            drain_s.append(until(lambda: cluster.controller_status()["num_drains"] > drains))  # noqa: B023
        failed_scaling, completed_scaling = len(load.failed), load.completed
        [victim] = serving(cluster, "decode")
        cluster.kill_worker(victim)
        replaced_s = until(lambda: [w for w in serving(cluster, "decode") if w != victim] != [])
        time.sleep(2.0)  # requests that waited for the replacement complete
        load.finish()
    finally:
        cluster.stop()
    ms = 1e3
    print(json.dumps({
        "benchmark": "elastic", "config": vars(args),
        "scale_up_to_serving_ms": {"p50": round(statistics.median(up_s) * ms), "max": round(max(up_s) * ms)},
        "drain_ms": {"p50": round(statistics.median(drain_s) * ms), "max": round(max(drain_s) * ms)},
        "kill_to_replaced_ms": round(replaced_s * ms),
        "scaling": {"requests_completed": completed_scaling, "requests_failed": failed_scaling},
        "kill": {"requests_completed": load.completed - completed_scaling,
                 "requests_failed": len(load.failed) - failed_scaling},
        "failures": load.failed[:5],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
