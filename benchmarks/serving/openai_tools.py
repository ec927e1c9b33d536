"""A third-party OpenAI benchmark tool (NVIDIA's aiperf) against splitserve, beside
`splitserve bench` at the same load over gRPC: their TTFT and ITL must agree within the
tools' own overheads.

One local cluster as `serve` starts it (1 prefill + 1 decode, the default model,
SmolLM2-135M-Instruct from its GGUF file, CPU). Two loads, each run by the tools one after
the other: a fixed request rate (Poisson in `splitserve bench`, constant in aiperf) and a
fixed concurrency. aiperf sends streamed completions with synthetic prompts of
--input-tokens tokens (its own text, tokenized with the model's tokenizer directory, no hub)
and `ignore_eos` so every answer has --output-tokens tokens; `splitserve bench` sends token-id
prompts of exactly that length, over gRPC and then over HTTP (the same client on both
doors, so the HTTP row separates the door from the tool). Each row carries the CPU seconds
its tool spent: on a small machine the load generator competes with the cluster for cores.
Prints one JSON line per tool and load, and one with the ratios aiperf / splitserve bench.

aiperf is not a dependency of splitserve (it pulls in much of its own); install it once
into a venv of its own and point --aiperf at it:

    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    ./dev python benchmarks/serving/openai_tools.py --aiperf .venv-aiperf/bin/aiperf [--rate 1.0] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from loadgen import report
from loadgen.runner import run
from loadgen.workload import WorkloadRequest, synthetic
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.default_model import model_path
from cluster.local import LocalCluster
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from router.policy import RoutingConfig

NAME = "smollm2"


def aiperf(binary: str, url: str, tokenizer: str, load: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="aiperf-"))
    cmd = [binary, "profile", "--model", NAME, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(args.input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--no-gpu-telemetry", "--no-server-metrics", "--request-count", str(args.num_requests),
           "--warmup-request-count", "4", "--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "0"]
    cmd += (["--request-rate", str(load["rate"]), "--request-rate-mode", "constant"] if "rate" in load
            else ["--concurrency", str(load["concurrency"])])
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}  # a local path: no hub
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tool_cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    found = list(out.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    raw = json.loads(found[0].read_text())

    def metric(tag: str, stat: str) -> float | None:
        m = raw.get(tag) or next((x for x in raw.get("records", []) if x.get("tag") == tag), None) or {}
        return m.get(stat)
    return {"ttft_p50_ms": metric("time_to_first_token", "p50"), "ttft_p90_ms": metric("time_to_first_token", "p90"),
            "itl_p50_ms": metric("inter_token_latency", "p50"), "itl_p90_ms": metric("inter_token_latency", "p90"),
            "requests_per_s": metric("request_throughput", "avg"),
            "output_tokens_per_s": metric("output_token_throughput", "avg"),
            "num_ok": metric("request_count", "avg"), "tool_cpu_s": round(tool_cpu_s, 1), "artifacts": str(out)}


def splitserve_bench(target: str, load: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)  # prompts of exactly --input-tokens, answers of exactly --output-tokens
    items = [WorkloadRequest([rng.randrange(3, 49152) for _ in range(args.input_tokens)], args.output_tokens)
             for _ in range(args.num_requests)]
    cpu = time.process_time()
    result = asyncio.run(run(target, items, rate=load.get("rate"), concurrency=load.get("concurrency")))
    cpu = time.process_time() - cpu
    s = report.summarize(result, 2.0, 0.1)
    tpots = sorted(o.tpot_s * 1e3 for o in result.outcomes if o.ok and o.tpot_s is not None)
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            # aiperf's ITL is each request's mean gap ((e2e - TTFT) / (tokens - 1)), then its percentiles:
            # the same here, beside the percentiles of every single gap (prefill steps of other
            # requests that a decode step waits behind weigh in a mean, hardly in a median)
            "itl_p50_ms": round(statistics.median(tpots), 2), "itl_p90_ms": round(report.pct(tpots, 90) or 0.0, 2),
            "token_gap_p50_ms": s["itl_ms"]["p50"], "requests_per_s": s["requests_per_s"],
            "output_tokens_per_s": s["output_tokens_per_s"], "num_ok": s["num_ok"], "tool_cpu_s": round(cpu, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s of the fixed-rate load")
    ap.add_argument("--concurrency", type=int, default=4, help="clients of the fixed-concurrency load")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    args = ap.parse_args()
    model = model_path(None)
    tokenizer = str(resolve_model_dir(model))
    config = ClusterConfig(worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=256 * 2**20),
                           num_prefill=1, num_decode=1,
                           router=RouterConfig(port=0, http_port=0, served_model_name=NAME, tokenizer_dir=tokenizer,
                                               routing=RoutingConfig(mode="auto")))
    conf = vars(args) | {"cluster": "1 prefill + 1 decode, SmolLM2-135M-Instruct Q4_1 GGUF as float32, CPU"}
    with LocalCluster(config) as cluster:
        url = f"http://{cluster.info['http_address']}"
        asyncio.run(run(cluster.address, synthetic(4, args.input_tokens, 8, 0.0, 0, 0, 49152, 99), concurrency=2))
        for n, load in enumerate(({"rate": args.rate}, {"concurrency": args.concurrency})):
            ours = splitserve_bench(cluster.address, load, args, 10 * n)
            print(json.dumps({"bench": "openai_tools", "tool": "splitserve bench (gRPC)", **load, **ours, **conf}),
                  flush=True)
            http = splitserve_bench(url, load, args, 10 * n + 1)
            print(json.dumps({"bench": "openai_tools", "tool": "splitserve bench (HTTP)", **load, **http, **conf}),
                  flush=True)
            theirs = aiperf(args.aiperf, url, tokenizer, load, args)
            print(json.dumps({"bench": "openai_tools", "tool": "aiperf (HTTP)", **load, **theirs, **conf}), flush=True)
            ratios = {k: round(theirs[k] / ours[k], 3) for k in ("ttft_p50_ms", "itl_p50_ms", "requests_per_s")
                      if theirs.get(k) and ours.get(k)}
            print(json.dumps({"bench": "openai_tools", "aiperf_over_splitserve_bench": ratios, **load}), flush=True)


if __name__ == "__main__":
    main()
