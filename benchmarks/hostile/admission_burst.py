"""A burst of long requests with no deadline over the router's token budget: when does each
refusal come, and how good are the admission wait estimates?

One local cluster (1 prefill + 1 decode, tiny llama by default, CPU; the router's queue
limit --max-queue-wait-s). --num-requests requests (random --prompt-tokens prompts,
--max-tokens answers, ignore_eos) are sent at once over gRPC (one asyncio client). Per request: OK, or refused
and how long after its arrival, and why: at arrival (the estimate, or a full queue), revised (queued, then refused at the
router tick where its revised forecast passed its limit), or at the limit (it waited the
whole limit out, on an estimate that said it would get in: should be none). From the
router's /metrics: the histogram of actual over estimated wait for the queued requests that
were admitted (p50/p90/p99 from its buckets, and the fractions at or below 0.7 and above 1.3).
One JSON line.

Before the burst, a history to estimate from, as a serving cluster has one: 4 requests
alone, then --warm-up-wave (16) at once, then a pause for the workers' heartbeats. The
burst's concurrency (about 57 here) is then past what was measured and the forecast
extrapolates; --warm-up-wave 64 measures it first. Also printed: the decode worker's
profile and online step model, and the router's scale on the profile before and after.

    ./dev python benchmarks/hostile/admission_burst.py [--num-requests 200] [--max-tokens 256]
    ./dev python benchmarks/hostile/admission_burst.py --max-queue-wait-s 5     # some must be refused
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from control.reader import RegistryReader
from engine.model.tiny_model import make_tiny_model
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.admission import AdmissionConfig
from router.policy import RoutingConfig

HISTORY_S = 1.5
"""After the warm-up, before the burst: what the workers measured reaches the router (their
heartbeats come every 0.5 s), as it has in a cluster that has served a while."""


async def one(channel: grpc.aio.Channel, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    try:
        async for _ in pb_grpc.GenerationStub(channel).Generate(request, timeout=600):
            pass
        return {"code": "OK", "after_s": time.perf_counter() - sent}
    except grpc.RpcError as e:
        details = e.details() or ""
        kind = ("revised" if "revised queue wait" in details else "at_limit" if "for admission" in details
                else "at_arrival" if "estimated queue wait" in details or "full" in details else "other")
        return {"code": e.code().name, "after_s": time.perf_counter() - sent, "kind": kind, "details": details}


def at_once(address: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Sends every prompt at once and waits for all: one asyncio loop over one channel (200
    client threads, as this script had, took about a core of the two the cluster runs on, at
    a cost per streamed token that a burst grows and the warm-up did not show)."""
    async def run() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(address) as channel:
            return list(await asyncio.gather(*(one(channel, p, max_tokens) for p in prompts)))
    return asyncio.run(run())


def ratio_quantiles(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets, count = [], 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "splitserve:admission_wait_estimate_ratio_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == "splitserve:admission_wait_estimate_ratio_count":
                count = s.value
    buckets.sort()

    def q(p: float) -> float | None:
        return next((le for le, n in buckets if n >= p * count), None) if count else None
    at = dict(buckets)
    return {"num_estimated": int(count), "ratio_p50_le": q(0.5), "ratio_p90_le": q(0.9), "ratio_p99_le": q(0.99),
            "frac_le_0_7": round(at[0.7] / count, 3) if count else None,
            "frac_over_1_3": round(1 - at[1.3] / count, 3) if count else None,
            "ratio_buckets": {str(le): int(n) for le, n in buckets}}


def step_times(redis_url: str, namespace: str) -> dict[str, Any]:
    """The decode worker's start-up profile ("requests x mean context": milliseconds) and the
    step model it fitted online on the steps it served (a, b per request, c per KV token)."""
    async def read() -> dict[str, Any]:
        reader = RegistryReader(redis_url, namespace)
        try:
            beats = await reader.heartbeats()
        finally:
            await reader.close()
        hb = next(hb for hb in beats.values() if hb.role == "decode")
        return {"decode_step_profile_ms": {f"{n:.0f}x{kv / n:.0f}": round(s * 1e3, 3)
                                           for n, kv, s in zip(*[iter(hb.step_profile)] * 3)},
                "decode_step_online": [float(f"{x:.4g}") for x in hb.step_model]}
    return asyncio.run(read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-queue-wait-s", type=float, default=30.0)
    ap.add_argument("--admission-charge", choices=("expected", "max"), default="expected",
                    help="what admission charges for a request's output (AdmissionConfig.charge_output)")
    ap.add_argument("--kv-cache-mib", type=int, default=16)
    ap.add_argument("--warm-up-wave", type=int, default=16, help="requests sent at once before the burst (0: none)")
    args = ap.parse_args()
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=args.kv_cache_mib * 2**20),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated"),
                            admission=AdmissionConfig(max_queue_wait_s=args.max_queue_wait_s,
                                                      charge_output=args.admission_charge)))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_tokens)] for _ in range(args.num_requests)]
    with LocalCluster(config) as cluster:
        # warm-up: a history to estimate with, as a serving cluster has: a few requests alone,
        # then --warm-up-wave at once (other prompts, shorter answers than the burst's)
        for p in prompts[:4]:
            at_once(cluster.address, [[t + 1 for t in p]], 32)
        at_once(cluster.address, [[t + 2 for t in p] for p in prompts[:args.warm_up_wave]], 32)
        time.sleep(HISTORY_S)
        scale_before = cluster.router_stats()[0]["forecast_scale"]
        online_before = step_times(cluster.redis_url, config.namespace)["decode_step_online"]
        started = time.perf_counter()
        results = at_once(cluster.address, prompts, args.max_tokens)
        elapsed = time.perf_counter() - started
        scales = {"decode_step_online_before": online_before, "forecast_scale_before": scale_before, "forecast_scale_after": cluster.router_stats()[0]["forecast_scale"]}
        metrics = ratio_quantiles(cluster.router_stats()[0]["metrics_address"])
        steps = step_times(cluster.redis_url, config.namespace)
    refused = [r for r in results if r["code"] != "OK"]
    by_kind: dict[str, list[float]] = {}
    for r in refused:
        by_kind.setdefault(r["kind"], []).append(r["after_s"])
    print(json.dumps({
        "bench": "admission_burst", "num_ok": len(results) - len(refused), "num_refused": len(refused),
        "refused": {k: {"n": len(v), "max_after_s": round(max(v), 2), "p50_after_s": round(sorted(v)[len(v) // 2], 2)}
                    for k, v in sorted(by_kind.items())},
        "other": sorted({r["details"] for r in refused if r["kind"] == "other"})[:3],
        "elapsed_s": round(elapsed, 1), **metrics, **scales, **steps, **vars(args)}), flush=True)


if __name__ == "__main__":
    main()
