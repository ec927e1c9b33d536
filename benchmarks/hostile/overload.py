"""Overload: goodput and refusal timing against offered load, with and without a flooding tenant.

On a local cluster (1 prefill + 2 decode workers, tiny model, CPU) whose router may queue a
request for at most --ttft-budget-s (`max_queue_wait_s`):
  1. calibrate: the sustainable rate, the completed requests per second of a closed loop;
  2. Poisson arrivals at each multiple of it in --loads for --seconds each. Per level: offered
     and completed rates, goodput (completed with TTFT within the budget), refusals and how
     fast they came back (p50/p99 ms; a refusal is decided at arrival, before any prefill
     work), TTFT p50/p99 of the admitted, the router's budget and resident memory (bounded:
     it must not grow with the offered load);
  3. tenants: B alone at --tenant-b-fraction of the sustainable rate, then A at 20x B's rate
     alongside it (sent from a process of its own, so that A's traffic does not delay the
     event loop timing B's): B's TTFT p99 both ways and their ratio, and how many of A's
     refusals name its fair share.
One JSON line per level and per tenant run, each with the config. Ratios, not absolute
times, are what carry from machine to machine.

    ./dev python benchmarks/hostile/overload.py
    ./dev python benchmarks/hostile/overload.py --loads 1 2 5 10 --seconds 20
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from loadgen.report import pct
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

OUTPUT_TOKENS = 8
FLOOD_START_S = 5.0
"""The flooding tenant's process starts (imports, connects) within this; both tenants then start together."""
"""Prefill-heavy requests (`--prompt-tokens`): the workers, not the client or the router's event
loop, are what saturates. With 1024-token prompts the prefill worker here sustains about 26
requests/s, and at 10x that the Python client and the router's refusals (all on the same 2
cores) can no longer offer the load; 2000 tokens (the tiny model's context is 2048) keep the
workers the bottleneck."""


@dataclass
class Sent:
    tenant: str
    code: str = "OK"
    ttft_s: float | None = None
    end_s: float = 0.0
    details: str = ""
    queue_ms: float = 0.0
    """The router's own account (`Timing`): waiting for admission, then routing to first token."""
    prefill_ms: float = 0.0


async def one(stub: pb_grpc.GenerationStub, rng: random.Random, tenant: str, out: list[Sent], prompt_tokens: int) -> None:
    prompt = [3 + b for b in rng.randbytes(prompt_tokens)]  # random: no prefix-cache hits
    sent = Sent(tenant)
    out.append(sent)
    started = time.perf_counter()
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), tenant=tenant,
                                            sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)),
                         timeout=120)
    try:
        async for response in call:
            if sent.ttft_s is None and response.token_ids:
                sent.ttft_s = time.perf_counter() - started
            if response.HasField("timing"):
                sent.queue_ms, sent.prefill_ms = response.timing.queue_ms, response.timing.prefill_ms
    except grpc.aio.AioRpcError as e:
        sent.code, sent.details = e.code().name, e.details() or ""
    sent.end_s = time.perf_counter() - started


async def poisson(target: str, rates: dict[str, float], seconds: float, seed: int, prompt_tokens: int,
                  start_at: float | None = None) -> list[Sent]:
    """Open-loop Poisson arrivals per tenant for `seconds` (from wall-clock `start_at`, if given);
    waits for every request to end."""
    if start_at is not None:
        await asyncio.sleep(max(start_at - time.time(), 0.0))
    rng = random.Random(seed)
    out: list[Sent] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(tenant: str, rate: float) -> None:
            end = time.perf_counter() + seconds
            while (now := time.perf_counter()) < end:
                tasks.append(asyncio.create_task(one(stub, rng, tenant, out, prompt_tokens)))
                await asyncio.sleep(min(rng.expovariate(rate), max(end - now, 0)))

        await asyncio.gather(*(arrivals(t, r) for t, r in rates.items() if r > 0))
        await asyncio.gather(*tasks)
    return out


def flood_elsewhere(target: str, rates: dict[str, float], seconds: float, seed: int, prompt_tokens: int,
                    start_at: float) -> list[Sent]:
    """`poisson` in a process of its own (run there by a ProcessPoolExecutor): a flood's sending
    and receiving must not hold up the event loop that times the light tenant's requests."""
    return asyncio.run(poisson(target, rates, seconds, seed, prompt_tokens, start_at))


async def closed_loop(target: str, concurrency: int, seconds: float, prompt_tokens: int) -> float:
    """Completed requests per second with `concurrency` clients always waiting on one."""
    rng = random.Random(0)
    out: list[Sent] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        end = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < end:
                await one(stub, rng, "", out, prompt_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return sum(s.code == "OK" for s in out) / (time.perf_counter() - started)


def pct_ms(values: list[float], q: int) -> float | None:
    """loadgen/report.py's percentile (nearest rank, as every tool here reports), in ms."""
    x = pct(values, q)
    return None if x is None else round(x * 1e3, 1)


def summary(sent: list[Sent], seconds: float, budget_s: float) -> dict[str, object]:
    ok = [s for s in sent if s.code == "OK"]
    refused = [s for s in sent if s.code == "RESOURCE_EXHAUSTED"]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    codes: dict[str, int] = {}
    for s in sent:
        codes[s.code] = codes.get(s.code, 0) + 1
    return {"offered_rps": round(len(sent) / seconds, 2), "completed_rps": round(len(ok) / seconds, 2),
            "goodput_rps": round(sum(t <= budget_s for t in ttfts) / seconds, 2), "by_status": codes,
            "refusal_ms_p50": pct_ms([s.end_s for s in refused], 50), "refusal_ms_p99": pct_ms([s.end_s for s in refused], 99),
            "ttft_ms_p50": pct_ms(ttfts, 50), "ttft_ms_p99": pct_ms(ttfts, 99),
            "router_queue_ms_p50": pct_ms([s.queue_ms / 1e3 for s in ok], 50),
            "router_queue_ms_p99": pct_ms([s.queue_ms / 1e3 for s in ok], 99),
            "router_prefill_ms_p50": pct_ms([s.prefill_ms / 1e3 for s in ok], 50),
            "router_prefill_ms_p99": pct_ms([s.prefill_ms / 1e3 for s in ok], 99)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=float, nargs="*", default=[1, 2, 5, 10], help="multiples of the sustainable rate")
    ap.add_argument("--seconds", type=float, default=15.0, help="per load level")
    ap.add_argument("--ttft-budget-s", type=float, default=2.0, help="the router's TTFT budget (AdmissionConfig.ttft_budget_s)")
    ap.add_argument("--tenant-b-fraction", type=float, default=0.2)
    ap.add_argument("--admission-charge", choices=("expected", "max"), default="expected",
                    help="what admission charges for a request's output (AdmissionConfig.charge_output)")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="every request's (random) prompt")
    ap.add_argument("--chunk-tokens", type=int, default=2048,
                    help="max_num_batched_tokens of every worker: the prefill step, and so how long a more "
                         "important request can wait behind a less important one's chunk")
    ap.add_argument("--model", help="model directory (default: a tiny random checkpoint made here)")
    return ap.parse_args()


def load_levels(target: str, args: argparse.Namespace, sustainable: float, books: Callable[[], dict[str, Any]],
                config: dict[str, Any]) -> None:
    """Poisson arrivals at each multiple of the sustainable rate: one JSON line per level."""
    for i, load in enumerate(args.loads):
        sent = asyncio.run(poisson(target, {"": load * sustainable}, args.seconds, seed=i, prompt_tokens=args.prompt_tokens))
        s, router = summary(sent, args.seconds, args.ttft_budget_s), books()
        print(json.dumps({"bench": "overload", "phase": "load", "load_x": load, **s,
                          "goodput_vs_sustainable": round(s["goodput_rps"] / sustainable, 2),  # type: ignore[operator]
                          "router_refusals_so_far": router.get("refusals"),
                          "router_budget_tokens": router.get("budget_tokens"),
                          "router_rss_mib": router.get("rss_mib"), **config}), flush=True)


def tenants(target: str, args: argparse.Namespace, sustainable: float, config: dict[str, Any]) -> None:
    """B alone, then B with A flooding at 20x its rate from a process of its own: one JSON line."""
    b_rate = args.tenant_b_fraction * sustainable
    alone = asyncio.run(poisson(target, {"b": b_rate}, args.seconds, seed=100, prompt_tokens=args.prompt_tokens))
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        start_at = time.time() + FLOOD_START_S
        flood = pool.submit(flood_elsewhere, target, {"a": 20 * b_rate}, args.seconds, 101, args.prompt_tokens, start_at)
        b = asyncio.run(poisson(target, {"b": b_rate}, args.seconds, seed=102, prompt_tokens=args.prompt_tokens,
                                start_at=start_at))
        a = flood.result(timeout=args.seconds + 300)
    b_alone, b_flooded = (summary(x, args.seconds, args.ttft_budget_s) for x in (alone, b))
    a_refused = [s for s in a if s.code == "RESOURCE_EXHAUSTED"]
    ratio = (b_flooded["ttft_ms_p99"] / b_alone["ttft_ms_p99"]  # type: ignore[operator]
             if b_flooded["ttft_ms_p99"] and b_alone["ttft_ms_p99"] else None)
    print(json.dumps({"bench": "overload", "phase": "tenants", "b_rps": round(b_rate, 2),
                      "a_rps": round(20 * b_rate, 2), "b_alone": b_alone, "b_with_a": b_flooded,
                      "b_ttft_p99_ratio": round(ratio, 2) if ratio else None,
                      "a": summary(a, args.seconds, args.ttft_budget_s),
                      "a_refusals_naming_share": sum("share" in s.details for s in a_refused),
                      "a_refusals": len(a_refused),
                      "a_refusal_example": a_refused[0].details if a_refused else None,
                      "b_failures": sorted({s.details for s in b if s.code != "OK"})[:5], **config}), flush=True)


def main() -> None:
    args = parse_args()
    from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
    from cluster.local import LocalCluster
    from engine.model.tiny_model import make_tiny_model
    from router.admission import AdmissionConfig

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    admission = AdmissionConfig(ttft_budget_s=args.ttft_budget_s, charge_output=args.admission_charge)
    cluster = LocalCluster(ClusterConfig(
        worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=8 * 2**20,
                            max_num_batched_tokens=args.chunk_tokens),
        num_prefill=1, num_decode=2, worker_num_cpus=0.5, router=RouterConfig(port=0, admission=admission)))
    cluster.start()
    config = {"cluster": "1 prefill + 2 decode, tiny llama, CPU", "prompt_tokens": args.prompt_tokens,
              "output_tokens": OUTPUT_TOKENS, "chunk_tokens": args.chunk_tokens, "ttft_budget_s": args.ttft_budget_s,
              "seconds": args.seconds, "kv_overcommit": admission.kv_overcommit,
              "admission_charge": admission.charge_output}
    try:
        sustainable = asyncio.run(closed_loop(cluster.address, 32, args.seconds, args.prompt_tokens))
        print(json.dumps({"bench": "overload", "phase": "calibrate", "sustainable_rps": round(sustainable, 2),
                          "router_rss_mib": cluster.router_stats()[0].get("rss_mib"), **config}), flush=True)
        load_levels(cluster.address, args, sustainable, lambda: cluster.router_stats()[0], config)
        tenants(cluster.address, args, sustainable, config)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
