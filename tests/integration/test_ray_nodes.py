"""A Ray cluster of a head and two worker nodes, started the way `ray start` starts them
(`ray.cluster_utils.Cluster`: separate raylets), each worker node offering one custom
resource: splitserve joins it (`ClusterConfig.ray_address`, serve's `--ray-address`), its
prefill workers land only on the `prefill` node and its decode workers only on the `decode`
node, and greedy output through router -> P -> kvfabric -> D equals the monolithic engine.
Only this test's own nodes are stopped."""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import ray

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle, ray_head, ray_added_node
from tests.integration.reference import make_engine

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    """The test's Ray cluster; yields its address and each role's node id."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = ray_head(num_cpus=2)
    try:
        prefill = ray_added_node(cluster, num_cpus=1, resources={"prefill": 2})
        decode = ray_added_node(cluster, num_cpus=1, resources={"decode": 2})
        cluster.wait_for_nodes()
        yield {"address": cluster.address, "prefill": prefill.node_id, "decode": decode.node_id,
               "head": cluster.head_node.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()  # this cluster's own processes only


def test_workers_land_on_their_node_type_and_greedy_output_is_exact(nodes: dict[str, str],
                                                                    tiny_llama_dir: str) -> None:
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=2, num_decode=2, worker_num_cpus=0.25, ray_address=nodes["address"],
        role_resources={"prefill": {"prefill": 1}, "decode": {"decode": 1}},
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as cluster:
        placed = {w["worker_id"]: w["node_id"] for w in cluster.workers()}
        assert placed == {"prefill-0": nodes["prefill"], "prefill-1": nodes["prefill"],
                          "decode-0": nodes["decode"], "decode-1": nodes["decode"]}
        prompt = list(range(5, 70))
        with grpc.insecure_channel(cluster.address) as channel:
            responses = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                timeout=60))
        want = make_engine(tiny_llama_dir, block_size=16).generate([prompt], SamplingParams(
            max_tokens=8, ignore_eos=True))[0].token_ids
        assert [t for r in responses for t in r.token_ids] == want
        assert responses[-1].route.prefill_worker.startswith("prefill-")  # it crossed from P to D
        assert_idle(cluster)
