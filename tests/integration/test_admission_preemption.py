"""Outputs far longer than admission expected (router/output_lengths.py): a tenant's requests
stop after 10 tokens, then suddenly run to 400. Charged what was expected, all are admitted;
the decode worker's pool fills, it preempts and recomputes, and every request still gets the
tokens of an uninterrupted run, none fails; the charge follows what they hold, and after a
tenth of the window's requests ran long the learned length is theirs (the 0.9 quantile)."""
from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle, greedy, wait_for

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(900)

POOL_TOKENS = 1200
"""The decode pool: 75 blocks of 16 tokens (the tiny model's KV is 512 bytes a token)."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=POOL_TOKENS * 512, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as c:
        yield c


def run(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int, stop: int) -> list[int]:
    """A greedy request that may stop early (a stop token, which never comes: the tiny model's
    random text would stop at EOS anywhere), so admission charges it what is expected; one
    that cannot stop before max_tokens is charged max_tokens."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), tenant="t", sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[stop]))
    return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]


def test_outputs_ten_times_longer_than_expected_are_preempted_recomputed_and_exact(
        cluster: LocalCluster, tiny_llama_dir: str) -> None:
    prompts = [[3 + i, 7, 11 + i, 13] * 5 for i in range(13)]  # 20 tokens each
    want = [greedy(tiny_llama_dir, p, 400) for p in prompts]
    stop = min(set(range(3, 512)) - {t for w in want for t in w})
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for p, w in zip(prompts[:8], want, strict=False):  # the tenant's requests stop after 10 tokens: charged 30 each
            assert run(stub, p, 10, stop) == w[:10]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # then 4 at once run to 400: 1,680 > 1,200 tokens
            long = list(pool.map(lambda p: run(stub, p, 400, stop), prompts[8:12]))
        assert long == want[8:12]
        [decode] = [r for r in cluster.check_idle() if "num_preemptions" in r]
        assert decode["num_preemptions"] > 0  # the pool filled: preempted and recomputed, nothing failed
        [stats] = cluster.router_stats()
        assert stats["num_refused"] == 0
        # 4 of the window's 12 ran long: the 0.9 quantile is theirs now; the next is charged 20 + 400 at once
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            one = pool.submit(run, stub, prompts[12], 400, stop)
            charged = wait_for("the next request admitted", lambda: cluster.router_stats()[0]["inflight_tokens"])
            assert charged == 20 + 400
            assert one.result(timeout=300) == want[12]
    assert_idle(cluster)
