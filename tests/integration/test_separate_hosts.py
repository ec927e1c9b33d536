"""Prefill and decode workers on separate test hosts: each in a network namespace of its own
(a veth pair to this machine, which routes between them), with its own hostname and a
private /dev/shm, so a wrong choice of `shm` fails instead of silently working. The workers
bind 0.0.0.0 and advertise their namespace's address; KV crosses over `tcp`; the router (on
this machine) reaches both by their advertised addresses; greedy output equals the
monolithic engine. Cutting the decode host's link mid-transfer (`ip link set down`) frees
its reservation within the lease and the router retries the request on another decode
worker. Needs root and iproute2 (skipped otherwise); removes what it made."""
from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncio

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.local import free_port
from control.reader import RegistryReader
from engine.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import start_serving
from tests.integration.reference import make_engine

pytestmark = pytest.mark.timeout(300)

SUBNET = "10.77"
TAGS = itertools.count()


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Two namespaces, `p` at 10.77.1.2 and `d` at 10.77.2.2; this machine is .1 on each link."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("separate test hosts need root, iproute2 and unshare")
    tag = f"ss{os.getpid() % 100000}{next(TAGS)}"
    made: list[str] = []
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    old_forward = forward.read_text()
    try:
        for i, name in enumerate(("p", "d"), start=1):
            ns, outside, inside = f"{tag}{name}", f"{tag}{name}o", f"{tag}{name}i"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "addr", "add", f"{SUBNET}.{i}.1/24", "dev", outside)
            sh("ip", "link", "set", outside, "up")
            for cmd in (["ip", "addr", "add", f"{SUBNET}.{i}.2/24", "dev", inside], ["ip", "link", "set", inside, "up"],
                        ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", f"{SUBNET}.{i}.1"]):
                sh("ip", "netns", "exec", ns, *cmd)
        forward.write_text("1\n")  # this machine routes between the two links
        yield {"p": made[0], "d": made[1], "p_link": f"{tag}po", "d_link": f"{tag}do"}
    finally:
        forward.write_text(old_forward)
        for ns in made:  # the veth first: a namespace something still references would keep it, and its address
            subprocess.run(["ip", "link", "del", f"{ns}o"], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def on_host(ns: str, argv: list[str]) -> list[str]:
    """`argv` run as a separate host: network namespace `ns`, hostname `ns`, a private /dev/shm."""
    inner = " ".join(["exec", sys.executable, "-m", "cluster.cli", *argv])
    return ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c",
            f"hostname {ns} && mount -t tmpfs -o size=512m tmpfs /dev/shm && {inner}"]


class Hosts:
    """A Redis on this machine that both test hosts reach, and the processes a test starts
    (stopped at the end, Redis last)."""

    def __init__(self, hosts: dict[str, str], model_dir: str, tmp_path: Path) -> None:
        self.hosts, self.tmp_path, self.port = hosts, tmp_path, free_port()
        self.common = ["--namespace", "hosts", "--model", model_dir, "--kv-cache-mib", "8"]
        self.procs: list[subprocess.Popen] = [subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             f"127.0.0.1 {SUBNET}.1.1 {SUBNET}.2.1", "--protected-mode", "no", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def redis_url(self, via: str) -> str:
        return f"redis://{via}:{self.port}/0"

    def start(self, name: str, argv: list[str]) -> str:
        """Starts `cluster.cli argv` (on a test host when `name` is one) and returns its address."""
        cmd = on_host(self.hosts[name], argv) if name in self.hosts else [sys.executable, "-m", "cluster.cli", *argv]
        proc, address = start_serving(cmd, "hosts-test-secret", self.tmp_path / f"{argv[0]}-{len(self.procs)}.log")
        self.procs.append(proc)
        return address

    def worker(self, name: str, role: str, worker_id: str, redis_via: str) -> str:
        """A worker binding 0.0.0.0 and advertising its address on the route to `redis_via`."""
        return self.start(name, ["worker", role, "--worker-id", worker_id, "--redis-url", self.redis_url(redis_via),
                                 "--host", "0.0.0.0", *self.common])

    def metrics_address(self, worker_id: str) -> str:
        async def read() -> str:
            reader = RegistryReader(self.redis_url("127.0.0.1"), "hosts")
            try:
                return (await reader.heartbeats())[worker_id].metrics_address
            finally:
                await reader.close()
        return asyncio.run(read())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def cluster_hosts(hosts: dict[str, str], tiny_llama_dir: str, tmp_path: Path) -> Iterator[Hosts]:
    made = Hosts(hosts, tiny_llama_dir, tmp_path)
    try:
        yield made
    finally:
        made.stop()


def generate(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), timeout=120))


def test_kv_crosses_between_separate_hosts_over_tcp(cluster_hosts: Hosts, tiny_llama_dir: str) -> None:
    d_addr = cluster_hosts.worker("d", "decode", "decode-far", f"{SUBNET}.2.1")
    p_addr = cluster_hosts.worker("p", "prefill", "prefill-far", f"{SUBNET}.1.1")
    assert d_addr.startswith(f"{SUBNET}.2.2:") and p_addr.startswith(f"{SUBNET}.1.2:")  # advertised, not 0.0.0.0
    address = cluster_hosts.start("router", ["router", "--redis-url", cluster_hosts.redis_url("127.0.0.1"),
                                             "--namespace", "hosts", "--port", "0", "--mode", "disaggregated"])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 150)]
    want = make_engine(tiny_llama_dir, block_size=16).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt, expected in zip(prompts, want, strict=True):
            got = generate(stub, prompt, 8)
            assert [t for r in got for t in r.token_ids] == expected.token_ids
            assert (got[-1].route.prefill_worker, got[-1].route.decode_worker) == ("prefill-far", "decode-far")
    # (with a private /dev/shm and another hostname, `shm` could not have carried it: the KV went over tcp)


def scrape(address: str, ns: str | None = None) -> dict[str, float]:
    """`address`'s /metrics (from inside namespace `ns` when given): sample name with its
    labels -> value."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://{address}/metrics', timeout=3).read().decode())"
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", code] if ns else [sys.executable, "-c", code]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=15).stdout
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k in ("role", "state")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.2)
    return time.monotonic() - start


LEASE_S = 10.0
"""kvfabric's default reservation lease (`ReceiverConfig.lease_s`)."""


def test_a_link_cut_mid_transfer_frees_the_reservation_and_the_router_retries(
        cluster_hosts: Hosts, hosts: dict[str, str], tiny_llama_dir: str) -> None:
    cluster_hosts.worker("d", "decode", "decode-far", f"{SUBNET}.2.1")
    cluster_hosts.worker("p", "prefill", "prefill-far", f"{SUBNET}.1.1")
    metrics_port = free_port()
    address = cluster_hosts.start("router", [
        "router", "--redis-url", cluster_hosts.redis_url("127.0.0.1"), "--namespace", "hosts", "--port", "0",
        "--mode", "disaggregated", "--metrics-port", str(metrics_port)])
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(256)]
    prompt = prefix + [rng.randrange(3, 500) for _ in range(1200)]  # 75 new blocks on top of the cached 16
    want = make_engine(tiny_llama_dir, block_size=16).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    far = cluster_hosts.metrics_address("decode-far")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert generate(stub, prefix, 2)[-1].route.decode_worker == "decode-far"  # it caches the prefix
        cluster_hosts.worker("near", "decode", "decode-near", f"{SUBNET}.1.1")  # on this machine, at .1.1
        router = f"127.0.0.1:{metrics_port}"
        wait_for("the router sees both decode workers",
                 lambda: scrape(router).get("splitserve:pool_workers,role=decode,state=serving") == 2, 30)
        # the decode host's link slowed to 400 kbit/s, so the transfer lasts ~10 s
        sh("tc", "qdisc", "add", "dev", hosts["d_link"], "root", "tbf", "rate", "400kbit", "burst", "16kbit",
           "latency", "500ms")
        result: dict[str, object] = {}

        def call() -> None:
            try:
                result["out"] = generate(stub, prompt, 6)
            except grpc.RpcError as e:
                result["error"] = f"{e.code()}: {e.details()}"
        client = threading.Thread(target=call, daemon=True)
        client.start()
        wait_for("a reservation on decode-far",
                 lambda: scrape(far).get("splitserve:kv_reservations,role=decode") == 1, 30)
        sh("ip", "link", "set", hosts["d_link"], "down")  # mid-transfer: no FIN, no RST, just silence
        freed_s = wait_for("decode-far freeing the reservation", lambda: scrape(far, hosts["d"]).get(
            "splitserve:kv_reservations,role=decode") == 0, LEASE_S + 10)
        assert freed_s <= LEASE_S + 3  # the lease, plus a scrape's latency
        client.join(timeout=120)
        assert "out" in result, result
        got = result["out"]
    assert [t for r in got for t in r.token_ids] == want[0].token_ids  # type: ignore[attr-defined]
    assert got[-1].route.decode_worker == "decode-near"  # type: ignore[index]
    assert scrape(router)["splitserve:retries_total"] >= 1
    sh("ip", "link", "set", hosts["d_link"], "up")
    wait_for("decode-far idle again", lambda: all(scrape(far).get(f"splitserve:{k},role=decode") == 0 for k in (
        "kv_reservations", "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")), 30)
