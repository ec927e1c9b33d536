"""Chaos soak: steady load on a local cluster while its parts fail, one every --chaos-every-s:
  kill9      a prefill or decode worker's process is killed -9 (the controller replaces it)
  sigstop    a worker is stopped (SIGSTOP) past its KV lease and heartbeat TTL, then continued
  redis      the embedded redis-server is killed -9 (the cluster starts it again)
  tcp_reset  a prefill worker's TCP connections (KV pushes forced to tcp, gRPC) are reset (ss -K)

Every request is greedy over a fixed set of prompts whose tokens the monolithic engine
computed first. A request must end with exactly those tokens, or with a status that says
why; none may hang past its deadline; afterwards nothing is held and the pools are back
at their size. One JSON line: sent, identical, failed by status, corrupted (OK but other
tokens: must be 0), hung (must be 0), leaked (must be []), retries, chaos events, pools.

    ./dev python benchmarks/chaos_soak.py                      # 10 minutes at 3 requests/s
    ./dev python benchmarks/chaos_soak.py --minutes 3 --rate 2
Needs root for `ss -K` (tcp_reset is skipped otherwise).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

MAX_TOKENS = 16
DEADLINE_S = 60.0
LEASE_S = 2.0
EVENTS = ("kill9_prefill", "kill9_decode", "sigstop", "redis", "tcp_reset")


def references(model_dir: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy tokens of the monolithic engine) pairs."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 200))] for _ in range(n)]
    engine = LLMEngine(EngineConfig(model_dir=model_dir, cache=CacheConfig(block_size=16, num_blocks=1024)))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]


class Tally:
    def __init__(self) -> None:
        self.c: Counter = Counter()

    async def one(self, stub: pb_grpc.GenerationStub, prompt: list[int], want: list[int]) -> None:
        self.c["sent"] += 1
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=DEADLINE_S)

        async def read() -> list[int]:
            return [t async for r in call for t in r.token_ids]
        try:
            got = await asyncio.wait_for(read(), DEADLINE_S + 15)
        except TimeoutError:
            self.c["hung"] += 1
            call.cancel()
            return
        except grpc.aio.AioRpcError as e:
            self.c[f"failed_{e.code().name}"] += 1
            return
        self.c["identical" if got == want else "corrupted"] += 1


async def load(target: str, refs: list[tuple[list[int], list[int]]], rate: float, seconds: float,
               tally: Tally) -> None:
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            prompt, want = rng.choice(refs)
            tasks.append(asyncio.create_task(tally.one(stub, prompt, want)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def chaos(cluster, every_s: float, stop: threading.Event, log: list[str]) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2)
    n = 0
    while not stop.wait(every_s):
        event = EVENTS[n % len(EVENTS)]
        n += 1
        serving = [w for w in cluster.workers() if w["state"] == "serving" and w.get("pid")]
        try:
            log.append(f"{time.strftime('%H:%M:%S')} {event}: {apply(event, cluster, serving, rng)}")
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            log.append(f"{time.strftime('%H:%M:%S')} {event}: failed to apply: {e}")


def apply(event: str, cluster, serving: list[dict], rng: random.Random) -> str:  # type: ignore[no-untyped-def]
    if event.startswith("kill9"):
        w = rng.choice([w for w in serving if w["role"] == event.split("_")[1]])
        os.kill(w["pid"], signal.SIGKILL)
        return w["worker_id"]
    if event == "sigstop":
        w = rng.choice(serving)
        os.kill(w["pid"], signal.SIGSTOP)
        time.sleep(LEASE_S + 4.0)  # past the KV lease and the heartbeat TTL
        os.kill(w["pid"], signal.SIGCONT)
        return w["worker_id"]
    if event == "redis":
        os.kill(cluster.redis.pid, signal.SIGKILL)
        return f"redis-server {cluster.redis.pid}"
    w = rng.choice([w for w in serving if w["role"] == "prefill"])
    lines = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    mine = [line.split() for line in lines if f"pid={w['pid']}," in line]
    for cols in mine:
        local, peer = cols[2], cols[3]
        subprocess.run(["ss", "-K", "src", local.rsplit(":", 1)[0], "sport", "=", ":" + local.rsplit(":", 1)[1],
                        "dst", peer.rsplit(":", 1)[0], "dport", "=", ":" + peer.rsplit(":", 1)[1]],
                       capture_output=True, check=False)
    return f"{w['worker_id']}: {len(mine)} connections reset"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--chaos-every-s", type=float, default=15.0)
    ap.add_argument("--model", help="model directory (default: a tiny random checkpoint made here)")
    args = ap.parse_args()

    from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
    from cluster.local import LocalCluster
    from engine.tiny_model import make_tiny_model

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    refs = references(model, 40, seed=0)
    cluster = LocalCluster(ClusterConfig(
        worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=8 * 2**20, kv_lease_s=LEASE_S,
                            kv_transport="tcp"),
        num_prefill=2, num_decode=2, worker_num_cpus=0.25, replace_dead_workers=True,
        router=RouterConfig(port=0, worker_down_s=5.0, decode_idle_timeout_s=10.0, prefill_timeout_s=20.0)))
    cluster.start()
    tally, log, stop = Tally(), [], threading.Event()
    chaos_thread = threading.Thread(target=chaos, args=(cluster, args.chaos_every_s, stop, log), daemon=True)
    started = time.monotonic()
    try:
        chaos_thread.start()
        asyncio.run(load(cluster.address, refs, args.rate, args.minutes * 60, tally))
        stop.set()
        chaos_thread.join(timeout=30)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the pools come back to size, then nothing is held
            roles = Counter(w["role"] for w in cluster.workers() if w["state"] == "serving")
            if roles["prefill"] == 2 and roles["decode"] == 2 and not cluster.holdings():
                break
            time.sleep(1.0)
        held = cluster.holdings()
        stats = cluster.router_stats()
        pools = dict(Counter(w["role"] for w in cluster.workers() if w["state"] == "serving"))
        status = cluster.controller_status()
    finally:
        stop.set()
        cluster.stop()
    c = tally.c
    failed = {k[len("failed_"):]: v for k, v in c.items() if k.startswith("failed_")}
    print(json.dumps({"bench": "chaos_soak", "minutes": args.minutes, "rate_rps": args.rate,
                      "chaos_every_s": args.chaos_every_s, "cluster": "2 prefill + 2 decode, kv over tcp, tiny llama, CPU",
                      "seconds": round(time.monotonic() - started), "sent": c["sent"], "identical": c["identical"],
                      "failed_by_status": failed, "corrupted": c["corrupted"], "hung": c["hung"], "leaked": held,
                      "retries": sum(int(s["num_retries"]) for s in stats), "pools_after": pools,
                      "replaced": len(status.get("dead", [])), "redis_restarts": cluster.num_redis_restarts,
                      "chaos": log}))
    ok = not c["corrupted"] and not c["hung"] and not held
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
