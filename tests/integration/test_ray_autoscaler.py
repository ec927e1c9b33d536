"""The Ray autoscaler under splitserve, on one machine: a head started with deploy/local.yaml
as its autoscaling config (Ray's `fake_multinode` provider: each node another raylet here).
The autoscaler starts the prefill and decode nodes the file asks for; `splitserve scale
decode 3` asks for more `decode` than the node offers, Ray adds a decode node, and the new
worker serves exact greedy tokens; after `scale decode 1` the emptied decode node is removed
once idle, and nothing is left held. Only this test's own Ray processes are stopped."""
from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from ray._private.services import get_node_ip_address
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from cluster.redis_server import free_port
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle, generate, greedy, tokens, wait_for

pytestmark = pytest.mark.timeout(600)

LOCAL_YAML = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
PROVIDER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def descendants(pids: list[int]) -> list[int]:
    """Every process below `pids` (from /proc): the nodes the autoscaler's monitor started."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        children = [child for child, ppid in parent.items() if ppid == pid]
        out += children
        todo += children
    return out


@pytest.fixture
def autoscaling_ray(tmp_path: Path) -> Iterator[Cluster]:
    """A head whose monitor runs the autoscaler with deploy/local.yaml (its GCS on a free port
    instead of 6379, idle nodes removed after 6 s instead of 30 s)."""
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    config = yaml.safe_load(LOCAL_YAML.read_text())
    config["provider"]["gcs_address"] = f"{get_node_ip_address()}:{port}"
    config["idle_timeout_minutes"] = 0.1
    (tmp_path / "autoscaling.json").write_text(json.dumps(config))
    saved = {k: os.environ.get(k) for k in PROVIDER_ENV}
    os.environ.update(PROVIDER_ENV)  # read by the monitor process the head starts
    try:
        head = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": False, "gcs_server_port": port,
            "autoscaling_config": str(tmp_path / "autoscaling.json")})
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        yield head
    finally:
        nodes = descendants([p.process.pid for p in head.head_node.all_processes.get("monitor", [])])
        ray.shutdown()
        head.shutdown()
        for pid in nodes:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def decode_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("decode")}


def decode_workers_placed(cluster: LocalCluster, n: int) -> dict[str, str] | None:
    """worker id -> node id once `n` decode workers serve (each knows its node), else None."""
    placed = {w["worker_id"]: w.get("node_id") for w in cluster.workers() if w["role"] == "decode"}
    return placed if len(placed) == n and all(placed.values()) else None  # type: ignore[return-value]


def generate_exact(stub: pb_grpc.GenerationStub, model_dir: str, prompt: list[int]) -> str:
    """One request through router -> P -> kvfabric -> D with the monolithic engine's tokens;
    returns the decode worker that served it."""
    got = generate(stub, prompt, 6)
    assert tokens(got) == greedy(model_dir, prompt, 6)
    return got[-1].route.decode_worker


def test_ray_adds_a_decode_node_for_a_scale_up_and_removes_it_after(autoscaling_ray: Cluster,
                                                                   tiny_llama_dir: str) -> None:
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.25, ray_address=autoscaling_ray.address,
        role_resources={"prefill": {"prefill": 1}, "decode": {"decode": 1}}, supervise_interval_s=0.5,
        drain_timeout_s=10.0, place_timeout_s=120.0,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as cluster:  # its workers wait for the nodes the autoscaler starts
        first = decode_nodes()
        assert len(first) == 1
        cluster.scale("decode", 3)  # the node offers decode: 2; the third worker needs a new node
        placed = wait_for("3 decode workers placed", lambda: decode_workers_placed(cluster, 3), 120)
        added = decode_nodes() - first
        assert len(added) == 1 and placed["decode-2"] in added  # Ray added a decode node for decode-2
        wait_for("the router routes to decode-2",
                 lambda: "decode-2" in cluster.router_stats()[0]["serving"]["decode"], 30)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            served = set()
            # until the new worker has served one: idle decode workers tie (cached blocks count as
            # free) and the router picks among ties at random, so 12 tries missed it 1 time in 130
            for i in range(40):
                served.add(generate_exact(stub, tiny_llama_dir, list(range(5 + i, 60 + i))))
                if "decode-2" in served:
                    break
            assert "decode-2" in served
            cluster.scale("decode", 1)
            wait_for("the emptied decode node removed", lambda: len(decode_nodes()) == 1, 120)
            survivor = [w for w in cluster.workers() if w["role"] == "decode"]
            assert len(survivor) == 1 and decode_nodes() == {survivor[0]["node_id"]}
            assert generate_exact(stub, tiny_llama_dir, list(range(100, 140))) == survivor[0]["worker_id"]
        assert_idle(cluster)
