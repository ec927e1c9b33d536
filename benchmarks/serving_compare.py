"""Two cluster set-ups, the same workload, one script: JSON lines per arm plus the ratio line.

Scenarios (each arm is a fresh local cluster with the same number of workers, so the
same core count; arms run one after the other in this process):
  mixed     disaggregated (1 prefill + 1 decode) vs colocated (2 decode) on long prompts
            arriving while short-prompt requests decode: p99 ITL and TTFT ratios
  overhead  the same two set-ups at low load, one request at a time: TTFT difference
            against the measured KV transfer time
  prefix    cache-aware vs round-robin routing (2 prefill + 2 decode) on a shared-prefix
            workload: TTFT p50 ratio and prefix hit rates

  ./dev python benchmarks/serving_compare.py --scenario prefix [--size tiny|small]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_gen import Item, run_load, synthetic  # noqa: E402

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig  # noqa: E402
from cluster.local import LocalCluster, free_port  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from router.admission import AdmissionConfig  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402


def arm(model_dir: str, num_prefill: int, num_decode: int, routing: RoutingConfig) -> ClusterConfig:
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, kv_cache_bytes=64 * 2**20, max_num_batched_tokens=512),
        num_prefill=num_prefill, num_decode=num_decode,
        router=RouterConfig(port=free_port(), routing=routing, admission=AdmissionConfig()),
        worker_num_cpus=0.5)


def run_arm(name: str, config: ClusterConfig, items: list[Item], rate: float | None, concurrency: int | None,
            warmup: list[Item]) -> dict[str, object]:
    cluster = LocalCluster(config)
    started = time.perf_counter()
    cluster.start()
    try:
        startup_s = time.perf_counter() - started
        if warmup:
            asyncio.run(run_load(cluster.address, warmup, None, 1))
        result = asyncio.run(run_load(cluster.address, items, rate, concurrency))
        stats = cluster.router_stats()[0]
    finally:
        cluster.stop()
    line = {"benchmark": "serving_compare", "arm": name, "num_prefill": config.num_prefill,
            "num_decode": config.num_decode, "routing": config.router.routing.__dict__,
            "startup_s": round(startup_s, 1), "results": result,
            "router": {k: stats[k] for k in ("num_local_prefill", "num_remote_prefill", "num_refused")}}
    print(json.dumps(line), flush=True)
    return result


def mixed_items(n: int, long_len: int, long_every: int, decode_output_len: int, seed: int) -> list[Item]:
    """n short-prompt requests that decode decode_output_len tokens (mean), with one long prompt
    (long_len mean, 4 output tokens) after every long_every of them."""
    decoders = synthetic(n, 32, decode_output_len, 0.0, 0, 0, 512, seed)
    longs = synthetic(n // long_every, long_len, 4, 0.0, 0, 0, 512, seed + 1)
    out: list[Item] = []
    for i, d in enumerate(decoders):
        out.append(d)
        if i % long_every == long_every - 1 and longs:
            out.append(longs.pop())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("mixed", "overhead", "prefix"), required=True)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--long-len", type=int, default=768, help="mixed/overhead: long prompt length (mean)")
    p.add_argument("--long-every", type=int, default=4, help="mixed: one long prompt per this many decoders")
    p.add_argument("--decode-output-len", type=int, default=64, help="mixed: decoders' output length (mean)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="llama", size=args.size, seed=0))
    warm = synthetic(4, 64, 4, 0.0, 0, 0, 512, 99)
    arms: dict[str, dict[str, object]] = {}
    if args.scenario in ("mixed", "overhead"):
        if args.scenario == "mixed":
            items, rate, conc = mixed_items(args.num_requests, args.long_len, args.long_every,
                                                  args.decode_output_len, args.seed), args.rate, None
        else:
            items, rate, conc = synthetic(args.num_requests // 2, args.long_len, 4, 0.0, 0, 0, 512, args.seed), None, 1
        arms["disaggregated"] = run_arm("disaggregated", arm(model_dir, 1, 1, RoutingConfig(mode="disaggregated")),
                                        items, rate, conc, warm)
        arms["colocated"] = run_arm("colocated", arm(model_dir, 0, 2, RoutingConfig(mode="colocated")),
                                    items, rate, conc, warm)
        d, c = arms["disaggregated"], arms["colocated"]
        ratios = {"itl_p99_disagg_over_coloc": _ratio(d["itl_p99_ms"], c["itl_p99_ms"]),
                  "ttft_p50_disagg_over_coloc": _ratio(d["ttft_p50_ms"], c["ttft_p50_ms"]),
                  "ttft_p50_diff_ms": round(float(d["ttft_p50_ms"]) - float(c["ttft_p50_ms"]), 2),  # type: ignore[arg-type]
                  "overhead_bound_ms": round(10.0 + float(d["transfer_p50_ms"]), 2)}  # type: ignore[arg-type]
    else:
        items = synthetic(args.num_requests, 160, 16, 0.9, 4, 128, 512, args.seed)
        rr = RoutingConfig(mode="auto", policy="round_robin", local_prefill_tokens=32)
        ca = RoutingConfig(mode="auto", policy="cache_aware", local_prefill_tokens=32)
        arms["round_robin"] = run_arm("round_robin", arm(model_dir, 2, 2, rr), items, args.rate, None, [])
        arms["cache_aware"] = run_arm("cache_aware", arm(model_dir, 2, 2, ca), items, args.rate, None, [])
        a, r = arms["cache_aware"], arms["round_robin"]
        ratios = {"ttft_p50_cache_aware_over_rr": _ratio(a["ttft_p50_ms"], r["ttft_p50_ms"]),
                  "prefix_hit_rate_cache_aware": a["prefix_hit_rate"], "prefix_hit_rate_rr": r["prefix_hit_rate"]}
    print(json.dumps({"benchmark": "serving_compare", "scenario": args.scenario, "config": vars(args),
                      "ratios": ratios}), flush=True)
    return 0


def _ratio(a: object, b: object) -> float:
    return round(float(a) / float(b), 3) if float(b) else float("nan")  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
