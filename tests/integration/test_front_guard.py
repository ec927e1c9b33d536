"""The router's doors with API keys, on a real cluster (the tiny model, one decode worker
prefilling locally): the `openai` client and a gRPC stub without a key, with a wrong one and
with a right one; health checks open; reflection closed; a key's tenant replacing the one
the body names (its quota applies); a POST that is not JSON and a foreign Host refused."""
from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router import api_keys
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

OPEN_KEY, ACME_KEY = "sk-open-0123456789", "sk-acme-0123456789"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# the cluster's keys\n{ACME_KEY}:acme\n")
    key_file.chmod(0o600)
    keys = api_keys.load([OPEN_KEY], str(key_file), environ={})
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=0, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, api_keys=keys, routing=RoutingConfig(mode="colocated"),
                            admission=AdmissionConfig(tenant_quota_tokens={"acme": 1})))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def base(cluster: LocalCluster) -> Iterator[str]:
    yield f"http://{cluster.info['http_address']}"
    assert_idle(cluster)


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def _raw(base: str, method: str, path: str, body: bytes = b"", headers: dict | None = None
         ) -> tuple[int, dict, dict | None]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.headers), json.loads(data) if data else None


def test_http_without_or_with_a_wrong_key_is_401_in_openai_shape_and_health_stays_open(base: str) -> None:
    for key in ("sk-wrong-0123456789", "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(base, key).completions.create(model="m", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        assert e.value.body["code"] == "invalid_api_key"
    status, headers, body = _raw(base, "GET", "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["message"] == api_keys.MISSING
    status, _, body = _raw(base, "GET", "/v1/models", headers={"Authorization": "Bearer sk-wrong-0123456789"})
    assert status == 401 and body["error"]["message"] == api_keys.WRONG
    assert _raw(base, "GET", "/health")[0] == 200
    models = _client(base, OPEN_KEY).models.list()
    assert len(models.data) == 1
    out = _client(base, OPEN_KEY).completions.create(model=models.data[0].id, prompt=[5, 6, 7], max_tokens=4,
                                                     temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_a_key_that_names_a_tenant_replaces_the_bodys(base: str) -> None:
    """acme's quota (1 token) refuses whatever tenant the body names; the open key's requests
    are the body's tenant's."""
    for user in (None, "free", "acme"):
        with pytest.raises(openai.RateLimitError) as e:
            _client(base, ACME_KEY).completions.create(model=None, prompt=[5, 6], max_tokens=2,  # type: ignore[arg-type]
                                                       **({"user": user} if user else {}))
        assert "tenant 'acme''s quota of 1" in e.value.body["message"]
    out = _client(base, OPEN_KEY).completions.create(model=None, prompt=[5, 6], max_tokens=2, user="free")  # type: ignore[arg-type]
    assert out.usage.completion_tokens >= 1


def test_a_post_that_is_not_json_and_a_foreign_host_are_refused(base: str) -> None:
    auth = {"Authorization": f"Bearer {OPEN_KEY}"}
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status, _, answer = _raw(base, "POST", "/v1/completions", body, {**auth, "Content-Type": "text/plain"})
    assert status == 415 and "'Content-Type: application/json', not 'text/plain'" in answer["error"]["message"]
    status, _, answer = _raw(base, "POST", "/v1/completions", body, auth)  # no Content-Type at all
    assert status == 415
    status, _, answer = _raw(base, "GET", "/health", headers={"Host": "attacker.example:8000"})
    assert status == 421 and answer["error"]["code"] == "misdirected_request"
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        assert _raw(base, "GET", "/health", headers={"Host": host})[0] == 200, host


def test_grpc_needs_a_key_but_for_health_checks(cluster: LocalCluster) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), tenant="free",
                                 sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer sk-wrong-0123456789"),), (("authorization", OPEN_KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=30, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        responses = list(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {OPEN_KEY}"),)))
        assert sum(len(r.token_ids) for r in responses) == 3
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {ACME_KEY}"),)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'acme'" in e.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_idle(cluster)


def test_keys_come_from_flags_a_private_file_and_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-file-0123456789:team-a\n\n# a comment\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others \\(mode 644\\); chmod 600 it"):
        api_keys.load([], str(f), environ={})
    os.chmod(f, 0o600)
    keys = api_keys.load(["sk-flag-0123456789"], str(f), environ={api_keys.ENV: "sk-env-01234567:team-b, "})
    assert keys is not None and repr(keys) == "ApiKeys(3 keys)"
    assert [keys.check(f"Bearer {k}").tenant for k in ("sk-flag-0123456789", "sk-file-0123456789",
                                                        "sk-env-01234567")] == [None, "team-a", "team-b"]
    assert api_keys.load([], None, environ={}) is None


def test_heartbeats_that_lie_are_skipped_counted_and_change_no_request(cluster: LocalCluster) -> None:
    """A serving heartbeat with a block size of 0, one with a negative pool, one with a huge
    vocabulary, and one whose address is a public one, written into the cluster's Redis
    (sealed as a worker's own, so the router reads past the seal to the fields): the
    router skips each (the first as incomplete facts, the next two as malformed, the last for
    its address), counts them, and requests go on as before."""
    import msgpack
    import redis

    from control.auth import registry_key, seal, unseal
    from control.heartbeat import Heartbeat, hb_key

    key = registry_key(cluster.config.worker.cluster_secret)  # sealed as a worker's: the lies are in the fields
    real_key = hb_key(cluster.config.namespace, "decode-0")
    real = Heartbeat.from_wire(unseal(key, real_key, redis.Redis.from_url(cluster.redis_url).get(real_key)))
    good = msgpack.unpackb(real.to_wire())
    lies = {"zero": {**good, "facts": {**good["facts"], "block_size": 0}},
            "negative": {**good, "facts": {**good["facts"], "num_total_blocks": -5}},
            "huge": {**good, "facts": {**good["facts"], "vocab_size": 1 << 40}},
            "foreign": {**good, "address": "8.8.8.8:50051"}}
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        for name, fields in lies.items():
            lie_key = hb_key(cluster.config.namespace, f"decode-{name}")
            client.set(lie_key, seal(key, lie_key, msgpack.packb({**fields, "worker_id": f"decode-{name}",
                                                                  "incarnation": name})), px=60_000)
        deadline = time.monotonic() + 10
        while True:
            [stats] = cluster.router_stats()
            if stats["bad_registry_entries"] >= 2 and stats["refused_addresses"] == 1:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["serving"]["decode"] == ["decode-0"]  # the zero-size one is in no pool
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
        with grpc.insecure_channel(cluster.address) as channel:
            for _ in range(3):
                responses = list(pb_grpc.GenerationStub(channel).Generate(
                    request, timeout=60, metadata=(("authorization", f"Bearer {OPEN_KEY}"),)))
                assert sum(len(r.token_ids) for r in responses) == 3 and responses[-1].route.decode_worker == "decode-0"
    finally:
        client.delete(*(hb_key(cluster.config.namespace, f"decode-{name}") for name in lies))
        client.close()
    assert_idle(cluster)
