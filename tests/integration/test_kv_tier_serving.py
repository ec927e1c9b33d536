"""The shared KV tier through a cluster (`serve --kv-store-mib`): the controller starts the
node's store, the workers find it in Redis; a conversation whose blocks the workers' small
pools evicted is served again from the store, with the tokens of the whole model and its
prompt counted as cached, on the prefill worker (disaggregated) or the decode worker's own
prefill (colocated); afterwards nothing is held anywhere."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from control.auth import TOKEN_METADATA, cluster_token
from control.tls import given_tls, member_channel_sync, member_tls
from engine.core.request import SamplingParams
from kvstore.host import find_store
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.reference import make_engine, random_prompts
from tests.pki import make_ca

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

POOL_BLOCKS = 24


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_an_evicted_conversation_is_served_from_the_nodes_store(tiny_llama_dir: str, mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Disaggregated, the members show certificates of a deployment's own CA (`serve --tls-ca
    --tls-cert --tls-key`): the controller hands them to the routers, workers and store."""
    block_bytes = make_engine(tiny_llama_dir, block_size=16, num_blocks=8).layout.block_bytes
    given = None
    if mode == "disaggregated":
        ca = make_ca()
        given = given_tls(str(ca.write(tmp_path / "ca.pem")), *map(str, ca.issue(tmp_path, "members")))
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=POOL_BLOCKS * block_bytes,
                            given_tls=given, step_profile_s=0),
        num_prefill=1 if mode == "disaggregated" else 0, num_decode=1, kv_store_mib=16, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode=mode)))
    prompt, *others = random_prompts([170, 170, 170, 170], 512, seed=6)  # 10 full blocks each, 24 in a pool
    want = make_engine(tiny_llama_dir, block_size=16).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    with LocalCluster(config) as cluster:
        token = (TOKEN_METADATA, cluster_token(cluster.config.worker.cluster_secret))
        entry = find_store(cluster.redis_url, config.namespace, timeout_s=0)
        assert entry is not None
        store = entry.address
        with grpc.insecure_channel(cluster.address) as channel, \
                member_channel_sync(store, cluster.config.worker.tls) as store_channel:
            stub, stats = pb_grpc.GenerationStub(channel), pb_grpc.KVStoreStub(store_channel)

            def generate(p: list[int]) -> tuple[list[int], int]:
                got = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                    max_tokens=8, ignore_eos=True, temperature=0)), timeout=120))
                return [t for r in got for t in r.token_ids], got[-1].usage.cached_tokens

            assert generate(prompt) == (want, 0)
            for other in others:  # 30 blocks more than the pools hold: the first prompt's are evicted
                generate(other)
            assert stats.Stats(pb.StatsRequest(), metadata=[token]).num_fetched == 0
            # the router learns what the store holds from the store's event stream (its hint
            # skips the lookup where it saw nothing there): the turn comes back once it knows
            deadline = time.monotonic() + 20
            while not (known := cluster.router_stats()[0].get("store_blocks", {})).get(entry.store_id, 0) >= 40:
                assert time.monotonic() < deadline, known
                time.sleep(0.2)
            assert generate(prompt) == (want, 160)  # its 10 full blocks, from the store
            assert stats.Stats(pb.StatsRequest(), metadata=[token]).num_fetched == 10
            with pytest.raises(grpc.RpcError) as refused:  # the store serves its cluster only
                stats.Stats(pb.StatsRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        if given is not None:  # the certificate the secret would make is a stranger's here
            with member_channel_sync(store, member_tls(cluster.config.worker.cluster_secret)) as channel, \
                    pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), metadata=[token], timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        operator_sees_the_store(cluster, entry, "prefill" if mode == "disaggregated" else "decode")
        assert_idle(cluster)


def operator_sees_the_store(cluster: LocalCluster, entry, fetcher: str) -> None:  # type: ignore[no-untyped-def]
    """What an operator sees after 10 blocks were fetched: the store in `status`, its /metrics
    and the fetching worker's among the targets."""
    store = entry.address
    cli = [sys.executable, "-m", "cluster.cli"]
    line = rf"{entry.store_id} on {re.escape(store)}: \d+/\d+ blocks held, \d+ stored .* 10 fetched"
    # and the fetching worker's line: its fetch timed (what routers now price its hits by)
    timed = (rf"{fetcher}-0 fetches from {entry.store_id}: [\d.]+ ms \+ [\d.]+ ms a block from its host's store; "
             rf"computes a block in [\d.]+ ms")
    deadline = time.monotonic() + 20  # the store's entry and the heartbeats are rewritten every second
    while not (re.search(line, status := subprocess.run([*cli, "status", "--redis-url", cluster.redis_url],
                                                        capture_output=True, text=True, timeout=60,
                                                        check=True).stdout) and re.search(timed, status)):
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    targets = json.loads(subprocess.run([*cli, "metrics-targets", "--redis-url", cluster.redis_url],
                                        capture_output=True, text=True, timeout=60, check=True).stdout)
    by_role = {t["labels"]["role"]: t["targets"][0] for t in targets}
    assert "splitserve:kv_store_fetched_blocks_total 10.0" in scrape(by_role["kv_store"])
    assert re.search(r'splitserve:kv_tier_fetched_blocks_total\{[^}]*\} 10.0', scrape(by_role[fetcher]))
