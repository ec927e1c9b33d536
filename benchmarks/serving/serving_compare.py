"""Two cluster set-ups, the same workload, one script: JSON lines per arm plus the ratio line.

Scenarios (each arm is a fresh local cluster with the same number of workers, so the
same core count; arms run one after the other in this process):
  mixed     disaggregated (1 prefill + 1 decode) vs colocated (2 decode) on long prompts
            arriving while short-prompt requests decode: p99 ITL and TTFT ratios
  overhead  the same two set-ups at low load, one request at a time: TTFT overhead of
            disaggregation against the push of what was left at the first token (+ 5 ms)
  long_prompt  disaggregated (1 prefill + 1 decode, every prompt through the prefill
            worker) vs colocated (2 decode) on one --long-len-token prompt at a time
            (default 4,096, chunked --chunk-tokens): the TTFT overhead of disaggregation
            against the prefill worker's push of the last chunk (+ 5 ms), and the
            engine-thread time spent in kvfabric per request
  prefix    cache-aware vs round-robin routing (2 prefill + 2 decode) on a shared-prefix
            workload: TTFT p50 ratio and prefix hit rates
  transport 1 prefill + 1 decode on two separate hosts (root, iproute2: network namespaces),
            one --long-len-token prompt at a time (default 4,096), the KV over tcp vs over
            nixl (UCX over the veth): TTFT p50 ratio nixl / tcp and each arm's hand-off time

overhead --cross-host (root, iproute2): each arm's two workers run as plain processes on
two separate hosts (network namespaces, `separate_hosts.py`), the router here, so the KV
crosses a host boundary over tcp; the bound is 10 ms + the prefill worker's mean
hand-off time (open to the decode worker's ack, from its /metrics).

  ./dev python benchmarks/serving/serving_compare.py --scenario prefix [--size tiny|small]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_gen import WorkloadRequest, run_load, synthetic  # noqa: E402
from separate_hosts import SUBNET, Hosts, handoffs, namespaces, scrape  # noqa: E402

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig  # noqa: E402
from cluster.local import LocalCluster  # noqa: E402
from cluster.redis_server import free_port  # noqa: E402
from control.auth import metrics_token  # noqa: E402
from engine.model.tiny_model import make_tiny_model  # noqa: E402
from router.admission import AdmissionConfig  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402


def arm(args: argparse.Namespace, model_dir: str, num_prefill: int, num_decode: int,
        routing: RoutingConfig) -> ClusterConfig:
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, kv_cache_bytes=args.kv_cache_mib * 2**20,
                            max_num_batched_tokens=args.chunk_tokens, protected_fraction=args.protected_fraction),
        num_prefill=num_prefill, num_decode=num_decode,
        router=RouterConfig(port=0, routing=routing, admission=AdmissionConfig()),
        worker_num_cpus=0.5)


def run_arm(name: str, config: ClusterConfig, items: list[WorkloadRequest], rate: float | None, concurrency: int | None,
            warmup: list[WorkloadRequest], per_request_dir: str | None = None) -> dict[str, object]:
    """Runs the workload on a fresh cluster; the result has `handoffs`: the prefill workers'
    hand-off costs per request (ms), warm-up included."""
    cluster = LocalCluster(config)
    started = time.perf_counter()
    cluster.start()
    try:
        startup_s = time.perf_counter() - started
        if warmup:
            asyncio.run(run_load(cluster.address, warmup, None, 1))
        dump = Path(per_request_dir) / f"{name}.jsonl" if per_request_dir else None
        result = asyncio.run(run_load(cluster.address, items, rate, concurrency, per_request=dump))
        stats = cluster.router_stats()[0]
        result["handoffs"] = _handoffs(cluster.check_idle())
    finally:
        cluster.stop()
    line = {"benchmark": "serving_compare", "arm": name, "num_prefill": config.num_prefill,
            "num_decode": config.num_decode, "routing": config.router.routing.__dict__,
            "startup_s": round(startup_s, 1), "results": result,
            "router": {k: stats[k] for k in ("num_local_prefill", "num_remote_prefill", "num_refused")}}
    print(json.dumps(line), flush=True)
    return result


def _handoffs(reports: list[dict[str, object]]) -> dict[str, float]:
    """The prefill workers' summed hand-off costs as means per hand-off, in ms."""
    totals = [r["handoffs"] for r in reports if "handoffs" in r]
    n = sum(t["num_handoffs"] for t in totals)  # type: ignore[index]
    if not n:
        return {}
    mean = {k: round(sum(t[k] for t in totals) / n * 1e3, 3) for k in ("engine_s", "fabric_s", "tail_s")}  # type: ignore[index]
    return {"num_handoffs": n, "engine_kvfabric_ms": mean["engine_s"], "lane_kvfabric_ms": mean["fabric_s"],
            "last_chunk_push_ms": mean["tail_s"]}


WARM = synthetic(4, 64, 4, 0.0, 0, 0, 512, 99)
"""Requests each arm serves before the measured ones (connections, kernels, first allocations)."""


def long_prompts(n: int, length: int, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    return [WorkloadRequest([rng.randrange(3, 500) for _ in range(length)], 4) for _ in range(n)]


def mixed_items(n: int, long_len: int, long_every: int, decode_output_len: int, seed: int) -> list[WorkloadRequest]:
    """n short-prompt requests that decode decode_output_len tokens (mean), with one long prompt
    (long_len mean, 4 output tokens) after every long_every of them."""
    decoders = synthetic(n, 32, decode_output_len, 0.0, 0, 0, 512, seed)
    longs = synthetic(n // long_every, long_len, 4, 0.0, 0, 0, 512, seed + 1)
    out: list[WorkloadRequest] = []
    for i, d in enumerate(decoders):
        out.append(d)
        if i % long_every == long_every - 1 and longs:
            out.append(longs.pop())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("mixed", "overhead", "long_prompt", "prefix", "transport"), required=True)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--long-len", type=int, default=None,
                   help="mixed/overhead: long prompt length (mean, default 768); long_prompt: exact (default 4096)")
    p.add_argument("--long-every", type=int, default=4, help="mixed: one long prompt per this many decoders")
    p.add_argument("--decode-output-len", type=int, default=64, help="mixed: decoders' output length (mean)")
    p.add_argument("--disagg-mode", choices=("auto", "disaggregated"), default="auto",
                   help="mixed/overhead: the 1P+1D arm's mode (auto prefills short prompts on the decode worker)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="max_num_batched_tokens of every worker (the chunked-prefill step size)")
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="every worker's KV pool (default 64; long_prompt: 256)")
    p.add_argument("--num-prefixes", type=int, default=8, help="prefix: distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="prefix: the rest of the prompt (mean)")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.9, help="prefix: requests with a shared prefix")
    p.add_argument("--local-prefill-tokens", type=int, default=64,
                   help="prefix: uncached tokens at most for a local prefill on the decode worker")
    p.add_argument("--protected-fraction", type=float, default=0.5,
                   help="every worker's KV pool share kept for reused prefixes (0: plain LRU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cross-host", action="store_true", help="overhead: each arm's workers on two separate hosts")
    p.add_argument("--per-request-dir", default=None, help="write each arm's requests there, one JSON line each")
    args = p.parse_args()
    long_prompt = args.scenario in ("long_prompt", "transport")
    args.long_len = args.long_len or (4096 if long_prompt else 768)
    args.kv_cache_mib = args.kv_cache_mib or (256 if long_prompt else 64)
    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="llama", size=args.size, seed=0))
    if args.scenario == "prefix":
        ratios = _prefix(args, model_dir)
    elif args.scenario == "transport":
        items, warm = long_prompts(args.num_requests, args.long_len, args.seed), long_prompts(2, args.long_len, 99)
        arms = {t: run_cross_host_arm(t, args, model_dir, items, "disaggregated", warm, kv_transport=t)
                for t in ("tcp", "nixl")}
        ratios = {"ttft_p50_nixl_over_tcp": _ratio(arms["nixl"]["ttft_p50_ms"], arms["tcp"]["ttft_p50_ms"]),
                  "ttft_p50_ms": {t: a["ttft_p50_ms"] for t, a in arms.items()},
                  "handoff_ms": {t: a.get("handoff_ms") for t, a in arms.items()}}
    elif args.scenario == "mixed":
        items = mixed_items(args.num_requests, args.long_len, args.long_every, args.decode_output_len, args.seed)
        d, c = _disagg_vs_coloc(args, model_dir, items, args.rate, None, args.disagg_mode, WARM)
        ratios = {"itl_p99_disagg_over_coloc": _ratio(d["itl_p99_ms"], c["itl_p99_ms"]),
                  "ttft_p50_disagg_over_coloc": _ratio(d["ttft_p50_ms"], c["ttft_p50_ms"])}
    else:  # one request at a time: what disaggregation adds to TTFT
        if long_prompt:  # warmed with other prompts of the same length: no prefix-cache help
            items, mode = long_prompts(args.num_requests, args.long_len, args.seed), "disaggregated"
            warm = long_prompts(2, args.long_len, 99)
        else:
            items, mode = synthetic(args.num_requests // 2, args.long_len, 4, 0.0, 0, 0, 512, args.seed), args.disagg_mode
            warm = WARM
        if args.cross_host:
            ratios = _overhead_across_hosts(args, model_dir, items, mode, warm)
        else:
            ratios = _overhead(*_disagg_vs_coloc(args, model_dir, items, None, 1, mode, warm))
    print(json.dumps({"benchmark": "serving_compare", "scenario": args.scenario, "config": vars(args),
                      "ratios": ratios}), flush=True)
    return 0


def _disagg_vs_coloc(args: argparse.Namespace, model_dir: str, items: list[WorkloadRequest], rate: float | None,
                     concurrency: int | None, mode: str,
                     warm: list[WorkloadRequest]) -> tuple[dict[str, object], dict[str, object]]:
    """1 prefill + 1 decode (in `mode`) against 2 decode workers, colocated: the two arms' results."""
    disagg = run_arm("disaggregated", arm(args, model_dir, 1, 1, RoutingConfig(mode=mode)), items, rate, concurrency,  # type: ignore[arg-type]
                     warm, args.per_request_dir)
    coloc = run_arm("colocated", arm(args, model_dir, 0, 2, RoutingConfig(mode="colocated")), items, rate,
                    concurrency, warm, args.per_request_dir)
    return disagg, coloc


def _overhead(d: dict[str, object], c: dict[str, object]) -> dict[str, object]:
    """TTFT overhead of disaggregation against its bound: the prefill worker's push of what was
    left at the first token (the last chunk and `ready`) + 5 ms; and the engine thread's kvfabric time."""
    h: dict[str, float] = d["handoffs"]  # type: ignore[assignment]
    overhead = float(d["ttft_p50_ms"]) - float(c["ttft_p50_ms"])  # type: ignore[arg-type]
    bound = h.get("last_chunk_push_ms", 0.0) + 5.0
    return {"ttft_p50_disagg_over_coloc": _ratio(d["ttft_p50_ms"], c["ttft_p50_ms"]),
            "ttft_overhead_ms": round(overhead, 2), "overhead_bound_ms": round(bound, 2),
            "within_bound": overhead <= bound, "engine_kvfabric_ms_per_request": h.get("engine_kvfabric_ms")}


def run_cross_host_arm(name: str, args: argparse.Namespace, model_dir: str, items: list[WorkloadRequest], mode: str,
                       warm: list[WorkloadRequest], kv_transport: str | None = None) -> dict[str, object]:
    """One request at a time through a router here to two workers on separate hosts: prefill
    on host p and decode on host d (disaggregated), or a decode worker on each (colocated);
    `kv_transport`: the workers' --kv-transport."""
    with namespaces() as hosts, tempfile.TemporaryDirectory() as tmp:
        h = Hosts(hosts, model_dir, Path(tmp), args.kv_cache_mib, kv_transport=kv_transport)
        try:
            started = time.perf_counter()
            first = "prefill" if mode != "colocated" else "decode"
            h.worker("p", first, f"{first}-p", f"{SUBNET}.1.1")
            h.worker("d", "decode", "decode-d", f"{SUBNET}.2.1")
            router = f"127.0.0.1:{free_port()}"
            address = h.start("router", ["router", "--redis-url", h.redis_url("127.0.0.1"), "--namespace", "hosts",
                                         "--port", "0", "--mode", mode, "--metrics-port", router.rsplit(":", 1)[1]])
            deadline = time.monotonic() + 60
            while sum(v for k, v in scrape(router).items() if k.startswith("splitserve:pool_workers")) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not see both workers within 60 s")
                time.sleep(0.2)
            startup_s = time.perf_counter() - started
            asyncio.run(run_load(address, warm, None, 1))
            result = asyncio.run(run_load(address, items, None, 1))
            if first == "prefill":
                moved = handoffs(scrape(h.metrics_address("prefill-p"),
                                        token=metrics_token(b"hosts-test-secret")))  # Hosts' secret
                result["handoff_ms"], result["handoffs"] = moved["mean_ms"], moved["count"]
        finally:
            h.stop()
    print(json.dumps({"benchmark": "serving_compare", "arm": name, "cross_host": True, "mode": mode,
                      "kv_transport": kv_transport,
                      "startup_s": round(startup_s, 1), "results": result}), flush=True)
    return result


def _overhead_across_hosts(args: argparse.Namespace, model_dir: str, items: list[WorkloadRequest], mode: str,
                           warm: list[WorkloadRequest]) -> dict[str, object]:
    d = run_cross_host_arm("disaggregated", args, model_dir, items, mode, warm)
    c = run_cross_host_arm("colocated", args, model_dir, items, "colocated", warm)
    overhead = float(d["ttft_p50_ms"]) - float(c["ttft_p50_ms"])  # type: ignore[arg-type]
    bound = 10.0 + float(d.get("handoff_ms") or 0.0)  # type: ignore[arg-type]
    return {"ttft_p50_disagg_over_coloc": _ratio(d["ttft_p50_ms"], c["ttft_p50_ms"]),
            "ttft_overhead_ms": round(overhead, 2), "overhead_bound_ms": round(bound, 2),
            "within_bound": overhead <= bound, "within_10_ms": overhead <= 10.0}


def _prefix(args: argparse.Namespace, model_dir: str) -> dict[str, object]:
    """Cache-aware against round-robin routing (2 prefill + 2 decode) on shared prefixes."""
    items = synthetic(args.num_requests, args.prefix_len + args.suffix_len, 16, args.shared_prefix_fraction,
                      args.num_prefixes, args.prefix_len, 512, args.seed)
    arms = {}
    for policy in ("round_robin", "cache_aware"):
        routing = RoutingConfig(mode="auto", policy=policy, local_prefill_tokens=args.local_prefill_tokens)  # type: ignore[arg-type]
        arms[policy] = run_arm(policy, arm(args, model_dir, 2, 2, routing), items, args.rate, None, [],
                               args.per_request_dir)
    a, r = arms["cache_aware"], arms["round_robin"]
    return {"ttft_p50_cache_aware_over_rr": _ratio(a["ttft_p50_ms"], r["ttft_p50_ms"]),
            "prefix_hit_rate_cache_aware": a["prefix_hit_rate"], "prefix_hit_rate_rr": r["prefix_hit_rate"]}


def _ratio(a: object, b: object) -> float:
    return round(float(a) / float(b), 3) if float(b) else float("nan")  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
