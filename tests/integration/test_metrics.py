"""Prometheus `/metrics` of every process of a real cluster (Ray actors, redis-server, gRPC).

The endpoints are found the way an operator finds them, with `splitserve metrics-targets`,
scraped over HTTP and parsed with prometheus_client's own parser. After N requests the
router's counts equal what the clients sent and were told (TTFT observations, prompt,
generated and cached tokens, finish reasons), and the workers account for the same work
(prefix-cache queries, KV pushed over shm).
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import assert_idle, one_and_one

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str) -> Iterator[LocalCluster]:
    with LocalCluster(one_and_one(tiny_llama_dir)) as c:
        yield c


def targets(cluster: LocalCluster) -> list[dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "metrics-targets", "--redis-url", cluster.redis_url],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_every_process_is_a_target(cluster: LocalCluster) -> None:
    groups = targets(cluster)
    assert sorted((g["labels"]["role"], g["labels"]["instance_id"]) for g in groups) == [  # type: ignore[index]
        ("controller", "controller"), ("decode", "decode-0"), ("prefill", "prefill-0"), ("router", "router-0")]
    workers = {w["worker_id"]: w["metrics_address"] for w in cluster.workers()}
    assert {g["labels"]["instance_id"]: g["targets"] for g in groups  # type: ignore[index]
            if g["labels"]["role"] in ("prefill", "decode")} == {w: [a] for w, a in workers.items()}  # type: ignore[index]


def test_the_controller_reports_its_pools_targets(cluster: LocalCluster) -> None:
    address = next(g["targets"][0] for g in targets(cluster) if g["labels"]["role"] == "controller")  # type: ignore[index]
    samples = scrape(address)
    assert total(samples, "splitserve:pool_target_workers", role="prefill") == 1
    assert total(samples, "splitserve:pool_target_workers", role="decode") == 1
    assert total(samples, "splitserve:controller_workers", role="decode", state="serving") == 1
    assert total(samples, "splitserve:workers_dead_total") == 0


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_scraped_counts_equal_what_was_sent(cluster: LocalCluster) -> None:
    by_role = {g["labels"]["role"]: g["targets"][0] for g in targets(cluster)}  # type: ignore[index]
    before = {role: scrape(address) for role, address in by_role.items()}  # type: ignore[arg-type]

    prefix = list(range(5, 69))  # 4 blocks: the second request onwards finds them cached
    sent = [prefix + [100 + i] * (9 + i) for i in range(5)] + [[7, 8, 9]]  # the last: local prefill
    finals = []
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for i, prompt in enumerate(sent):
            responses = list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=4 + i, ignore_eos=True)),
                timeout=60))
            finals.append(responses[-1])
    assert_idle(cluster)
    after = {role: scrape(address) for role, address in by_role.items()}  # type: ignore[arg-type]

    def delta(role: str, name: str, **labels: str) -> float:
        return total(after[role], name, **labels) - total(before[role], name, **labels)

    n = len(sent)
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in finals)
    assert cached >= 4 * 64  # the shared prefix was a hit for requests 2-5
    assert delta("router", "splitserve:time_to_first_token_seconds_count") == n
    assert delta("router", "splitserve:e2e_request_latency_seconds_count") == n
    assert delta("router", "splitserve:request_queue_time_seconds_count") == n
    assert delta("router", "splitserve:inter_token_latency_seconds_count") == completion - n
    assert delta("router", "splitserve:prompt_tokens_total") == sum(map(len, sent))
    assert delta("router", "splitserve:generation_tokens_total") == completion == sum(range(4, 4 + n))
    assert delta("router", "splitserve:prompt_tokens_cached_total") == cached
    assert delta("router", "splitserve:request_success_total", finished_reason="length") == n
    assert delta("router", "splitserve:routing_decisions_total", kind="remote_prefill") == n - 1
    assert delta("router", "splitserve:routing_decisions_total", kind="local_prefill") == 1
    assert total(after["router"], "splitserve:pool_workers", role="decode", state="serving") == 1
    assert total(after["router"], "splitserve:router_requests_admitted") == 0
    assert total(after["router"], "splitserve:admission_forecast_wait_seconds") == 0  # nothing queued
    for name in ("splitserve:admission_inflight_tokens", "splitserve:admission_used_tokens"):  # charged, used
        assert any(n == name for n, _ in after["router"]) and total(after["router"], name) == 0

    assert delta("prefill", "splitserve:kv_transfer_seconds_count", transport="shm") == n - 1
    blocks = delta("prefill", "splitserve:kv_transfer_blocks_total", transport="shm")
    assert 0 < blocks <= sum(len(p) // 16 + 1 for p in sent[:-1])
    assert delta("prefill", "splitserve:kv_transfer_bytes_total", transport="shm") % blocks == 0
    assert delta("prefill", "splitserve:prefix_cache_queries_total") == sum(map(len, sent[:-1]))
    for role in ("prefill", "decode"):
        assert total(after[role], "splitserve:num_requests_running") == 0
        assert 0 <= total(after[role], "splitserve:kv_cache_usage_perc") < 1


def test_the_endpoint_answers_only_get_metrics(cluster: LocalCluster) -> None:
    address = targets(cluster)[0]["targets"][0]  # type: ignore[index]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{address}/other", timeout=10)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics", data=b"x", method="POST"),
                               timeout=10)
    assert e.value.code == 404
