"""Prefill and decode workers on separate test hosts: each in a network namespace of its own
(a veth pair to this machine, which routes between them), with its own hostname and a
private /dev/shm, so a wrong choice of `shm` fails instead of silently working. The workers
bind 0.0.0.0 and advertise their namespace's address; KV crosses over `tcp`; the router (on
this machine) reaches both by their advertised addresses; greedy output equals the
monolithic engine. Needs root and iproute2 (skipped otherwise); removes what it made."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.local import free_port
from engine.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import start_serving
from tests.integration.reference import make_engine

pytestmark = pytest.mark.timeout(300)

SUBNET = "10.77"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Two namespaces, `p` at 10.77.1.2 and `d` at 10.77.2.2; this machine is .1 on each link."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("separate test hosts need root, iproute2 and unshare")
    tag = f"ss{os.getpid() % 100000}"
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
        yield {"p": made[0], "d": made[1]}
    finally:
        forward.write_text(old_forward)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)  # its veth goes with it


def on_host(ns: str, argv: list[str]) -> list[str]:
    """`argv` run as a separate host: network namespace `ns`, hostname `ns`, a private /dev/shm."""
    inner = " ".join(["exec", sys.executable, "-m", "cluster.cli", *argv])
    return ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c",
            f"hostname {ns} && mount -t tmpfs -o size=512m tmpfs /dev/shm && {inner}"]


def test_kv_crosses_between_separate_hosts_over_tcp(hosts: dict[str, str], tiny_llama_dir: str,
                                                    tmp_path: Path) -> None:
    port = free_port()
    redis = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                              f"127.0.0.1 {SUBNET}.1.1 {SUBNET}.2.1", "--protected-mode", "no", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs: list[subprocess.Popen] = []
    try:
        common = ["--namespace", "hosts", "--model", tiny_llama_dir, "--kv-cache-mib", "8", "--host", "0.0.0.0"]
        decode, d_addr = start_serving(on_host(hosts["d"], ["worker", "decode", "--worker-id", "decode-far",
                                                    "--redis-url", f"redis://{SUBNET}.2.1:{port}/0", *common]),
                               "hosts-test-secret", tmp_path / "decode.log")
        procs.append(decode)
        prefill, p_addr = start_serving(on_host(hosts["p"], ["worker", "prefill", "--worker-id", "prefill-far",
                                                     "--redis-url", f"redis://{SUBNET}.1.1:{port}/0", *common]),
                                "hosts-test-secret", tmp_path / "prefill.log")
        procs.append(prefill)
        assert d_addr.startswith(f"{SUBNET}.2.2:") and p_addr.startswith(f"{SUBNET}.1.2:")  # advertised, not 0.0.0.0
        router, address = start_serving([sys.executable, "-m", "cluster.cli", "router", "--redis-url",
                                 f"redis://127.0.0.1:{port}/0", "--namespace", "hosts", "--port", "0",
                                 "--mode", "disaggregated"], "hosts-test-secret", tmp_path / "router.log")
        procs.append(router)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 150)]
        want = make_engine(tiny_llama_dir, block_size=16).generate(
            prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for prompt, expected in zip(prompts, want, strict=True):
                got = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=8, ignore_eos=True)), timeout=60))
                assert [t for r in got for t in r.token_ids] == expected.token_ids
                assert (got[-1].route.prefill_worker, got[-1].route.decode_worker) == ("prefill-far", "decode-far")
        # (with a private /dev/shm and another hostname, `shm` could not have carried it: the KV went over tcp)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.terminate()
        redis.wait(timeout=10)
