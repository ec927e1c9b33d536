"""Workers dying under requests: real Ray actors killed mid-flight, a real redis-server, gRPC on loopback.

The invariant (docs/architecture.md): worker death frees KV on every worker involved within
a bounded time, and the router never loses a request silently: it completes elsewhere
(continuing from the tokens already streamed) or ends with a status that says why.
The first tests share one cluster (2 prefill + 2 decode), each killing one worker of its own
choice (so they pass alone and in either order); the last kills its cluster's only decode
worker, in a cluster of its own. The live workers must end every test idle.
"""
from __future__ import annotations

import random
import time

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import wait_for
from tests.integration.reference import make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=LEASE_S),
        num_prefill=2, num_decode=2,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8),
                            worker_down_s=600.0),
        worker_num_cpus=0.5, replace_dead_workers=False)  # the routers' retries alone (replacement: test_elastic)
    with LocalCluster(config) as c:
        yield c


def live_idle(cluster: LocalCluster, timeout_s: float = 4 * LEASE_S + 5) -> list[str]:
    """Waits until every live worker is idle (a killed writer's blocks wait out the lease); returns the dead."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = cluster.check_idle()
        busy = [r for r in reports if not r.get("dead") and (
            r["usage"]["num_in_use"] or r["num_unfinished"] or r["num_handed_off"] or r.get("held_blocks")
            or r.get("num_transfers") or r.get("num_streams") or r.get("num_waiters"))]
        if not busy:
            return sorted(r["worker_id"] for r in reports if r.get("dead"))
        if time.monotonic() > deadline:
            raise AssertionError(f"live workers not idle {timeout_s} s after the failure: {busy}")
        time.sleep(0.2)


def request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def greedy(tiny_llama_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(tiny_llama_dir, block_size=16)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def retries(cluster: LocalCluster) -> int:
    return int(cluster.router_stats()[0]["num_retries"])


def test_dead_prefill_worker_request_retried_on_the_other(cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(11)
    first = [rng.randrange(3, 500) for _ in range(40)]
    got = list(stub.Generate(request(first, 4), timeout=60))
    victim = got[-1].route.prefill_worker
    assert victim.startswith("prefill-")
    live_idle(cluster)
    wait_for("the router to index the victim's blocks of it",  # else the choice below is a coin flip
             lambda: cluster.router_stats()[0]["index_blocks"].get(victim, 0) >= 2, 10)
    before = retries(cluster)

    cluster.kill_worker(victim)
    # shares 2 cached blocks with `first` on the victim only, so the router picks the victim
    second = first[:32] + [rng.randrange(3, 500) for _ in range(20)]
    got = list(stub.Generate(request(second, 12), timeout=60))

    assert [t for r in got for t in r.token_ids] == greedy(tiny_llama_dir, second, 12)
    final = got[-1]
    assert final.route.prefill_worker not in ("", victim) and not final.route.local_prefill
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(second), 12)
    assert retries(cluster) == before + 1
    assert victim in live_idle(cluster)
    stats = cluster.router_stats()[0]
    assert victim in stats["down_workers"]


def test_dead_decode_worker_mid_stream_request_continues_elsewhere(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                   tiny_llama_dir: str) -> None:
    prompt = [random.Random(12).randrange(3, 500) for _ in range(20)]
    max_tokens = 1500
    before = retries(cluster)
    stream = stub.Generate(request(prompt, max_tokens), timeout=120)
    head = next(stream)
    victim = head.route.decode_worker
    assert victim.startswith("decode-") and head.token_ids
    cluster.kill_worker(victim)
    rest = list(stream)

    tokens = [t for r in [head, *rest] for t in r.token_ids]
    assert tokens == greedy(tiny_llama_dir, prompt, max_tokens)
    final = rest[-1]
    assert final.route.decode_worker not in ("", victim)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), max_tokens)
    assert retries(cluster) == before + 1  # it was killed mid-stream, not after
    assert victim in live_idle(cluster)


@pytest.fixture
def lone_decode(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    """A cluster of its own (1 prefill + 1 decode worker), so the module's shared one keeps its
    decode workers, whatever order the tests run in."""
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=LEASE_S),
        num_prefill=1, num_decode=1, namespace="lone-decode",
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8), worker_down_s=600.0),
        worker_num_cpus=0.5, replace_dead_workers=False)
    with LocalCluster(config) as c:
        yield c


def test_no_decode_worker_left_ends_with_unavailable(lone_decode: LocalCluster) -> None:
    cluster = lone_decode
    [last] = [r for r in cluster.check_idle() if r["worker_id"].startswith("decode-") and not r.get("dead")]
    cluster.kill_worker(last["worker_id"])
    with grpc.insecure_channel(cluster.address) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationStub(channel).Generate(request([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 4), timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode worker" in e.value.details()
    trailing = dict(e.value.trailing_metadata() or ())
    assert "retry-after-ms" in trailing
    live_idle(cluster)  # the prefill workers hold nothing
