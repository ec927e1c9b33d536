"""Separate hosts on one machine, for tests and benchmarks: network namespaces of their own
(a veth pair each to this machine, which routes between them), each process with its own
hostname and a private /dev/shm, so nothing can pass between them but the network. Needs
root, iproute2 and unshare; everything made is removed on the way out."""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cluster.redis_server import free_port
from control.heartbeat import Heartbeat
from control.reader import RegistryReader

SUBNET = "10.77"
TAGS = itertools.count()


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def unavailable() -> str | None:
    """Why separate hosts cannot be made here, or None."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return "separate test hosts need root, iproute2 and unshare"
    return None


@contextlib.contextmanager
def namespaces(names: tuple[str, ...] = ("p", "d")) -> Iterator[dict[str, str]]:
    """One namespace per name, the i-th (from 1) at 10.77.i.2: by default `p` at 10.77.1.2 and
    `d` at 10.77.2.2; this machine is .1 on each link and routes between them. Yields each
    name's namespace, and under "NAME_link" this side's veth of its link. One set at a time on
    a machine (they share the subnet and the forwarding switch): another waits its turn."""
    with _one_set_at_a_time():
        yield from _namespaces(names)


HOSTS_LOCK = Path("/run/lock/splitserve-test-hosts.lock")
HOSTS_LOCK_WAIT_S = 900.0


@contextlib.contextmanager
def _one_set_at_a_time() -> Iterator[None]:
    HOSTS_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with HOSTS_LOCK.open("a") as lock:
        deadline = time.monotonic() + HOSTS_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another set of test hosts held {HOSTS_LOCK} for {HOSTS_LOCK_WAIT_S:.0f} s")
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _namespaces(names: tuple[str, ...]) -> Iterator[dict[str, str]]:
    tag = f"ss{os.getpid() % 100000}{next(TAGS)}"
    made: list[str] = []
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    old_forward = forward.read_text()
    try:
        for i, name in enumerate(names, start=1):
            ns, outside, inside = f"{tag}{name}", f"{tag}{name}o", f"{tag}{name}i"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            name_service(ns, tag, names)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "addr", "add", f"{SUBNET}.{i}.1/24", "dev", outside)
            sh("ip", "link", "set", outside, "up")
            for cmd in (["ip", "addr", "add", f"{SUBNET}.{i}.2/24", "dev", inside], ["ip", "link", "set", inside, "up"],
                        ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", f"{SUBNET}.{i}.1"]):
                sh("ip", "netns", "exec", ns, *cmd)
        forward.write_text("1\n")  # this machine routes between the two links
        yield {**dict(zip(names, made)), **{f"{name}_link": f"{tag}{name}o" for name in names}}
    finally:
        forward.write_text(old_forward)
        for ns in made:
            kill_all_in(ns)
        for ns in made:  # the veth first: a namespace something still references would keep it, and its address
            subprocess.run(["ip", "link", "del", f"{ns}o"], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


NETNS_ETC = Path("/etc/netns")
"""Where `ip netns exec` finds a namespace's own files for /etc (bind-mounted over them)."""


def name_service(ns: str, tag: str, names: tuple[str, ...]) -> None:
    """Host `ns`'s /etc/hosts and /etc/resolv.conf, as a real host has them: its hostname and its
    peers' (plain and tagged, as `on_host` and the SSH hosts name them) resolve to their
    addresses, and a name nothing knows fails at once. With the machine's resolver, every lookup
    from a namespace waited out the DNS timeouts (10-20 s: its server is not reachable from
    there), as Ray's autoscaler and `getent hosts` did."""
    etc = NETNS_ETC / ns
    etc.mkdir(parents=True, exist_ok=True)
    peers = "".join(f"{SUBNET}.{i}.2 {name} {tag}{name}\n" for i, name in enumerate(names, start=1))
    (etc / "hosts").write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n" + peers)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def kill_all_in(ns: str) -> None:
    """Kills whatever runs in namespace `ns`: started there by us (a Ray node's processes)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def on_host(ns: str, argv: list[str], private_shm: bool = True) -> list[str]:
    """`argv` run as a separate host: network namespace `ns`, hostname `ns`, a private /dev/shm
    (`private_shm`: each process its own, so a wrong choice of shm fails; else the machine's,
    which the processes of one host then share as a real host's do)."""
    inner = " ".join(["exec", sys.executable, "-m", "cluster.cli", *argv])
    shm = "mount -t tmpfs -o size=512m tmpfs /dev/shm && " if private_shm else ""
    return ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c", f"hostname {ns} && {shm}{inner}"]


def start_serving(cmd: list[str], secret: str, log: Path | None = None,
                  env: dict[str, str] | None = None, wait_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Starts a process (stderr to `log`, `env` beside the cluster secret in its environment)
    and waits up to `wait_s` for its 'serving on HOST:PORT' line; RuntimeError saying how it
    ended (its exit code, and the log's tail) when it does not serve."""
    err = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "SPLITSERVE_CLUSTER_SECRET": secret, **(env or {})})
    deadline = time.monotonic() + wait_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if found := re.search(r"serving on (\S+:\d+)", line):
                return proc, found[1]
            if not line and proc.poll() is not None:
                break
    code = proc.poll()
    proc.kill()
    what = f"exited with code {code}" if code is not None else f"did not serve within {wait_s:.0f} s"
    where = f"see {log}: {log.read_text()[-2000:]}" if log is not None else f"({' '.join(cmd[:8])})"
    raise RuntimeError(f"{what}: {where}")


def handoffs(metrics: dict[str, float]) -> dict[str, Any]:
    """A prefill worker's hand-offs from its scraped /metrics (`scrape`): how many moved KV,
    their mean time from open to the decode worker's ack, and the bytes."""
    count, total = (sum(v for k, v in metrics.items() if k.startswith(f"splitserve:kv_transfer_seconds_{part},"))
                    for part in ("count", "sum"))
    sent = sum(v for k, v in metrics.items() if k.startswith("splitserve:kv_transfer_bytes_total"))
    return {"count": int(count), "mean_ms": round(total / count * 1e3, 3) if count else None,
            "bytes": int(sent), "bytes_per_handoff": int(sent / count) if count else None}


class Hosts:
    """A Redis on this machine that both hosts reach, and the splitserve processes started
    on them or here (stopped at the end, Redis last)."""

    def __init__(self, hosts: dict[str, str], model_dir: str, tmp_path: Path, kv_cache_mib: int = 8,
                 private_shm: bool = True, kv_transport: str | None = None) -> None:
        """`kv_transport`: the workers' --kv-transport; nixl runs every process with UCX_TLS=tcp,self:
        UCX sees through a network namespace (one machine: it would use shared memory or CMA, and
        a cut link would stop nothing), so its bytes cross the veth as between two machines."""
        self.hosts, self.tmp_path, self.port, self.private_shm = hosts, tmp_path, free_port(), private_shm
        self.names = [name for name in hosts if not name.endswith("_link")]
        """The hosts, in the order `namespaces` numbered their links."""
        self.common = ["--namespace", "hosts", "--model", model_dir, "--kv-cache-mib", str(kv_cache_mib),
                       *(["--kv-transport", kv_transport] if kv_transport else [])]
        self.env = {"UCX_TLS": "tcp,self"} if kv_transport == "nixl" else {}
        bind = " ".join(["127.0.0.1", *(f"{SUBNET}.{i}.1" for i in range(1, len(self.names) + 1))])
        self.procs: list[subprocess.Popen] = [subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", bind,
             "--protected-mode", "no", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def redis_url(self, via: str) -> str:
        return f"redis://{via}:{self.port}/0"

    def start(self, name: str, argv: list[str]) -> str:
        """Starts `cluster.cli argv` (on a test host when `name` is one) and returns its address."""
        cmd = (on_host(self.hosts[name], argv, self.private_shm) if name in self.hosts
               else [sys.executable, "-m", "cluster.cli", *argv])
        proc, address = start_serving(cmd, "hosts-test-secret", self.tmp_path / f"{argv[0]}-{len(self.procs)}.log",
                                      self.env)
        self.procs.append(proc)
        return address

    def worker(self, name: str, role: str, worker_id: str, redis_via: str) -> str:
        """A worker binding 0.0.0.0 and advertising its address on the route to `redis_via`."""
        return self.start(name, ["worker", role, "--worker-id", worker_id, "--redis-url", self.redis_url(redis_via),
                                 "--host", "0.0.0.0", *self.common])

    def metrics_address(self, worker_id: str) -> str:
        return metrics_address(self.redis_url("127.0.0.1"), "hosts", worker_id)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def heartbeats(redis_url: str, namespace: str) -> dict[str, Heartbeat]:
    """The cluster's workers' last heartbeats, by worker id."""
    async def read() -> dict[str, Heartbeat]:
        reader = RegistryReader(redis_url, namespace)
        try:
            return await reader.heartbeats()
        finally:
            await reader.close()
    return asyncio.run(read())


def metrics_address(redis_url: str, namespace: str, worker_id: str) -> str:
    """Where a worker serves /metrics, from its heartbeat."""
    return heartbeats(redis_url, namespace)[worker_id].metrics_address


def scrape(address: str, ns: str | None = None, token: str | None = None) -> dict[str, float]:
    """`address`'s /metrics (from inside namespace `ns` when given; showing the cluster's
    scrape `token`, which a listener bound beyond loopback asks for): sample name with its
    role, state and transport labels ("splitserve:x,role=decode") -> value."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    code = ("import urllib.request; print(urllib.request.urlopen(urllib.request.Request("
            f"'http://{address}/metrics', headers={headers!r}), timeout=3).read().decode())")
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", code] if ns else [sys.executable, "-c", code]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=15).stdout
    kept = ("role", "state", "transport")
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k in kept): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def ray_node(ns: str, gcs_address: str, node_ip: str, resources: dict[str, float], log: Path) -> subprocess.Popen:
    """A Ray worker node on host `ns` joined to the head at `gcs_address` (its processes stay
    in the namespace: `namespaces()` kills them on the way out)."""
    ray = Path(sys.executable).with_name("ray")
    inner = " ".join(["exec", str(ray), "start", "--block", f"--address={gcs_address}", f"--node-ip-address={node_ip}",
                      "--num-cpus=1", "--object-store-memory=100000000", "--resources", f"'{json.dumps(resources)}'"])
    return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c",
                             f"hostname {ns} && mount -t tmpfs -o size=512m tmpfs /dev/shm && {inner}"],
                            stdout=log.open("a"), stderr=subprocess.STDOUT)
