"""A cluster without Ray: `splitserve kv-store`, `splitserve worker prefill|decode` and
`splitserve router` as plain processes around a real redis-server. The router finds the
workers through their heartbeats, the workers their host's KV store through its entry;
greedy output equals the monolithic engine; SIGTERM stops each process cleanly."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import grpc
import pytest

from benchmarks.serving.separate_hosts import start_serving
from cluster.redis_server import EmbeddedRedis
from control.auth import cluster_token
from control.tls import member_channel_sync, member_tls
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.reference import make_engine

CLI = [sys.executable, "-m", "cluster.cli"]
pytestmark = pytest.mark.timeout(300)


def start(args: list[str], redis_url: str) -> tuple[subprocess.Popen, str]:
    """The Redis URL (with its password) from the environment, not argv."""
    return start_serving(CLI + args, "plain-test-secret", env={"SPLITSERVE_REDIS_URL": redis_url})


def test_plain_process_workers_serve_through_a_plain_process_router(tiny_llama_dir: str) -> None:
    redis = EmbeddedRedis()
    procs: list[subprocess.Popen] = []
    try:
        assert urlsplit(redis.url).password  # the embedded Redis has one: it stays out of argv
        store, store_address = start(["kv-store", "--namespace", "plain", "--model", tiny_llama_dir,
                                      "--kv-store-mib", "8"], redis.url)
        procs.append(store)
        common = ["--namespace", "plain", "--model", tiny_llama_dir, "--kv-cache-mib", "8", "--kv-store", "local"]
        addresses = {}
        for role, wid in (("decode", "decode-a"), ("prefill", "prefill-a")):
            proc, addresses[role] = start(["worker", role, "--worker-id", wid, *common], redis.url)
            procs.append(proc)
        decode_address = addresses["decode"]
        router, address = start(["router", "--namespace", "plain", "--port", "0", "--http-port", "0",
                                 "--mode", "disaggregated", "--tokenizer", tiny_llama_dir], redis.url)
        procs.append(router)
        prompt = [random.Random(5).randrange(3, 500) for _ in range(40)]
        want = make_engine(tiny_llama_dir, block_size=16).generate(
            [prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                         sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True))
            got = list(stub.Generate(request, timeout=60))
        assert [t for r in got for t in r.token_ids] == want
        assert (got[-1].route.prefill_worker, got[-1].route.decode_worker) == ("prefill-a", "decode-a")
        member = member_tls(b"plain-test-secret")  # as a member of this cluster
        with member_channel_sync(store_address, member) as channel:  # the prompt's 2 full blocks reached the store
            stats = pb_grpc.KVStoreStub(channel)
            token = [("x-splitserve-token", cluster_token(b"plain-test-secret"))]
            deadline = time.monotonic() + 30
            while stats.Stats(pb.StatsRequest(), metadata=token, timeout=10).num_stored < 2:
                assert time.monotonic() < deadline, "the workers offered the store nothing"
                time.sleep(0.2)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        intruder = pb.DecodeRequest(request_id="intruder", prompt_token_ids=prompt)
        # without a certificate of the cluster's CA (plain, or another secret's): no connection at all
        for channel in (grpc.insecure_channel(decode_address),
                        member_channel_sync(decode_address, member_tls(b"another-secret"))):
            with channel, pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with member_channel_sync(decode_address, member) as channel:  # TLS, but calls still need the token
            for metadata in (None, (("x-splitserve-token", "guess"),)):
                with pytest.raises(grpc.RpcError) as e:
                    list(pb_grpc.DecodeWorkerStub(channel).Decode(intruder, metadata=metadata, timeout=10))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "only its cluster's routers may call it" in e.value.details()
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health checks need no token
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in reversed(procs)]
        redis.stop()
    assert codes == [0, 0, 0, 0]


def test_members_with_the_deployments_own_certificates(tiny_llama_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--tls-ca/--tls-cert/--tls-key: each member shows its own leaf of the deployment's CA
    (naming splitserve-cluster), and they serve each other as with the made ones; a member
    whose certificate the cluster secret made is now a stranger."""
    from control.tls import given_tls
    from tests.pki import make_ca

    ca = make_ca()
    ca_file = str(ca.write(tmp_path / "ca.pem"))

    def pki(name: str) -> list[str]:
        cert, key = ca.issue(tmp_path, name)
        return ["--tls-ca", ca_file, "--tls-cert", str(cert), "--tls-key", str(key)]

    redis = EmbeddedRedis()
    procs: list[subprocess.Popen] = []
    try:
        common = ["--namespace", "given", "--model", tiny_llama_dir, "--kv-cache-mib", "8"]
        addresses = {}
        for role in ("decode", "prefill"):
            proc, addresses[role] = start(["worker", role, "--worker-id", f"{role}-g", *common, *pki(role)], redis.url)
            procs.append(proc)
        router, address = start(["router", "--namespace", "given", "--port", "0", "--http-port", "0",
                                 "--mode", "disaggregated", *pki("router")], redis.url)  # free ports only
        procs.append(router)
        prompt = [random.Random(6).randrange(3, 500) for _ in range(40)]
        want = make_engine(tiny_llama_dir, block_size=16).generate(
            [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        with grpc.insecure_channel(address) as channel:  # the router's own door: no member certificate needed
            got = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                timeout=60))
        assert [t for r in got for t in r.token_ids] == want
        assert (got[-1].route.prefill_worker, got[-1].route.decode_worker) == ("prefill-g", "decode-g")
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        check = health_pb2.HealthCheckRequest()
        with member_channel_sync(addresses["decode"], member_tls(b"plain-test-secret")) as channel, \
                pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(channel).Check(check, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        leaf = given_tls(ca_file, *pki("operator")[3::2])
        with member_channel_sync(addresses["decode"], leaf) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(check, timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in reversed(procs)]
        redis.stop()
    assert codes == [0, 0, 0]
