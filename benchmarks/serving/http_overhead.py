"""What the OpenAI HTTP front costs against gRPC, on one cluster in one run.

One local cluster as `serve` starts it (1 prefill + 1 decode, the default model,
SmolLM2-135M-Instruct from its GGUF file, CPU). The same workload (`loadgen.workload`,
token-id prompts, ignore_eos) goes to the router's gRPC `Generate` and to its
`/v1/completions` (streamed, `return_token_ids` so the client counts tokens per chunk) in
alternating rounds, each round with fresh prompts (no arm hits the other's prefix cache).
Two phases: latency (one request at a time, the doors alternating request by request: the
median of the paired TTFT differences is the protocol's added latency) and throughput (a
closed loop of --concurrency clients per door, the doors alternating by round). Every prompt has exactly --prompt-len tokens
and every answer --output-len, so the arms differ only in the protocol. The router's own CPU
time per request (/proc/PID/stat) is measured over each round, less what it spends idle
(heartbeat reads, stats, timers: measured for 5 s before the rounds). Prints one JSON line per round and arm, then
the pooled means and the ratios HTTP / gRPC. Targets: TTFT p50 within +2 ms, throughput
>= 0.95x, router CPU per request <= 1.3x.

    ./dev python benchmarks/serving/http_overhead.py [--rounds 3] [--num-requests 48] [--concurrency 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from loadgen import report, runner
from loadgen.runner import Outcome, run
from loadgen.workload import WorkloadRequest, synthetic
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.default_model import model_path
from cluster.local import LocalCluster
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig

ARMS = ("grpc", "http")


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def items_of(n: int, args: argparse.Namespace, seed: int) -> list[WorkloadRequest]:
    """n prompts of exactly --prompt-len random tokens, each asking for exactly --output-len."""
    rng = random.Random(seed)
    return [WorkloadRequest([rng.randrange(3, 49152) for _ in range(args.prompt_len)], args.output_len)
            for _ in range(n)]


def idle_cpu_per_s(pid: int, seconds: float = 5.0) -> float:
    """The router's CPU per second with no request (its heartbeat reads, stats, timers)."""
    cpu = process_cpu_s(pid)
    time.sleep(seconds)
    return (process_cpu_s(pid) - cpu) / seconds


def throughput(cluster: LocalCluster, arm: str, seed: int, idle: float, args: argparse.Namespace) -> dict[str, Any]:
    """A closed loop of --concurrency clients over one door."""
    target = cluster.address if arm == "grpc" else f"http://{cluster.info['http_address']}"
    router_pid = int(cluster.router_stats()[0]["pid"])
    cpu = process_cpu_s(router_pid)
    result = asyncio.run(run(target, items_of(args.num_requests, args, seed), concurrency=args.concurrency))
    cpu = process_cpu_s(router_pid) - cpu - idle * result.elapsed_s  # what the requests cost, less the idle loops
    s = report.summarize(result, 2.0, 0.1)
    return {"requests_per_s": s["requests_per_s"], "output_tokens_per_s": s["output_tokens_per_s"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"], "itl_p50_ms": s["itl_ms"]["p50"],
            "router_cpu_ms_per_request": round(cpu * 1e3 / max(s["num_ok"], 1), 3), "num_ok": s["num_ok"],
            "num_failed": s["num_failed"]}


def latency(cluster: LocalCluster, seed: int, idle: float, args: argparse.Namespace) -> dict[str, Any]:
    """One request at a time over a connection kept open per door, the doors alternating
    request by request (which goes first alternates too), so slow drift of the machine falls
    on both alike: per-door TTFT p50, the median of the paired TTFT differences, and the
    router's CPU per request."""
    router_pid = int(cluster.router_stats()[0]["pid"])
    items = items_of(2 * args.num_requests, args, seed)
    ttft: dict[str, list[float]] = {"grpc": [], "http": []}
    cpu = {"grpc": 0.0, "http": 0.0}

    async def go() -> None:
        url = f"http://{cluster.info['http_address']}/v1/completions"
        async with grpc.aio.insecure_channel(cluster.address) as channel, aiohttp.ClientSession() as session:
            stub = pb_grpc.GenerationStub(channel)
            for i in range(args.num_requests):
                for j, arm in enumerate(ARMS if i % 2 == 0 else ARMS[::-1]):
                    before, start = process_cpu_s(router_pid), time.perf_counter()
                    out = Outcome()
                    if arm == "grpc":
                        await runner.one_grpc(stub, items[2 * i + j], 120.0, start, out)
                    else:
                        await runner.one_http(session, url, items[2 * i + j], 120.0, start, out)
                    cpu[arm] += process_cpu_s(router_pid) - before - idle * (time.perf_counter() - start)
                    if not out.ok or out.ttft_s is None:
                        raise RuntimeError(f"{arm}: {out.code} {out.details}")
                    ttft[arm].append(out.ttft_s * 1e3)
    asyncio.run(go())
    deltas = [h - g for h, g in zip(ttft["http"], ttft["grpc"], strict=True)]
    return {**{f"ttft_p50_ms_{arm}": round(statistics.median(v), 2) for arm, v in ttft.items()},
            "ttft_paired_delta_p50_ms": round(statistics.median(deltas), 2),
            **{f"router_cpu_ms_per_request_{arm}": round(c * 1e3 / args.num_requests, 3) for arm, c in cpu.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48, help="per door and phase in each round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = model_path(None)
    config = ClusterConfig(worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=256 * 2**20),
                           num_prefill=1, num_decode=1,
                           router=RouterConfig(port=0, http_port=0, tokenizer_dir=str(resolve_model_dir(model)),
                                               routing=RoutingConfig(mode="auto")))
    conf = vars(args) | {"cluster": "1 prefill + 1 decode, SmolLM2-135M-Instruct Q4_1 GGUF as float32, CPU",
                         "cpus": os.cpu_count()}
    pooled: dict[str, list[dict[str, Any]]] = {}
    lats: list[dict[str, Any]] = []
    with LocalCluster(config) as cluster:
        asyncio.run(run(cluster.address, synthetic(8, args.prompt_len, 8, 0.0, 0, 0, 49152, 99), concurrency=4))
        asyncio.run(run(f"http://{cluster.info['http_address']}", synthetic(8, args.prompt_len, 8, 0.0, 0, 0, 49152, 98),
                        concurrency=4))  # warm-up, both doors
        idle = idle_cpu_per_s(int(cluster.router_stats()[0]["pid"]))
        for r in range(args.rounds):
            lat = latency(cluster, 1000 * r, idle, args)
            lats.append(lat)
            print(json.dumps({"bench": "http_overhead", "round": r, "phase": "latency", **lat, **conf}), flush=True)
            for i, arm in enumerate(ARMS if r % 2 == 0 else ARMS[::-1]):
                s = throughput(cluster, arm, 1000 * r + 500 + i, idle, args)
                pooled.setdefault(arm, []).append(s)
                print(json.dumps({"bench": "http_overhead", "round": r, "phase": "throughput", "arm": arm, **s, **conf}),
                      flush=True)
    mean = {arm: {k: round(statistics.mean(s[k] for s in runs), 3) for k in
                  ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "router_cpu_ms_per_request")}
            for arm, runs in pooled.items()}
    lat_mean = {k: round(statistics.mean(x[k] for x in lats), 3) for k in lats[0]}
    print(json.dumps({"bench": "http_overhead", "latency": lat_mean, "throughput": mean, "http_vs_grpc": {
        "ttft_p50_delta_ms": lat_mean["ttft_paired_delta_p50_ms"],
        "throughput_ratio": round(mean["http"]["requests_per_s"] / mean["grpc"]["requests_per_s"], 4),
        "router_cpu_ratio_throughput": round(mean["http"]["router_cpu_ms_per_request"]
                                             / mean["grpc"]["router_cpu_ms_per_request"], 4),
        "router_cpu_ratio_latency": round(lat_mean["router_cpu_ms_per_request_http"]
                                          / lat_mean["router_cpu_ms_per_request_grpc"], 4)},
        "router_idle_cpu_ms_per_s": round(idle * 1e3, 2), **conf}), flush=True)


if __name__ == "__main__":
    main()
