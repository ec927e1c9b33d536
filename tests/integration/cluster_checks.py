"""Checks on a running LocalCluster, and cluster configs, that several test modules share."""
from __future__ import annotations

import time

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from router.policy import RoutingConfig


def assert_idle(cluster: LocalCluster, timeout_s: float = 15.0) -> None:
    """Within `timeout_s` the cluster holds nothing for any request (`LocalCluster.holdings`)."""
    deadline = time.monotonic() + timeout_s
    while held := cluster.holdings():
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {timeout_s} s after the test: {held}")
        time.sleep(0.2)


def one_and_one(model_dir: str) -> ClusterConfig:
    """1 prefill + 1 decode worker on the tiny model, mode auto (prompts with fewer than 8
    uncached tokens are prefilled on the decode worker), a router on a free port."""
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)))
