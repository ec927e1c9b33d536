"""`/metrics` bound beyond loopback asks for the cluster's scrape token (a bearer token derived
from the cluster secret); bound to loopback it stays open. `splitserve metrics-targets
--credentials-file` writes that token (mode 600) for Prometheus' `credentials_file`."""
from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from cluster.redis_server import EmbeddedRedis
from control.auth import metrics_token
from control.metrics_http import MetricsServer

SECRET = b"metrics-auth-test-secret"


def get(port: int, authorization: str | None) -> tuple[int, str, str]:
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                    timeout=10) as r:
            return r.status, r.read().decode(), ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("WWW-Authenticate", "")


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_a_scrape_beyond_loopback_needs_the_token(host: str) -> None:
    registry = CollectorRegistry()
    Counter("splitserve_test_scrapes", "a counter to find", registry=registry).inc(3)
    token = metrics_token(SECRET)
    asks: dict[str | None, tuple[int, str, str]] = {}

    async def run() -> None:
        server = MetricsServer(registry, token=token)
        port = await server.start(host)
        try:
            for shown in (None, "Bearer wrong", f"Basic {token}", f"Bearer {token}", f"bearer  {token}"):
                asks[shown] = await asyncio.to_thread(get, port, shown)
        finally:
            await server.stop()
    asyncio.run(run())
    for shown, (status, body, challenge) in asks.items():
        if host == "127.0.0.1" or shown in (f"Bearer {token}", f"bearer  {token}"):
            assert status == 200, shown
            [family] = [f for f in text_string_to_metric_families(body) if f.name == "splitserve_test_scrapes"]
            assert family.samples[0].value == 3
        else:
            assert (status, challenge) == (401, "Bearer"), shown
            assert "scrape token" in body and "splitserve_test_scrapes" not in body


def test_metrics_targets_writes_the_token_for_prometheus(tmp_path: Path) -> None:
    redis = EmbeddedRedis()
    try:
        out = tmp_path / "scrape.token"
        env = {**os.environ, "SPLITSERVE_CLUSTER_SECRET": SECRET.decode()}
        r = subprocess.run([sys.executable, "-m", "cluster.cli", "metrics-targets", "--redis-url", redis.url,
                            "--credentials-file", str(out)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "no workers or routers are reporting" in r.stderr  # an empty cluster
        assert out.read_text() == metrics_token(SECRET) + "\n"
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
    finally:
        redis.stop()
