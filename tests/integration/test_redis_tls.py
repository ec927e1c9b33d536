"""A cluster whose Redis speaks only TLS (`rediss://`) and requires a password: workers, a
router and `splitserve status`, each a plain process, reach it with the URL's credentials
and CA file (`?ssl_ca_certs=`), and a request's greedy tokens are exact; a plain-text client
and a TLS client without the password are refused."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from benchmarks.serving.separate_hosts import start_serving
from cluster.redis_server import free_port
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import generate, greedy, tokens

pytestmark = pytest.mark.timeout(300)

PASSWORD = "tls-test-password"
CLI = [sys.executable, "-m", "cluster.cli"]


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 / localhost it signed."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=splitserve-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.pem", "-days", "1", "-extfile", "san.ext")
    return d / "ca.pem", d / "server.pem", d / "server.key"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """redis-server on a TLS-only port with a password: (port, CA file)."""
    if not shutil.which("openssl"):
        pytest.skip("needs openssl to make the test certificates")
    ca, cert, key = make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--tls-port", str(port),
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                             "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis.from_url(url(port, ca), socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        client.close()
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def url(port: int, ca: Path, password: str | None = PASSWORD) -> str:
    auth = f":{password}@" if password else ""
    return f"rediss://{auth}127.0.0.1:{port}/0?ssl_ca_certs={ca}"


def test_a_cluster_runs_on_a_tls_redis_with_a_password(tls_redis: tuple[int, Path], tiny_llama_dir: str,
                                                      tmp_path: Path) -> None:
    port, ca = tls_redis
    common = ["--redis-url", url(port, ca), "--namespace", "tls"]
    procs: list[subprocess.Popen] = []
    try:
        for role in ("decode", "prefill"):
            proc, _ = start_serving([*CLI, "worker", role, "--worker-id", f"{role}-tls", "--model", tiny_llama_dir,
                                     "--kv-cache-mib", "8", *common], "tls-secret", tmp_path / f"{role}.log")
            procs.append(proc)
        router, address = start_serving([*CLI, "router", "--port", "0", "--http-port", "0", "--mode", "disaggregated",
                                         *common],
                                        "tls-secret", tmp_path / "router.log")
        procs.append(router)
        prompt = list(range(7, 60))
        with grpc.insecure_channel(address) as channel:
            got = generate(pb_grpc.GenerationStub(channel), prompt, 6)
        assert tokens(got) == greedy(tiny_llama_dir, prompt, 6)
        assert (got[-1].route.prefill_worker, got[-1].route.decode_worker) == ("prefill-tls", "decode-tls")
        status = subprocess.run([*CLI, "status", *common], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "prefill-tls" in status.stdout and "decode-tls" in status.stdout
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def test_a_tls_redis_refuses_plain_text_and_a_missing_password(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    plain = redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    anonymous = redis.Redis.from_url(url(port, ca, password=None), socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    status = subprocess.run([*CLI, "status", "--redis-url", url(port, ca, "wrong"), "--namespace", "tls"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and "is away" in status.stderr and "wrong" not in status.stderr  # redacted
