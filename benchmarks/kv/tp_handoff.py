"""KV hand-off between workers of different tensor-parallel degrees, against the same degree:
one request's blocks pushed through real kvfabric (open, pushes, ready and its ack) from a
sender's rank pools into a receiver's, over shm and tcp, on this host.

    ./dev python -m benchmarks.kv.tp_handoff [--blocks 64] [--repeats 20] [--shape small|llama3_8b]

One JSON line per (transport, sender degree, receiver degree): the bytes every receiver rank
got in all, the pieces the heads moved in, the median and p90 hand-off time, and the ratio
of the median to the same transport's TP 1 -> TP 1 in this run. Pools are host memory (the
split workers' shared pools), sender and receiver in this process (threads), as the workers'
push lane and receiver threads are; the ranks' processes take no part in a hand-off.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvfabric import (BlockRegion, FabricLayout, FabricReceiver, FabricSender, KVArrived, ReceiverConfig,
                      SenderConfig, ShmSegment)
from kvfabric.layout import HeadMap

SHAPES = {  # layers, block tokens, KV heads, head dim (bfloat16)
    "small": (12, 16, 4, 64),
    "llama3_8b": (32, 16, 8, 128),
}
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (2, 4)]


def layout(shape: str, world: int) -> FabricLayout:
    layers, block, heads, dim = SHAPES[shape]
    return FabricLayout("tp-handoff", "bfloat16", layers, block, heads // world, dim, 2, model_kv_heads=heads,
                        shards=tuple(r * heads // world for r in range(world)))


def one_pair(shape: str, p: int, d: int, transport: str, num_blocks: int, repeats: int) -> dict:
    src, dst = layout(shape, p), layout(shape, d)
    rng = np.random.default_rng(0)
    sources = [BlockRegion(rng.integers(0, 256, (num_blocks, src.block_bytes), dtype=np.uint8)) for _ in range(p)]
    segments = [ShmSegment.create(num_blocks * dst.block_bytes) for _ in range(d)]
    regions = [BlockRegion(s.data.reshape(num_blocks, dst.block_bytes)) for s in segments]
    receiver = FabricReceiver(dst, regions, ReceiverConfig(io_timeout_s=30), shm=segments[0], shm_ranks=segments[1:])
    sender = FabricSender(src, sources, SenderConfig(transport=transport))
    ids = list(range(num_blocks))
    times = []
    try:
        for i in range(repeats + 1):  # the first connects and maps: not counted
            ticket = receiver.expect(f"r{i}", ids, 0)
            t0 = time.perf_counter()
            transfer = sender.open(ticket)
            for first in range(0, num_blocks, 16):  # pushed as a chunked prefill pushes: 16 blocks a chunk
                transfer.push(ids[first:first + 16], first)
            transfer.finish(1, num_blocks * dst.block_size)
            took = time.perf_counter() - t0
            events = []
            while not events:
                events = receiver.poll(1.0)
            assert isinstance(events[0], KVArrived)
            if i:
                times.append(took)
    finally:
        sender.close()
        receiver.close()
        for s in segments:
            s.close()
    heads = HeadMap.between(src, dst)
    return {"bench": "tp_handoff", "shape": shape, "transport": transport, "prefill_tp": p, "decode_tp": d,
            "blocks": num_blocks, "bytes": num_blocks * heads.block_bytes(), "pieces": len(heads.pieces),
            "whole_block_pieces": sum(heads.is_whole(x) for x in heads.pieces),
            "median_ms": round(statistics.median(times) * 1e3, 3),
            "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = ap.parse_args()
    for transport in ("shm", "tcp"):
        base = None
        for p, d in PAIRS:
            row = one_pair(args.shape, p, d, transport, args.blocks, args.repeats)
            base = base or row["median_ms"]
            row["vs_tp1_to_tp1"] = round(row["median_ms"] / base, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
