"""`ray up deploy/onprem.yaml` for real: Ray's own cluster launcher, over SSH, onto three test
hosts (network namespaces with their own addresses, hostnames, process IDs, /tmp, /dev/shm
and home, each running an sshd; benchmarks/serving/ssh_hosts.py). The hosts reach no package index,
so they come with splitserve's dependencies preinstalled (`SshHosts.preinstall`); the file's
own setup commands install splitserve from the checkout it mounts. The copy of the file the
test writes differs from deploy/onprem.yaml only in the hosts' addresses, the SSH user and
key, and CPU for GPU (`onprem_file`). Needs root, iproute2, openssh-server and rsync (skipped
otherwise); removes what it made."""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.serving.separate_hosts import scrape
from benchmarks.serving.ssh_hosts import (SshHosts, checkout, onprem_file, ray_cli, ray_down_quietly, ssh_hosts,
                                           unavailable)
from control.reader import RegistryReader
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import generate, greedy, tokens, wait_for

pytestmark = pytest.mark.timeout(900)
TEST_BUDGET_S = 540.0
"""What the test's own steps may take together (a run takes about 125 s here); its fixture's
`ray down` of whatever is left (`ray_down_quietly`, at most 240 s) fits beside it in the
module's timeout, so a slow step fails with its own message, never the timeout's."""

RAY_START_TIMEOUTS = ("The current node timed out during startup", "Failed to get node info for possible node ids")
"""What `ray start` says when the node's raylet did not register with the GCS within Ray's
fixed 30 s (ray/_private/node.py) or the GCS did not answer in time: on a machine loaded by
other work (a second cluster and the suite beside it) the head's once failed so. `ray up`
is run once more (it stops and starts Ray on every host again); any other failure fails."""

NAMES = ("h", "p", "d")
"""The head, the prefill host and the decode host (10.77.1.2, .2.2, .3.2)."""


@pytest.fixture
def launched(tmp_path: Path, smollm2_dir: str) -> Iterator[tuple[SshHosts, Path, Path]]:
    """The hosts, the cluster file, and the copy of this checkout `ray` runs from. Each host
    has served the default model before: its GGUF conversion is in the host's cache (a first
    use converts it on every host that loads it, ~13 CPU-s each; test_cli's README test
    checks a first use)."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    name = f"splitserve-test-{os.getpid()}"
    config = tmp_path / "onprem.yaml"
    source = checkout(tmp_path / "checkout")
    with ssh_hosts(NAMES, tmp_path / "hosts") as hosts:
        for host in NAMES:
            hosts.preinstall(host)
            hosts.seed_conversion(host, Path(smollm2_dir))
        config.write_text(onprem_file(hosts, name))
        try:
            yield hosts, config, source
        finally:
            ray_down_quietly(config, name, source)


def serve_state(hosts: SshHosts) -> dict[str, str]:
    """The head's `splitserve serve` state (its Redis URL and namespace), from its home."""
    return json.loads((hosts.dir("h", "home") / ".cache" / "splitserve" / "serve.json").read_text())


def heartbeats(hosts: SshHosts) -> dict:
    state = serve_state(hosts)

    async def read() -> dict:
        reader = RegistryReader(state["redis_url"], state["namespace"])
        try:
            return await reader.heartbeats()
        finally:
            await reader.close()
    return asyncio.run(read())


class Budget:
    """The test's steps together may take `TEST_BUDGET_S` from now: each step's timeout is its
    cap, or less when the budget has less left."""

    def __init__(self, total_s: float) -> None:
        self.started, self.total_s = time.monotonic(), total_s

    def within(self, cap_s: float) -> float:
        left = self.started + self.total_s - time.monotonic()
        assert left > 0, f"the test's steps took over {self.total_s:.0f} s"
        return min(cap_s, left)


def ray_up(config: Path, source: Path, budget: Budget) -> str:
    """`ray up`'s output, run once more when a node's `ray start` gave up on its own raylet."""
    try:
        return ray_cli("up", "-y", str(config), timeout_s=budget.within(420), cwd=source)[1]
    except AssertionError as e:
        if not any(said in str(e) for said in RAY_START_TIMEOUTS):
            raise
        print(f"`ray up` again: a node's `ray start` gave up waiting for its own raylet ({e!s:.300})")
        return ray_cli("up", "-y", str(config), timeout_s=budget.within(420), cwd=source)[1]


def prompts_past_local_prefill(hosts: SshHosts, smollm2_dir: str) -> tuple[list[tuple[str, str]], float]:
    """(prefill worker, decode worker) of each 300-token prompt sent, and when the first one's
    answer ended. A prompt past auto mode's 256 local-prefill tokens goes through the prefill
    worker, unless the router reads its heartbeat as late at that moment (the machine is busy
    with the hosts' set-up): then the decode worker prefills it, and a fresh prompt (not cached
    on the decode worker) tries the hand-off again, three times at most. Each one's greedy
    tokens are exact."""
    rng = random.Random(7)
    routes: list[tuple[str, str]] = []
    first_at = 0.0
    with grpc.insecure_channel(f"{hosts.address('h')}:50051") as channel:
        for _ in range(3):
            prompt = [rng.randrange(100, 40000) for _ in range(300)]
            got = generate(pb_grpc.GenerationStub(channel), prompt, 8)
            first_at = first_at or time.monotonic()
            routes.append((got[-1].route.prefill_worker, got[-1].route.decode_worker))
            assert tokens(got) == greedy(smollm2_dir, prompt, 8)
            if routes[-1][0]:
                break
            time.sleep(1.0)
    return routes, first_at


def ray_down_leaves_nothing(hosts: SshHosts, config: Path, source: Path, budget: Budget) -> tuple[float, float]:
    """`ray down`; then no process of the cluster and no shared memory left on any host.
    Returns how long `ray down` took and how long until nothing was left."""
    down_s, out = ray_cli("down", "-y", str(config), timeout_s=budget.within(300), cwd=source)
    assert "splitserve: stopped" in out, out[-3000:]
    down_at, wait_s = time.monotonic(), budget.within(120)
    while left := hosts.left_running():
        assert time.monotonic() - down_at < wait_s, \
            f"left running {wait_s:.0f} s after `ray down`: {left}; it said:\n{out[-4000:]}"
        time.sleep(0.5)
    gone_s = down_s + time.monotonic() - down_at
    for h in NAMES:
        assert list(hosts.dir(h, "shm").iterdir()) == [], f"shared memory left on host {h}"
    return down_s, gone_s


def test_ray_up_serves_across_hosts_and_ray_down_leaves_nothing(launched: tuple[SshHosts, Path, Path],
                                                               smollm2_dir: str) -> None:
    hosts, config, source = launched
    budget = Budget(TEST_BUDGET_S)
    out = ray_up(config, source, budget)
    assert "splitserve: serving" in out, out[-3000:]
    routes, first_at = prompts_past_local_prefill(hosts, smollm2_dir)
    with urllib.request.urlopen(f"http://{hosts.address('h')}:8000/v1/models", timeout=30) as models:
        assert [m["id"] for m in json.loads(models.read())["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert routes[-1] == ("prefill-0", "decode-0"), routes

    beats = heartbeats(hosts)  # where each worker says it serves, and what each host runs
    assert beats["prefill-0"].address.startswith(hosts.address("p") + ":")
    assert beats["decode-0"].address.startswith(hosts.address("d") + ":")
    assert any("PrefillWorker" in p for p in hosts.processes("p"))
    assert not any("DecodeWorker" in p for p in hosts.processes("p"))
    assert any("DecodeWorker" in p for p in hosts.processes("d"))
    pushed = scrape(beats["prefill-0"].metrics_address, token=serve_state(hosts)["metrics_token"])
    assert pushed.get("splitserve:kv_transfer_blocks_total,role=prefill,transport=tcp", 0) >= 300 // 16

    ray_cli("exec", str(config), "splitserve scale decode 2", timeout_s=budget.within(120), cwd=source)
    wait_for("decode-1 serving on the decode host", lambda: (
        b := heartbeats(hosts).get("decode-1")) is not None and b.state == "serving", budget.within(180))
    assert heartbeats(hosts)["decode-1"].address.startswith(hosts.address("d") + ":")

    down_s, gone_s = ray_down_leaves_nothing(hosts, config, source, budget)
    print(json.dumps({"ray_up_to_first_token_s": round(first_at - budget.started, 1),  # `ray up`, then a request
                      "ray_down_s": round(down_s, 1), "ray_down_to_nothing_left_s": round(gone_s, 1)}))
