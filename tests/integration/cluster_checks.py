"""Checks on a running LocalCluster, and cluster configs, that several test modules share."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import NODE_SYSTEM_CONFIG, LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.reference import make_engine


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    """`predicate()`'s first truthy value, polled; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.25)
    return value


def generate(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int,
             streaming: threading.Event | None = None) -> list[pb.GenerateResponse]:
    """One greedy request (ignore_eos) through the public Generate stream; `streaming` is set
    at its first token."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    responses = []
    for r in stub.Generate(request, timeout=120):
        responses.append(r)
        if streaming is not None and r.token_ids:
            streaming.set()
    return responses


def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The monolithic engine's greedy tokens (the reference a cluster must equal)."""
    engine = make_engine(model_dir, block_size=16)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


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
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)))


STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
"""What Ray says when a node's start outran one of its fixed waits."""


def ray_head(**head_node_args: Any) -> Any:
    """A `ray.cluster_utils.Cluster` with its head node, started as `ray_started` starts a node."""
    from ray.cluster_utils import Cluster

    return ray_started(lambda: Cluster(initialize_head=True,
                                       head_node_args={"include_dashboard": False, **head_node_args}))


def ray_added_node(cluster: Any, **node_args: Any) -> Any:
    """One more node of `cluster` (`ray_head`'s), started as `ray_started` starts a node."""
    return ray_started(lambda: cluster.add_node(**node_args))


def ray_started(start: Callable[[], Any]) -> Any:
    """`start()`, a Ray node's start. Ray gives a raylet a fixed 30 s to register with its GCS,
    which a loaded CI machine can miss (seen twice in one day, each time as "The current node
    timed out during startup", once more for a second node of test_ray_nodes), and its GCS a
    fixed wait to write its port (missed once: "Timed out waiting for file
    .../gcs_server_port_..."); such a start is tried again, three times in all, after killing
    what the failed one left (this process's new Ray children)."""
    import psutil

    me = psutil.Process()
    for attempt in range(3):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if not any(m in str(e) for m in STARTUP_TIMEOUTS) or attempt == 2:
                raise
            for p in me.children(recursive=True):
                if p.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            time.sleep(2.0)
    raise AssertionError("unreachable")


SHARED_NODE_CPUS = 32
"""The shared node's CPUs: Ray's bookkeeping only (a test's workers run one torch thread
each), room for any of the sharing modules' pools (LocalCluster's own node offers its pools
plus headroom)."""

_shared: list[str] = []
"""The GCS address of this process's shared Ray node while it runs."""


def join_shared_node() -> None:
    """This test process's Ray node for the clusters of the modules that share one
    (`SHARES_RAY_NODE`, tests/integration/conftest.py): started by the first such module and
    kept for the next, where each module's LocalCluster started and stopped a node of its own
    (about 4 s and 5 CPU-seconds a start, on a 2-core machine where the suite is CPU-bound).
    A cluster on it is stopped as on its own node (LocalCluster.stop: every actor of its
    namespace, its Redis, its KV segments); only the node stays."""
    if ray.is_initialized():
        if _shared and ray.get_runtime_context().gcs_address == _shared[0]:
            return
        ray.shutdown()  # a node this process joined or started some other way
    _shared.clear()

    def start() -> None:
        try:
            ray.init(address="local", num_cpus=SHARED_NODE_CPUS, include_dashboard=False,
                     logging_level=logging.WARNING, configure_logging=False, log_to_driver=True,
                     _system_config=NODE_SYSTEM_CONFIG)
        except BaseException:
            ray.shutdown()  # the driver's half of a failed start, before another try
            raise
    ray_started(start)
    _shared.append(ray.get_runtime_context().gcs_address)


def leave_shared_node() -> None:
    """No shared node up in this process (a module that starts its own, or none)."""
    if _shared and ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared[0]:
        ray.shutdown()
    _shared.clear()


def decode_pids(cluster: LocalCluster) -> dict[str, int]:
    """The decode workers' process ids by worker id (each owns one KV pool segment)."""
    return {w["worker_id"]: int(w["pid"]) for w in cluster.workers() if w.get("role") == "decode" and w.get("pid")}


def wait_threads(pid: int, states: set[str], what: str, timeout_s: float = 10.0) -> None:
    """Until every thread of `pid` left is in one of `states` (its /proc/PID/task/*/stat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError):
                seen.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if all(x in states for x in seen):
            return
        assert time.monotonic() < deadline, f"pid {pid} not {what} within {timeout_s} s: {seen}"
        time.sleep(0.005)
