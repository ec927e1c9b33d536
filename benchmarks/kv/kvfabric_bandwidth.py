"""kvfabric bandwidth and latency against the copy limit of each medium, in one run.

The receiver runs in a child process (as a decode worker would) over a shared-memory
pool; this process is the sender. For each case (transport, block shape, number of
blocks, contiguous or scattered destination ids) it times open -> push -> finish (the
time runs from the start of the push to the receiver's completion event, both read
from the host's monotonic clock) and compares with the limit
measured in the same run on the same bytes:
- shm: memcpy from the source into a warm shared-memory segment (the medium: tmpfs
  pages, as the decode pool has). The transfers copy as the prefill worker does, with the
  engine's `copy_stream` (non-temporal stores; `--copy memmove` for glibc's memcpy), so a
  fraction above 1 is possible: glibc streams only copies of hundreds of MB, and below
  that pays a read of every destination line before writing it. Also reported: memcpy into private memory
  (`memcpy_private_gb_per_s`), which is faster when numpy gets transparent huge pages
  and when source and destination fit in the last-level cache together;
- tcp: a raw long-lived loopback socket to another process (`recv_into` a buffer).
  With `--hosts cross` (root; iproute2) the receiver and the raw socket's far end run in a
  network namespace of their own behind a veth pair, so both cross a host boundary as KV
  between two machines would (the namespace is removed at the end); `--hosts same,cross`
  runs both in one invocation.
- nixl: NIXL's one-sided writes (UCX) into the receiver's registered pool, which is private
  memory on huge pages (as a worker's pool is when the cluster's transport is nixl), against
  memcpy into such memory on one host and against the raw socket across hosts. On one host
  also against the kernel's own cross-process copy (`cma_gb_per_s`: process_vm_writev, which
  UCX's CMA transport calls): past glibc's threshold for non-temporal stores (hundreds of MB)
  memcpy runs faster than any copy the kernel makes. UCX sees through a network namespace
  (same machine: it would use shared memory or CMA), so across hosts both ends run with
  UCX_TLS=tcp,self (unless set): what it moves over the veth, as between two machines
  without an RDMA NIC. With `--tls`, the
  fabric's tcp runs under the mutual TLS a cluster's members speak (control/tls.py), against
  the same plain raw socket: its fraction of the limit is TLS's cost.
Transfers and limit measurements alternate, best of --reps for each, and each starts with
cold caches (a scratch buffer twice the last-level cache is written first): otherwise the
limit's destination, rewritten every rep, stays cached while the decode pool's blocks do
not, and the comparison is unequal. A decode pool's blocks are cold in service too (every
decode step streams the weights through the cache). Also the 1-block push latency (push
start to receiver completion, median), back to back (`push_latency_us`) and from cold
caches (`push_latency_cold_us`).

One JSON line per case. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvfabric import (  # noqa: E402
    BlockRegion, FabricLayout, FabricReceiver, FabricSender, KVArrived, ReceiverConfig, SenderConfig, ShmSegment,
    Ticket,
)
from control.tls import client_context, member_tls, server_context  # noqa: E402
from engine.kernels import native  # noqa: E402
from engine.model.kv_pool import host_pages  # noqa: E402
from kvfabric.layout import coalesce  # noqa: E402
from kvfabric.region import CopyBytes  # noqa: E402
from kvfabric.wire import tune  # noqa: E402

SHAPES = {
    # the `small` embedded model: 12 layers, 4 KV heads, head dim 64, bf16, 16 tokens: 192 KiB
    "small": FabricLayout("small", "bfloat16", 12, 16, 4, 64, 2),
    # Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, 16 tokens: 2 MiB
    "llama3_8b": FabricLayout("llama3-8b", "bfloat16", 32, 16, 8, 128, 2),
}


CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def enter_netns(name: str | None) -> None:
    """Moves this (still single-threaded) process into network namespace `name`, with a /sys
    of that namespace as `ip netns exec` gives (UCX lists network devices from /sys/class/net:
    the old one names this machine's, and NIXL's agent then advertises loopback alone)."""
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    if (libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"", b"/", None, MS_REC | MS_SLAVE, None) != 0
            or libc.umount2(b"/sys", MNT_DETACH) != 0 or libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0):
        raise OSError(ctypes.get_errno(), f"a /sys of namespace {name} could not be mounted")


@contextlib.contextmanager
def cross_host() -> Iterator[tuple[str, str, str]]:
    """A network namespace behind a veth pair: (its name, this side's address, its address)."""
    ns, outside = f"kvbw{os.getpid() % 100000}", f"kvbw{os.getpid() % 100000}o"
    VETH_NAMES[:] = [outside, f"{outside[:-1]}i"]

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{outside[:-1]}i")
        sh("ip", "link", "set", f"{outside[:-1]}i", "netns", ns)
        sh("ip", "addr", "add", "10.79.0.1/24", "dev", outside)
        sh("ip", "link", "set", outside, "up")
        for cmd in (("ip", "addr", "add", "10.79.0.2/24", "dev", f"{outside[:-1]}i"),
                    ("ip", "link", "set", f"{outside[:-1]}i", "up"), ("ip", "link", "set", "lo", "up")):
            sh("ip", "netns", "exec", ns, *cmd)
        yield ns, "10.79.0.1", "10.79.0.2"
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


VETH_NAMES: list[str] = []
"""The veth pair's two ends while `cross_host` runs (this side's, the namespace's)."""
TLS_SECRET = b"kvfabric-bandwidth-tls"


def receiver_child(pipe: Connection, layout_wire: dict, num_blocks: int, netns: str | None = None,
                   host: str = "127.0.0.1", tls: bool = False, nixl: bool = False) -> None:
    """A receiver over a shared-memory pool (shm, tcp) and, for nixl, one over a private pool
    (`kv_allocator(device, "nixl")`'s: a worker serving nixl keeps its pool there)."""
    enter_netns(netns)
    layout = FabricLayout.from_wire(layout_wire)
    seg = ShmSegment.create(num_blocks * layout.block_bytes)
    pools = {"shared": BlockRegion(seg.data.reshape(num_blocks, layout.block_bytes))}
    if nixl:
        pools["private"] = BlockRegion(host_pages(num_blocks * layout.block_bytes).numpy().reshape(num_blocks, -1))
    config = ReceiverConfig(host=host, lease_s=30, tls=server_context(member_tls(TLS_SECRET)) if tls else None)
    receivers = {}
    for kind, region in pools.items():
        region.array[:] = 0  # fault the pages in, as a long-running decode pool would have
        # perf_counter is CLOCK_MONOTONIC: comparable with the sender's on the same host
        receivers[kind] = FabricReceiver(layout, region, dataclasses.replace(config, nixl=kind == "private"),
                                         clock=time.perf_counter, **({"shm": seg} if kind == "shared" else {}))
    pipe.send(pools["private"].array.ctypes.data if nixl else None)  # ready; where a CMA write lands
    arrived: dict[str, float] = {}
    while True:
        cmd = pipe.recv()
        if cmd is None:
            for r in receivers.values():
                r.close()
            pools.clear()
            seg.close()  # a multiprocessing child skips atexit: unlink here
            return
        if cmd[0] == "expect":
            pipe.send(receivers[cmd[3]].expect(cmd[1], cmd[2], 0).to_wire())
            continue
        receiver = receivers[cmd[2]]
        while cmd[1] not in arrived:  # "arrival": when the receiver saw the transfer complete
            arrived.update((e.request_id, e.arrived_at) for e in receiver.poll(timeout_s=5) if isinstance(e, KVArrived))
        pipe.send(arrived.pop(cmd[1]))


def raw_socket_child(port: int, max_bytes: int, netns: str | None = None, server: str = "127.0.0.1") -> None:
    """The tcp limit's far end: receive [u64 length][payload] with recv_into, answer one byte."""
    enter_netns(netns)
    sock = socket.create_connection((server, port))
    tune(sock, 60)
    buf = memoryview(bytearray(max_bytes))
    head = bytearray(8)
    while sock.recv_into(head, 8, socket.MSG_WAITALL) == 8:
        nbytes, got = int.from_bytes(head, "big"), 0
        while got < nbytes:
            got += sock.recv_into(buf[got:nbytes])
        sock.sendall(b"k")


class RawSocket:
    """A long-lived connection to a child process (loopback, or across the veth): the tcp copy limit."""

    def __init__(self, max_bytes: int, netns: str | None = None, host: str = "127.0.0.1") -> None:
        server = socket.create_server((host, 0))
        self.child = mp.get_context("spawn").Process(
            target=raw_socket_child, args=(server.getsockname()[1], max_bytes, netns, host), daemon=True)
        self.child.start()
        self.conn, _ = server.accept()
        server.close()
        tune(self.conn, 60)

    def send_s(self, payload: np.ndarray) -> float:
        t0 = time.perf_counter()
        self.conn.sendall(payload.nbytes.to_bytes(8, "big"))
        self.conn.sendall(memoryview(payload).cast("B"))
        self.conn.recv(1)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()
        self.child.join(5)


def last_level_cache_bytes() -> int:
    try:
        return max(int(os.sysconf("SC_LEVEL3_CACHE_SIZE")), 1 << 20)
    except (ValueError, OSError):
        return 32 << 20


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


LIBC = ctypes.CDLL(None, use_errno=True)


def memcpy_s(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst[: len(src)], src)
    return time.perf_counter() - t0


class Bench:
    def __init__(self, layout: FabricLayout, num_blocks: int, copy: CopyBytes,
                 hosts: tuple[str, str, str] | None = None, tls: bool = False, transports: tuple[str, ...] = ()) -> None:
        """`hosts`: (namespace, this side's address, its address) to put the far ends across a
        veth; `tls`: the fabric's tcp under the members' mutual TLS."""
        self.layout, self.num_blocks, self.cross = layout, num_blocks, hosts is not None
        netns, near, far = hosts if hosts is not None else (None, "127.0.0.1", "127.0.0.1")
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.child = ctx.Process(target=receiver_child, args=(child, layout.to_wire(), num_blocks, netns, far, tls,
                                                              "nixl" in transports), daemon=True)
        self.child.start()
        self.private_pool = self.pipe.recv()
        """The child's private pool's address (nixl), for the kernel's own cross-process copy."""
        rng = np.random.default_rng(0)
        self.src = rng.integers(0, 256, (num_blocks, layout.block_bytes), dtype=np.uint8)
        tls_context = client_context(member_tls(TLS_SECRET)) if tls else None
        self.senders = {t: FabricSender(layout, BlockRegion(self.src), SenderConfig(transport=t, tls=tls_context), copy)
                        for t in ("shm", "tcp", *(("nixl",) if "nixl" in transports else ()))}
        self.n = 0
        self.memcpy_dst = host_pages(self.src.nbytes).numpy().reshape(self.src.shape)  # as a nixl pool's
        self.memcpy_dst[:] = 1
        self.shm_scratch = ShmSegment.create(self.src.nbytes)  # the medium itself: tmpfs pages, as the pool
        self.shm_dst = self.shm_scratch.data.reshape(self.src.shape)
        self.shm_dst[:] = 1
        self.raw = RawSocket(self.src.nbytes, netns, near)
        self.scratch = np.zeros(2 * last_level_cache_bytes(), dtype=np.uint8)
        for _ in range(3):  # let the connection's window open, as the fabric's long-lived one has
            self.raw.send_s(self.src)

    def cold(self) -> Bench:
        """Evict the caches (write a buffer twice the last-level cache); returns self."""
        self.scratch.fill(self.n & 0xFF)
        return self

    def same_pattern_s(self, src_ids: list[int], dst_ids: list[int]) -> float:
        """The shm transfer's copies with nothing around them: coalesced runs, memmove each."""
        dst = BlockRegion(self.shm_dst)
        src = self.senders["shm"].region
        t0 = time.perf_counter()
        for r in coalesce(src_ids, dst_ids):
            dst.copy_from(src, r.src_block, r.dst_block, r.num_blocks)
        return time.perf_counter() - t0

    def limit_s(self, transport: str, n: int) -> float:
        if transport == "shm":
            return memcpy_s(self.src[:n], self.shm_dst)
        if transport == "nixl" and not self.cross:  # into memory of the kind the nixl pool is
            return memcpy_s(self.src[:n], self.memcpy_dst)
        return self.raw.send_s(self.src[:n])

    def cma_s(self, n: int) -> float:
        """The kernel's cross-process copy (process_vm_writev, what UCX's CMA does on one host)
        of `n` blocks into the receiver's private pool."""
        nbytes = n * self.layout.block_bytes
        local = IoVec(self.src.ctypes.data, nbytes)
        remote = IoVec(self.private_pool, nbytes)
        t0 = time.perf_counter()
        done = LIBC.process_vm_writev(self.child.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        took = time.perf_counter() - t0
        if done != nbytes:
            raise OSError(ctypes.get_errno(), "process_vm_writev")
        return took

    @staticmethod
    def pool_of(transport: str) -> str:
        return "private" if transport == "nixl" else "shared"

    def ticket(self, transport: str, block_ids: list[int]) -> Ticket:
        self.n += 1
        self.pipe.send(("expect", f"b{self.n}", block_ids, self.pool_of(transport)))
        return Ticket.from_wire(self.pipe.recv())

    def transfer_s(self, transport: str, src_ids: list[int], dst_ids: list[int]) -> float:
        """From the start of the push until the receiver recorded completion (its KVArrived)."""
        ticket = self.ticket(transport, dst_ids)
        transfer = self.senders[transport].open(ticket)
        t0 = time.perf_counter()
        transfer.push(src_ids, 0)
        transfer.finish(1, len(dst_ids) * self.layout.block_size)
        self.pipe.send(("arrival", ticket.request_id, self.pool_of(transport)))
        return self.pipe.recv() - t0

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.raw.close()
        self.shm_dst = None
        self.shm_scratch.close()
        self.pipe.send(None)
        self.child.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,llama3_8b")
    ap.add_argument("--blocks", default="1,4,16,64,256")
    ap.add_argument("--transports", default="shm,tcp,nixl")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--latency-iters", type=int, default=300)
    ap.add_argument("--hosts", default="same",
                    help="same, cross (the receiver and the raw socket's far end in a network namespace behind a "
                         "veth; root), or same,cross: both in one run (shm only runs on the same host)")
    ap.add_argument("--tls", action="store_true", help="the fabric's tcp under the cluster members' mutual TLS")
    ap.add_argument("--copy", choices=("stream", "memmove"), default="stream",
                    help="how shm pushes copy: the engine's copy_stream (as the prefill worker) or memmove")
    args = ap.parse_args()
    kernels = native.load() if args.copy == "stream" else None
    if args.copy == "stream" and kernels is None:
        sys.exit("--copy stream needs the engine's native kernels (a C compiler); use --copy memmove")
    copy = kernels.copy_stream if kernels is not None else ctypes.memmove
    counts = [int(x) for x in args.blocks.split(",")]
    wheres = args.hosts.split(",")
    if any(where not in ("same", "cross") for where in wheres):
        sys.exit(f"--hosts: same or cross, not {args.hosts!r}")
    if len(wheres) > 1 and "nixl" in args.transports.split(","):
        # UCX reads the host's network devices once per process: an agent made after the veth
        # appeared still finds no route over it. Each placement runs in a process of its own.
        for where in wheres:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--hosts", where], check=True)
        return
    for where in wheres:
        with cross_host() if where == "cross" else contextlib.nullcontext() as hosts, \
                ucx_over_the_network(hosts):
            for shape in args.shapes.split(","):
                run_shape(SHAPES[shape], shape, counts, copy, hosts, args)


@contextlib.contextmanager
def ucx_over_the_network(hosts: tuple[str, str, str] | None) -> Iterator[None]:
    """Across `hosts`: UCX over TCP on the veth alone (UCX_TLS, UCX_NET_DEVICES: both ends of
    the pair; each side has one of them), unless set. The agents made meanwhile (this
    process's, and the receiver child's, which inherits it) move bytes over the veth, not
    around it, and never from another interface whose address the namespace cannot answer."""
    wanted = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": ",".join(VETH_NAMES)} if hosts is not None else {}
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            del os.environ[k]


def run_shape(layout: FabricLayout, shape: str, counts: list[int], copy: CopyBytes, hosts: tuple[str, str, str] | None,
              args: argparse.Namespace) -> None:
    transports = tuple(t for t in args.transports.split(",") if hosts is None or t != "shm")
    bench = Bench(layout, max(counts), copy, hosts, args.tls, transports)
    try:
        for transport in transports:
            for n in counts:
                for contiguous in (True, False) if n > 1 else (True,):
                    run_case(bench, transport, shape, n, contiguous, args)
    finally:
        bench.close()


def run_case(bench: Bench, transport: str, shape: str, n: int, contiguous: bool, args: argparse.Namespace) -> None:
    layout = bench.layout
    rng = np.random.default_rng(n)
    src_ids = list(range(n)) if contiguous else [int(x) for x in rng.permutation(bench.num_blocks)[:n]]
    dst_ids = list(range(n)) if contiguous else [int(x) for x in rng.permutation(bench.num_blocks)[:n]]
    bench.transfer_s(transport, src_ids, dst_ids)  # warm: connection, mapping
    best, best_limit, best_private, best_pattern, best_cma = (float("inf"),) * 5
    cma = transport == "nixl" and not bench.cross
    for _ in range(args.reps):  # interleaved, so all see the same machine noise
        best = min(best, bench.cold().transfer_s(transport, src_ids, dst_ids))
        best_limit = min(best_limit, bench.cold().limit_s(transport, n))
        if cma:
            best_cma = min(best_cma, bench.cold().cma_s(n))
        if transport == "shm":
            best_private = min(best_private, memcpy_s(bench.src[:n], bench.cold().memcpy_dst))
            if not contiguous:
                best_pattern = min(best_pattern, bench.cold().same_pattern_s(src_ids, dst_ids))
    limit = n * layout.block_bytes / best_limit / 1e9
    private = n * layout.block_bytes / best_private / 1e9
    pattern = n * layout.block_bytes / best_pattern / 1e9
    gb_per_s = n * layout.block_bytes / best / 1e9
    latency = latency_cold = None
    if n == 1:
        latency = statistics.median(bench.transfer_s(transport, [0], [0]) for _ in range(args.latency_iters)) * 1e6
        latency_cold = statistics.median(
            bench.cold().transfer_s(transport, [0], [0]) for _ in range(args.latency_iters)) * 1e6
    print(json.dumps({
        "bench": "kvfabric_bandwidth", "transport": transport, "tls": args.tls and transport == "tcp",
        "cross_host": bench.cross, "copy": args.copy if transport == "shm" else None,
        "limit": "memcpy" if transport == "shm" or (transport == "nixl" and not bench.cross) else "raw_socket",
        "shape": shape, "block_bytes": layout.block_bytes,
        "blocks": n, "contiguous": contiguous, "reps": args.reps, "gb_per_s": round(gb_per_s, 3),
        "limit_gb_per_s": round(limit, 3), "fraction_of_limit": round(gb_per_s / limit, 3),
        "push_latency_us": None if latency is None else round(latency, 1),
        "push_latency_cold_us": None if latency_cold is None else round(latency_cold, 1),
        **({"memcpy_private_gb_per_s": round(private, 3), "fraction_of_private_memcpy": round(gb_per_s / private, 3)}
           if transport == "shm" else {}),
        **({"cma_gb_per_s": round(n * layout.block_bytes / best_cma / 1e9, 3),
            "fraction_of_cma": round(best_cma / best, 3)} if cma else {}),
        **({"same_pattern_memcpy_gb_per_s": round(pattern, 3), "fraction_of_same_pattern": round(gb_per_s / pattern, 3)}
           if transport == "shm" and not contiguous else {}),
    }), flush=True)


if __name__ == "__main__":
    main()
