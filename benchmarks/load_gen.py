"""Load generator over gRPC: one JSON line with TTFT / ITL / end-to-end percentiles, throughput, prefix hit rate.

Workloads (token-id prompts, so any model works):
  synthetic: --prompt-len / --output-len means (uniform +-50%), --shared-prefix-fraction of
             requests start with one of --num-prefixes shared prefixes of --prefix-len tokens
  trace:     --trace benchmarks/traces/mooncake_synthetic_trace.jsonl; each 512-token hash block
             becomes --trace-block-tokens tokens (same hash id -> same tokens: shared prefixes
             stay shared), output lengths scaled the same way (at least 1)
Arrivals: Poisson at --rate requests/s, or closed loop with --concurrency clients.

  ./dev python benchmarks/load_gen.py --target 127.0.0.1:50051 --rate 4 --num-requests 100
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

TRACE_BLOCK_TOKENS_ORIG = 512


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    max_tokens: int
    at_s: float | None = None
    """Arrival offset (trace replay); None: from --rate / --concurrency."""


@dataclass
class Outcome:
    ok: bool
    code: str = "OK"
    ttft_s: float = 0.0
    itls_s: tuple[float, ...] = ()
    e2e_s: float = 0.0
    num_prompt: int = 0
    num_cached: int = 0
    num_out: int = 0
    transfer_s: float = 0.0
    """First token sent to the KV landing on the decode worker (its Timing), 0 for local prefill."""
    route: str = ""
    """decode worker, then `<-prefill worker` or `local`."""
    sent_s: float = 0.0
    """When it was sent, from the start of the run."""


def synthetic(n: int, prompt_len: int, output_len: int, shared_fraction: float, num_prefixes: int,
              prefix_len: int, vocab: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    items = []
    for _ in range(n):
        plen = max(1, int(prompt_len * rng.uniform(0.5, 1.5)))
        head = rng.choice(prefixes) if prefixes and rng.random() < shared_fraction else []
        tail = [rng.randrange(3, vocab) for _ in range(max(plen - len(head), 1))]
        items.append(Item(head + tail, max(1, int(output_len * rng.uniform(0.5, 1.5)))))
    return items


def from_trace(path: Path, limit: int, block_tokens: int, max_prompt_tokens: int, vocab: int, time_scale: float) -> list[Item]:
    scale = block_tokens / TRACE_BLOCK_TOKENS_ORIG
    items = []
    for line in path.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        prompt: list[int] = []
        for h in rec["hash_ids"]:
            r = random.Random(h)
            prompt += [r.randrange(3, vocab) for _ in range(block_tokens)]
        prompt = prompt[:max(1, min(int(rec["input_length"] * scale), max_prompt_tokens))]
        items.append(Item(prompt, max(1, int(rec["output_length"] * scale)), rec["timestamp"] / 1000 * time_scale))
    return items


async def one(stub: pb_grpc.GenerationStub, item: Item, timeout_s: float) -> Outcome:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=item.prompt),
                             sampling=pb.SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
    start = time.perf_counter()
    stamps: list[float] = []
    final = None
    try:
        async for r in stub.Generate(req, timeout=timeout_s):
            now = time.perf_counter()
            stamps += [now] * len(r.token_ids)
            final = r
    except grpc.aio.AioRpcError as e:
        return Outcome(False, e.code().name)
    if not stamps or final is None:
        return Outcome(False, "EMPTY")
    itls = tuple(b - a for a, b in zip(stamps, stamps[1:]) if b > a)
    route = final.route.decode_worker + ("<-" + final.route.prefill_worker if final.route.prefill_worker else " local")
    return Outcome(True, "OK", stamps[0] - start, itls, stamps[-1] - start,
                   final.usage.prompt_tokens, final.usage.cached_tokens, final.usage.completion_tokens,
                   final.timing.transfer_ms / 1e3, route)


async def run_load(target: str, items: list[Item], rate: float | None, concurrency: int | None,
                   seed: int = 0, timeout_s: float = 300.0, per_request: Path | None = None) -> dict[str, object]:
    """Runs the workload; `per_request`: also write one JSON line per request there (in send order)."""
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        if concurrency:
            queue = list(reversed(items))
            outcomes: list[Outcome] = []

            async def client() -> None:
                while queue:
                    sent = time.perf_counter() - start
                    outcomes.append(dataclasses.replace(await one(stub, queue.pop(), timeout_s), sent_s=sent))
            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            tasks, t, sent_at = [], 0.0, []
            for item in items:
                if item.at_s is not None:
                    t = item.at_s
                elif rate:
                    t += rng.expovariate(rate)
                delay = start + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(stub, item, timeout_s)))
                sent_at.append(time.perf_counter() - start)
            outcomes = [dataclasses.replace(o, sent_s=s) for o, s in zip(await asyncio.gather(*tasks), sent_at, strict=True)]
        elapsed = time.perf_counter() - start
    if per_request is not None:
        with per_request.open("w") as f:
            for o in sorted(outcomes, key=lambda o: o.sent_s):
                f.write(json.dumps({"sent_s": round(o.sent_s, 3), "code": o.code, "route": o.route,
                                    "prompt": o.num_prompt, "cached": o.num_cached, "out": o.num_out,
                                    "ttft_ms": round(o.ttft_s * 1e3, 1), "e2e_ms": round(o.e2e_s * 1e3, 1),
                                    "itl_max_ms": round(max(o.itls_s, default=0.0) * 1e3, 1)}) + "\n")
    return summarize(outcomes, elapsed)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def summarize(outcomes: list[Outcome], elapsed_s: float) -> dict[str, object]:
    ok = [o for o in outcomes if o.ok]
    ms = lambda xs, q: round(pct(xs, q) * 1e3, 2)  # noqa: E731
    ttft, e2e = [o.ttft_s for o in ok], [o.e2e_s for o in ok]
    itl = [x for o in ok for x in o.itls_s]
    prompt = sum(o.num_prompt for o in ok)
    return {
        "num_requests": len(outcomes), "num_ok": len(ok),
        "errors": dict(Counter(o.code for o in outcomes if not o.ok)),
        "elapsed_s": round(elapsed_s, 3),
        **{f"ttft_p{q}_ms": ms(ttft, q) for q in (50, 95, 99)},
        **{f"itl_p{q}_ms": ms(itl, q) for q in (50, 95, 99)},
        "itl_max_ms": round(max(itl, default=float("nan")) * 1e3, 2),
        **{f"e2e_p{q}_ms": ms(e2e, q) for q in (50, 95, 99)},
        "transfer_p50_ms": ms([o.transfer_s for o in ok if o.transfer_s > 0], 50),  # remote prefills only
        "output_tokens_per_s": round(sum(o.num_out for o in ok) / elapsed_s, 2),
        "requests_per_s": round(len(ok) / elapsed_s, 3),
        "prefix_hit_rate": round(sum(o.num_cached for o in ok) / prompt, 4) if prompt else 0.0,
    }


def build_items(args: argparse.Namespace) -> list[Item]:
    if args.trace:
        return from_trace(Path(args.trace), args.num_requests, args.trace_block_tokens, args.max_prompt_tokens,
                          args.vocab, args.trace_time_scale)
    return synthetic(args.num_requests, args.prompt_len, args.output_len, args.shared_prefix_fraction,
                     args.num_prefixes, args.prefix_len, args.vocab, args.seed)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=96)
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL to replay instead")
    p.add_argument("--trace-block-tokens", type=int, default=16)
    p.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies the trace's arrival times")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512, help="token ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--per-request", type=Path, default=None, help="also write one JSON line per request here")
    add_workload_args(parser)
    args = parser.parse_args()
    if not args.rate and not args.concurrency and not args.trace:
        args.concurrency = 8
    result = asyncio.run(run_load(args.target, build_items(args), args.rate, args.concurrency, args.seed,
                                  per_request=args.per_request))
    print(json.dumps({"benchmark": "load_gen", "config": vars(args), "results": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
