"""Checks on a running LocalCluster, and cluster configs, that several test modules share."""
from __future__ import annotations

import os
import re
import select
import subprocess
import time
from pathlib import Path

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


def start_serving(cmd: list[str], secret: str, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Starts a process (stderr to `log`) and waits up to 120 s for its 'serving on HOST:PORT' line."""
    err = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "SPLITSERVE_CLUSTER_SECRET": secret})
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if found := re.search(r"serving on (\S+:\d+)", line):
                return proc, found[1]
            if not line and proc.poll() is not None:
                break
    proc.kill()
    detail = log.read_text()[-2000:] if log is not None else ""
    raise AssertionError(f"{cmd[:8]} did not start (exit code {proc.poll()}) {detail}")


def one_and_one(model_dir: str) -> ClusterConfig:
    """1 prefill + 1 decode worker on the tiny model, mode auto (prompts with fewer than 8
    uncached tokens are prefilled on the decode worker), a router on a free port."""
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)))
