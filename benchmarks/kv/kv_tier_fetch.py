"""A KV store fetch against kvfabric's own push of the same blocks, and the store's spill
file read against `dd` of the same bytes, on this host.

    ./dev python -m benchmarks.kv.kv_tier_fetch [--shape small|llama3_8b] [--blocks 16,64,256] [--repeats 10]

Three arms per block count, each the median of `--repeats` runs, in one process:
  push   a FabricSender pushes the blocks into a receiver's shared pool (open, push, ready:
         what a prefill worker's hand-off costs), the baseline
  fetch  the store's gRPC Lookup + Fetch: it pins the blocks and pushes them into the same
         receiver (what a worker's fetch costs, but for its engine-thread hops)
  disk   the same fetch with every block in the store's spill file (read back first), and
         `dd` reading the same bytes of that file (page cache warm for both: the blocks were
         just written)
  disk_cold    the same with the file's pages dropped from the page cache before each run
               (fdatasync + POSIX_FADV_DONTNEED), for the fetch and for `dd`: the disk itself
  disk_direct  a spill file opened O_DIRECT (`--kv-store-direct-io`), against `dd iflag=direct`
One JSON line per (arm, blocks): milliseconds, GB/s, and the ratio to `push` (disk: to dd).
`KV_TIER_DISK_DIR` chooses the directory of the spill files (default: the temp directory).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time

import grpc
import numpy as np

from kvfabric import BlockRegion, FabricLayout, FabricReceiver, FabricSender, KVArrived, ShmSegment
from kvstore.disk import DiskTier
from kvstore.service import serve
from kvstore.store import KVStore
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import ticket_to_pb

SHAPES = {"small": (12, 16, 4, 64), "llama3_8b": (32, 16, 8, 128)}


def layout_of(shape: str) -> FabricLayout:
    layers, block, heads, dim = SHAPES[shape]
    return FabricLayout("tier-fetch", "bfloat16", layers, block, heads, dim, 2)


def wait_arrival(receiver: FabricReceiver) -> None:
    deadline = time.monotonic() + 10
    while True:
        events = receiver.poll(0.5)
        if any(isinstance(e, KVArrived) for e in events):
            return
        assert time.monotonic() < deadline, "no arrival"


async def bench(shape: str, counts: list[int], repeats: int) -> list[dict]:
    layout = layout_of(shape)
    most = max(counts)
    rng = np.random.default_rng(0)
    source = BlockRegion(rng.integers(0, 256, (most, layout.block_bytes), dtype=np.uint8))
    seg = ShmSegment.create(most * layout.block_bytes)
    pool = BlockRegion(seg.data.reshape(most, layout.block_bytes))
    receiver = FabricReceiver(layout, pool, shm=seg)
    sender = FabricSender(layout, source)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("KV_TIER_DISK_DIR")) as disk_dir:
        stores = {"fetch": KVStore(layout, most),
                  "disk": KVStore(layout, most, disk=DiskTier(disk_dir, 2 * most, layout.block_bytes)),
                  "disk_direct": KVStore(layout, most, disk=DiskTier(disk_dir, 2 * most, layout.block_bytes,
                                                                     direct=True))}
        servers = []
        try:
            hashes = [i.to_bytes(16, "little") for i in range(most)]
            other = [(most + i).to_bytes(16, "little") for i in range(most)]
            for name, store in stores.items():
                for chain, first in ((hashes, 0), (other, 0)) if store.disk is not None else ((hashes, 0),):
                    ticket, wanted = store.offer(chain)  # filled through kvfabric, as a worker's offload fills it
                    t = sender.open(ticket)
                    t.push(list(range(first, first + len(wanted))), 0)
                    t.finish(0, len(wanted) * layout.block_size)
                    deadline = time.monotonic() + 10
                    while store.lookup(chain) < len(chain):
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                server, port = await serve(store, "127.0.0.1", 0, None)
                servers.append((server, port))
            assert all(h in stores[d].disk for h in hashes for d in ("disk", "disk_direct"))  # the second chain spilled the first
            ports = {name: port for name, (_, port) in zip(stores, servers, strict=True)}
            arms = [("fetch", "fetch", False), ("disk", "disk", False), ("disk_cold", "disk", True),
                    ("disk_direct", "disk_direct", False)]
            for n in counts:
                pushed = []
                for i in range(repeats + 1):
                    ticket = receiver.expect(f"push-{n}-{i}", list(range(n)), 0)
                    t0 = time.perf_counter()
                    t = sender.open(ticket)
                    t.push(list(range(n)), 0)
                    t.finish(0, n * layout.block_size)
                    took = time.perf_counter() - t0
                    wait_arrival(receiver)
                    if i:
                        pushed.append(took)
                base = statistics.median(pushed)
                rows.append(row(shape, "push", n, base, layout, 1.0))
                for name, key, cold in arms:
                    store = stores[key]
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[key]}") as channel:
                        stub = pb_grpc.KVStoreStub(channel)
                        took_all = []
                        for i in range(repeats + 1):
                            if store.disk is not None:  # back into the file: each run reads all n from disk
                                respill(store, hashes[:n])
                                if cold:
                                    drop_cache(store)
                            ticket = receiver.expect(f"{name}-{n}-{i}", list(range(n)), 0)
                            t0 = time.perf_counter()
                            k = (await stub.Lookup(pb.LookupRequest(block_hashes=hashes[:n]))).num_blocks
                            reply = await stub.Fetch(pb.FetchRequest(ticket=ticket_to_pb(ticket),
                                                                     block_hashes=hashes[:k]))
                            took = time.perf_counter() - t0
                            assert k == n and not reply.error, reply.error
                            wait_arrival(receiver)
                            assert np.array_equal(pool.array[:n], source.array[:n])
                            if i:
                                took_all.append(took)
                        median = statistics.median(took_all)
                        if name == "fetch":
                            rows.append(row(shape, "fetch", n, median, layout, median / base))
                        else:
                            dd = dd_seconds(store, n, layout.block_bytes, repeats, cold)
                            rows.append({**row(shape, name, n, median, layout, median / base),
                                         "dd_ms": round(dd * 1e3, 3), "vs_dd": round(median / dd, 2)})
        finally:
            for server, _ in servers:
                await server.stop(0)
            for store in stores.values():
                store.close()
            sender.close()
            receiver.close()
            seg.close()
    return rows


def respill(store: KVStore, hashes: list[bytes]) -> None:
    """Puts `hashes` back into the spill file, as memory's eviction would (the benchmark reaches
    into the store: each run must read every block from the file)."""
    with store._lock:  # noqa: SLF001
        for h in hashes:
            if h in store._index:  # noqa: SLF001
                slot = store._index.pop(h)  # noqa: SLF001
                store.disk.put(h, store.region.array[slot])
                store._free.append(slot)  # noqa: SLF001


def drop_cache(store: KVStore) -> None:
    """The spill file's pages out of the page cache (written back first: dirty ones stay)."""
    os.fdatasync(store.disk.fd)
    os.posix_fadvise(store.disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def dd_seconds(store: KVStore, n: int, block_bytes: int, repeats: int, cold: bool) -> float:
    """`dd` reading n blocks' bytes of the spill file (through /proc: the file is unlinked),
    with O_DIRECT where the store's file is direct, from the disk where `cold`."""
    path = f"/proc/{os.getpid()}/fd/{store.disk.fd}"
    direct = ["iflag=direct"] if store.disk.direct else []
    times = []
    for _ in range(repeats):
        if cold:
            drop_cache(store)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={store.disk.stride}", f"count={n}", *direct],
                       check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(shape: str, arm: str, n: int, seconds: float, layout: FabricLayout, ratio: float) -> dict:
    nbytes = n * layout.block_bytes
    return {"bench": "kv_tier_fetch", "shape": shape, "arm": arm, "blocks": n, "bytes": nbytes,
            "ms": round(seconds * 1e3, 3), "gb_per_s": round(nbytes / seconds / 1e9, 2), "vs_push": round(ratio, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    for r in asyncio.run(bench(args.shape, [int(x) for x in args.blocks.split(",")], args.repeats)):
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
