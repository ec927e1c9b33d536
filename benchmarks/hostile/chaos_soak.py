"""Chaos soak: steady load on a local cluster while its parts fail, one every --chaos-every-s:
  kill9      a prefill or decode worker's process is killed -9 (the controller replaces it)
  sigstop    a worker is stopped (SIGSTOP) past its KV lease and heartbeat TTL, then continued
  redis      the embedded redis-server is killed -9 (the cluster starts it again)
  tcp_reset  a prefill worker's TCP connections (KV pushes forced to tcp, gRPC) are reset (ss -K)
  kill9_controller  the controller's process is killed -9 (Ray restarts it; it adopts the pools)
  kill9_router      one of the two router replicas is killed -9 (the controller replaces it)

Every request is greedy over a fixed set of prompts whose tokens the monolithic engine
computed first. A request must end with exactly those tokens, or with a status that says
why; none may hang past its deadline; afterwards nothing is held and the pools are back
at their size. Requests in flight on a killed router end UNAVAILABLE: they are counted apart
(cut_by_router_kill, with the slowest end after the kill), not as failures; the load's
clients spread over both replicas (several connections to the shared port) and wait for a
connection (gRPC wait_for_ready) as a client of a replicated service does. After each event
the time until the cluster is at full strength again is measured (2 + 2 workers serving, 2
routers, the controller answering). One JSON line: sent, identical, failed by status,
corrupted (OK but other tokens: must be 0), hung (must be 0), leaked (must be []),
retries, chaos events with their recovery times, pools.

    ./dev python benchmarks/hostile/chaos_soak.py                      # 10 minutes at 3 requests/s
    ./dev python benchmarks/hostile/chaos_soak.py --minutes 3 --rate 2
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

from cluster.daemon import alive
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

MAX_TOKENS = 16
DEADLINE_S = 60.0
LEASE_S = 2.0
EVENTS = ("kill9_prefill", "kill9_controller", "kill9_decode", "sigstop", "kill9_router", "redis", "tcp_reset")
CHANNELS = 4
"""Client connections to the routers' shared port (the kernel spreads them over the replicas)."""
CUT_WITHIN_S = 1.0


def references(model_dir: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy tokens of the monolithic engine) pairs."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.core.request import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 200))] for _ in range(n)]
    engine = LLMEngine(EngineConfig(model_dir=model_dir, cache=CacheConfig(block_size=16, num_blocks=1024)))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]


class Tally:
    def __init__(self) -> None:
        self.c: Counter = Counter()
        self.router_kills: list[float] = []
        """When each kill9_router happened (monotonic)."""
        self.slowest_cut_s = 0.0

    async def one(self, stub: pb_grpc.GenerationStub, prompt: list[int], want: list[int]) -> None:
        self.c["sent"] += 1
        started = time.monotonic()
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=DEADLINE_S, wait_for_ready=True)

        async def read() -> list[int]:
            return [t async for r in call for t in r.token_ids]
        try:
            got = await asyncio.wait_for(read(), DEADLINE_S + 15)
        except TimeoutError:
            self.c["hung"] += 1
            call.cancel()
            return
        except grpc.aio.AioRpcError as e:
            now = time.monotonic()
            cut = [now - k for k in self.router_kills if started < k <= now]
            if e.code() == grpc.StatusCode.UNAVAILABLE and cut and min(cut) <= CUT_WITHIN_S:
                self.c["cut_by_router_kill"] += 1
                self.slowest_cut_s = max(self.slowest_cut_s, min(cut))
            else:
                self.c[f"failed_{e.code().name}"] += 1
            return
        self.c["identical" if got == want else "corrupted"] += 1


async def load(target: str, refs: list[tuple[list[int], list[int]]], rate: float, seconds: float,
               tally: Tally) -> None:
    rng = random.Random(1)
    # distinct channel args: separate connections, which the kernel spreads over the replicas
    channels = [grpc.aio.insecure_channel(target, options=[("splitserve.soak_channel", i)]) for i in range(CHANNELS)]
    try:
        stubs = [pb_grpc.GenerationStub(c) for c in channels]
        tasks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            prompt, want = rng.choice(refs)
            tasks.append(asyncio.create_task(tally.one(rng.choice(stubs), prompt, want)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    finally:
        for c in channels:
            await c.close()


def chaos(cluster, every_s: float, stop: threading.Event, log: list[dict], tally: Tally) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2)
    n = 0
    while not stop.wait(every_s):
        event = EVENTS[n % len(EVENTS)]
        n += 1
        if not full_strength(cluster):
            log.append({"at": time.strftime("%H:%M:%S"), "event": event, "skipped": "not at full strength"})
            continue
        serving = [w for w in cluster.workers() if w["state"] == "serving" and w.get("pid")]
        at = time.monotonic()
        try:
            what = apply(event, cluster, serving, rng, tally)
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            log.append({"at": time.strftime("%H:%M:%S"), "event": event, "failed_to_apply": str(e)})
            continue
        deadline = at + 120.0
        while not stop.is_set() and not full_strength(cluster) and time.monotonic() < deadline:
            time.sleep(0.25)
        back = full_strength(cluster)
        log.append({"at": time.strftime("%H:%M:%S"), "event": event, "what": what,
                    "full_strength_after_s": round(time.monotonic() - at, 2) if back else None})


def full_strength(cluster) -> bool:  # type: ignore[no-untyped-def]
    """2 prefill + 2 decode workers serving and 2 routers, each process alive (a killed one is
    not counted until the controller replaced it), the controller answering, Redis up."""
    import ray

    try:
        workers = [w for w in cluster.workers() if w["state"] == "serving" and alive(w["pid"])]
        routers = [r for r in cluster.router_stats() if alive(int(r["pid"]))]
    except (ray.exceptions.RayError, TimeoutError):
        return False
    roles = Counter(w["role"] for w in workers)
    return roles["prefill"] == 2 and roles["decode"] == 2 and len(routers) == 2 and cluster.redis.alive()


def apply(event: str, cluster, serving: list[dict], rng: random.Random, tally: Tally) -> str:  # type: ignore[no-untyped-def]
    if event == "kill9_controller":
        pid = cluster.controller_pid()
        os.kill(pid, signal.SIGKILL)
        return f"controller {pid}"
    if event == "kill9_router":
        router = rng.choice(cluster.router_stats())
        os.kill(int(router["pid"]), signal.SIGKILL)
        tally.router_kills.append(time.monotonic())
        return f"{router['router_id']} {router['pid']}"
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
    from engine.model.tiny_model import make_tiny_model

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    refs = references(model, 40, seed=0)
    cluster = LocalCluster(ClusterConfig(
        worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=8 * 2**20, kv_lease_s=LEASE_S,
                            kv_transport="tcp"),
        num_prefill=2, num_decode=2, num_routers=2, worker_num_cpus=0.25, replace_dead_workers=True,
        controller_max_restarts=1000,
        router=RouterConfig(port=0, worker_down_s=5.0, decode_idle_timeout_s=10.0, prefill_timeout_s=20.0)))
    cluster.start()
    tally, log, stop = Tally(), [], threading.Event()
    chaos_thread = threading.Thread(target=chaos, args=(cluster, args.chaos_every_s, stop, log, tally), daemon=True)
    started = time.monotonic()
    try:
        chaos_thread.start()
        asyncio.run(load(cluster.address, refs, args.rate, args.minutes * 60, tally))
        stop.set()
        chaos_thread.join(timeout=30)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the pools come back to size, then nothing is held
            if full_strength(cluster) and not cluster.holdings():
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
                      "chaos_every_s": args.chaos_every_s, "cluster": "2 prefill + 2 decode + 2 routers, kv over tcp, tiny llama, CPU",
                      "seconds": round(time.monotonic() - started), "sent": c["sent"], "identical": c["identical"],
                      "failed_by_status": failed, "cut_by_router_kill": c["cut_by_router_kill"],
                      "slowest_cut_s": round(tally.slowest_cut_s, 3), "corrupted": c["corrupted"], "hung": c["hung"], "leaked": held,
                      "retries": sum(int(s["num_retries"]) for s in stats), "pools_after": pools,
                      "replaced": len(status.get("dead", [])), "redis_restarts": cluster.num_redis_restarts,
                      "worst_full_strength_after_s": max((e.get("full_strength_after_s") or 0 for e in log),
                                                         default=0),
                      "never_back": [e for e in log if "what" in e and e["full_strength_after_s"] is None],
                      "chaos": log}))
    ok = not c["corrupted"] and not c["hung"] and not held and not failed
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
