"""Abort storm: many requests through a real cluster, each cancelled by its client at a random
moment: while queued for admission, while prefilling or its KV is moving, mid-decode, or
never (it finishes). Afterwards nothing may be left: every pool is free + cached = total,
no reservation, quarantine, hand-off or transfer remains, the routers' books are zero, and
the workers created no /dev/shm segment beyond their KV pools.

    ./dev python benchmarks/hostile/abort_storm.py --num-requests 10000      # the issue's storm
    ./dev python benchmarks/hostile/abort_storm.py --target HOST:PORT ...    # a cluster already running

One JSON line: the config, requests by moment and by how they ended, seconds, and what was
held afterwards (must be []). Exits non-zero when anything was held or a request ended
with a status that is not the client's cancel, OK or an overload refusal.
`tests/integration/test_abort_storm.py` runs a short storm in the suite.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

MOMENTS = ("queued", "prefilling", "first_token", "decoding", "finished")
EXPECTED_CODES = {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}
"""How a storm's requests may end: finished, cancelled by the client, or refused as overload."""


@dataclass
class StormResult:
    sent: Counter = field(default_factory=Counter)
    """Requests by the moment their cancel was aimed at."""
    ended: Counter = field(default_factory=Counter)
    """Requests by how they ended (status code name)."""

    def unexpected(self) -> dict[str, int]:
        return {k: v for k, v in self.ended.items() if k not in EXPECTED_CODES}


async def _one(stub: pb_grpc.GenerationStub, rng: random.Random, result: StormResult) -> None:
    moment = rng.choice(MOMENTS)
    result.sent[moment] += 1
    max_tokens = rng.randint(3, 24)
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(8, 120))]
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), tenant=rng.choice("ab"),
                                            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                         timeout=120)
    stop_after = {"queued": 0, "prefilling": 0, "first_token": 1, "decoding": rng.randint(2, max_tokens - 1),
                  "finished": None}[moment]
    try:
        if moment == "queued":
            await asyncio.sleep(0)
            call.cancel()
        elif moment == "prefilling":
            await asyncio.sleep(rng.uniform(0.0, 0.08))
            call.cancel()
        got = 0
        async for response in call:
            got += len(response.token_ids)
            if stop_after is not None and got >= stop_after:
                call.cancel()
                break
        code = await call.code()
        result.ended[code.name] += 1
    except asyncio.CancelledError:
        result.ended["CANCELLED"] += 1
    except grpc.aio.AioRpcError as e:
        result.ended[e.code().name] += 1


async def storm(target: str, num_requests: int, concurrency: int, seed: int) -> StormResult:
    """Sends `num_requests`, `concurrency` at a time, each cancelled at a random moment."""
    rng = random.Random(seed)
    result = StormResult()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        sem = asyncio.Semaphore(concurrency)

        async def bounded() -> None:
            async with sem:
                await _one(stub, rng, result)

        await asyncio.gather(*(bounded() for _ in range(num_requests)))
    return result


def storm_cluster(model_dir: str):  # type: ignore[no-untyped-def]
    """1 prefill + 2 decode workers and a router budget small enough that requests queue."""
    from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
    from router.admission import AdmissionConfig

    return ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20, kv_lease_s=5.0),
        num_prefill=1, num_decode=2, worker_num_cpus=0.5,
        router=RouterConfig(port=0, admission=AdmissionConfig(max_inflight_tokens=2048, max_queued_per_priority=64)))


def worker_pids(cluster) -> set[int]:  # type: ignore[no-untyped-def]
    return {int(w["pid"]) for w in cluster.workers() if w.get("pid")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="model directory (default: a tiny random checkpoint made here)")
    args = ap.parse_args()

    import tempfile

    from cluster.local import LocalCluster
    from engine.model.tiny_model import make_tiny_model
    from kvfabric.region import segments_of

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    cluster = LocalCluster(storm_cluster(model))
    cluster.start()
    try:
        pids = worker_pids(cluster)
        shm_before = segments_of(pids)
        started = time.perf_counter()
        result = asyncio.run(storm(cluster.address, args.num_requests, args.concurrency, args.seed))
        seconds = time.perf_counter() - started
        held: list[str] = []
        deadline = time.monotonic() + 30
        while (held := cluster.holdings()) and time.monotonic() < deadline:
            time.sleep(0.5)
        shm_grew = len(segments_of(pids) - shm_before)
    finally:
        cluster.stop()
    print(json.dumps({"bench": "abort_storm", "num_requests": args.num_requests, "concurrency": args.concurrency,
                      "seed": args.seed, "cluster": "1 prefill + 2 decode, tiny llama, CPU",
                      "sent_by_moment": dict(result.sent), "ended_by_status": dict(result.ended),
                      "seconds": round(seconds, 1), "held_after": held, "shm_segments_grew": shm_grew}))
    sys.exit(1 if held or shm_grew > 0 or result.unexpected() else 0)


if __name__ == "__main__":
    main()
