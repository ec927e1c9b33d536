"""Multi-turn conversations replayed through a cluster with and without the shared KV tier:
pools small enough to evict a conversation between its turns, so without the tier each turn
prefills the whole conversation again; with it, the turn fetches what the node's store kept.

    ./dev python -m benchmarks.kv.kv_tier_trace [--size tiny|small|default] [--conversations 24] [--turns 5]
        [--pool-blocks 48] [--store-mib 64] [--concurrency 2] [--write-trace FILE]

The trace is Mooncake's format (`timestamp`, `input_length`, `output_length`, `hash_ids` of
512-token blocks), a synthetic conversation trace with its structure: each turn's blocks are
the previous turn's plus the new user message and the previous answer, the conversations
interleaved (a turn every few seconds of each); a few share a system prompt. Each 512-token
block becomes one 16-token block of the model (loadgen/workload.py `from_trace`), so the
prefix structure is kept exactly. The tiny model prefills a turn in about as long as a
fetch's round trips take; `--size small` (12 layers) is closer to what a fetch saves, and
`--size default` is the embedded default model (SmolLM2-135M-Instruct), whose prefill costs
what a real model's does.

One JSON line per arm (tier off, tier on): prompt tokens, tokens served from a cache (the
pool's or the store's), prefill tokens computed, TTFT p50 / p99, and with the tier the
store's fetched blocks and what each worker measured of fetching against computing (what
routers price its hits by); then the ratios of the tier arm to the arm without it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

BLOCK = 16


def conversation_trace(conversations: int, turns: int, seed: int = 0) -> list[dict]:
    """Mooncake-format records: `turns` turns of each conversation, interleaved by time."""
    rng = random.Random(seed)
    next_id = 0

    def blocks(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [blocks(4) for _ in range(3)]
    records = []
    for c in range(conversations):
        history = list(rng.choice(systems))
        t = rng.uniform(0, 20_000)
        for _ in range(turns):
            history += blocks(rng.randint(2, 5))  # the user's message (and the last answer, folded in)
            out = rng.randint(32, 96)
            records.append({"timestamp": int(t), "input_length": len(history) * 512 - rng.randint(0, 300),
                            "output_length": out, "hash_ids": list(history), "conversation": c})
            t += rng.uniform(4_000, 12_000)
    return sorted(records, key=lambda r: r["timestamp"])


def arm(model_dir: str, trace: Path, n: int, pool_blocks: int, store_mib: int, concurrency: int) -> dict:
    from loadgen.runner import run
    from loadgen.workload import from_trace
    from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
    from cluster.local import LocalCluster
    from router.policy import RoutingConfig
    from tests.integration.reference import make_engine

    block_bytes = make_engine(model_dir, block_size=BLOCK, num_blocks=8).layout.block_bytes
    items = [it for it in from_trace(trace, n, BLOCK, 4096, 500, 0.0)]
    items = [type(it)(it.prompt, min(it.max_tokens, 4), None) for it in items]  # prefill is what is measured
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=BLOCK, kv_cache_bytes=pool_blocks * block_bytes,
                            max_num_batched_tokens=512),
        num_prefill=0, num_decode=2, kv_store_mib=store_mib, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="colocated")))
    with LocalCluster(config) as cluster:
        result = asyncio.run(run(cluster.address, items, concurrency=concurrency))
        stores, speeds = [], {}
        if store_mib:
            from kvstore.host import read_stores

            stores = read_stores(cluster.redis_url, config.namespace)
            speeds = tier_speeds(cluster.redis_url, config.namespace, config.router.routing.store_fetch_cost)
    return {"bench": "kv_tier_trace", "tier": bool(store_mib), "requests": len(items),
            "pool_blocks": pool_blocks, "store_mib": store_mib, "concurrency": concurrency, **replay_row(result),
            "store_fetched_blocks": sum(s.get("num_fetched", 0) for s in stores),
            "store_evicted_blocks": sum(s.get("num_evicted", 0) for s in stores), "tier_speeds": speeds}


def tier_speeds(redis_url: str, namespace: str, prior: float) -> dict:
    """Each worker's measured fetch line (ms: fixed, per block) and time to compute a block
    (ms), as its last heartbeat gives them to routers, and the share a 10-block hit is priced
    at (router/policy.py; `prior`: the cluster's cost until a worker has measured both)."""
    from control.reader import read_cluster
    from router.policy import store_hit

    beats, _, _ = asyncio.run(read_cluster(redis_url, namespace))
    out = {}
    for w, hb in sorted(beats.items()):
        s = hb.tier_speed
        bs = hb.facts.block_size
        out[w] = {"fetch_ms": [round(x * 1e3, 3) for x in s.fetch],
                  "far_fetch_ms": [round(x * 1e3, 3) for x in s.far_fetch],
                  "block_compute_ms": round(s.token_s * bs * 1e3, 3),
                  "share_10_blocks": round(store_hit(10, s.fetch, s.token_s, bs, prior, "").fetch_cost, 3)}
    return out


def replay_row(result: Any) -> dict:
    """A replay's requests served, prompt tokens, those served from a cache, the hit rate, the
    prefill tokens computed, TTFT p50/p99 and the wall time (loadgen.runner's `Run`)."""
    from loadgen.report import pct

    ok = [o for o in result.outcomes if o.ok]
    prompt = sum(o.num_prompt for o in ok)
    cached = sum(o.num_cached for o in ok)
    ttfts = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    return {"ok": len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / max(prompt, 1), 3), "prefill_tokens": prompt - cached,
            "ttft_p50_ms": round(pct(ttfts, 50) or 0, 1), "ttft_p99_ms": round(pct(ttfts, 99) or 0, 1),
            "elapsed_s": round(result.elapsed_s, 1)}


def ratios(off: dict, on: dict) -> dict:
    """The tier arm over the arm without it."""
    return {"ratio": "tier/no tier", "prefill_tokens": round(on["prefill_tokens"] / max(off["prefill_tokens"], 1), 3),
            "ttft_p50": round(on["ttft_p50_ms"] / max(off["ttft_p50_ms"], 1e-9), 3),
            "ttft_p99": round(on["ttft_p99_ms"] / max(off["ttft_p99_ms"], 1e-9), 3),
            "elapsed": round(on["elapsed_s"] / max(off["elapsed_s"], 1e-9), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "small", "default"), default="tiny")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--pool-blocks", type=int, default=48, help="each worker's KV pool, in 16-token blocks")
    ap.add_argument("--store-mib", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--write-trace", help="write the conversation trace here (JSONL) and stop")
    args = ap.parse_args()
    records = conversation_trace(args.conversations, args.turns)
    if args.write_trace:
        Path(args.write_trace).write_text("".join(json.dumps(r) + "\n" for r in records))
        return
    from engine.model.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.size == "default":
            from cluster.default_model import model_path
            from engine.checkpoints.gguf_checkpoint import resolve_model_dir

            model_dir = str(resolve_model_dir(model_path(None)))
        else:
            model_dir = str(make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size, seed=0))
        trace = Path(tmp) / "conversations.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        rows = [arm(model_dir, trace, len(records), args.pool_blocks, mib, args.concurrency)
                for mib in (0, args.store_mib)]
    for row in rows:
        print(json.dumps({**row, "size": args.size}), flush=True)
    print(json.dumps({"bench": "kv_tier_trace", **ratios(*rows)}), flush=True)


if __name__ == "__main__":
    main()
