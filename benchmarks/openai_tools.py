"""A third-party OpenAI benchmark tool (NVIDIA's aiperf) against splitserve, beside
`splitserve bench` at the same load over gRPC: their TTFT and ITL must agree within the
tools' own overheads.

One local cluster as `serve` starts it (1 prefill + 1 decode, the default model,
SmolLM2-135M-Instruct from its GGUF file, CPU). Two loads, each run by both tools one after
the other: a fixed request rate (Poisson in `splitserve bench`, constant in aiperf) and a
fixed concurrency. aiperf sends streamed chat completions with synthetic prompts of
--input-tokens tokens (its own text, tokenized with the model's tokenizer directory, no hub)
and `ignore_eos` so every answer has --output-tokens tokens; `splitserve bench` sends token-id
prompts of the same mean length over gRPC. Prints one JSON line per tool and load, and one
with the ratios aiperf / splitserve bench.

aiperf is not a dependency of splitserve (it pulls in much of its own); install it once
into a venv of its own and point --aiperf at it:

    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    ./dev python benchmarks/openai_tools.py --aiperf .venv-aiperf/bin/aiperf [--rate 1.0] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import report
from bench.runner import run
from bench.workload import synthetic
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.default_model import model_path
from cluster.local import LocalCluster
from engine.gguf_checkpoint import resolve_model_dir
from router.policy import RoutingConfig

NAME = "smollm2"


def aiperf(binary: str, url: str, tokenizer: str, load: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="aiperf-"))
    cmd = [binary, "profile", "--model", NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(args.input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--no-gpu-telemetry", "--no-server-metrics", "--request-count", str(args.num_requests),
           "--warmup-request-count", "4", "--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "0"]
    cmd += (["--request-rate", str(load["rate"]), "--request-rate-mode", "constant"] if "rate" in load
            else ["--concurrency", str(load["concurrency"])])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=False)
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
            "num_ok": metric("request_count", "avg"), "artifacts": str(out)}


def splitserve_bench(cluster: LocalCluster, load: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    items = synthetic(args.num_requests, args.input_tokens, args.output_tokens, 0.0, 0, 0, 49152, 7)
    items = [type(i)(i.prompt, args.output_tokens) for i in items]  # every answer --output-tokens long
    result = asyncio.run(run(cluster.address, items, rate=load.get("rate"), concurrency=load.get("concurrency")))
    s = report.summarize(result, 2.0, 0.1)
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"], "itl_p50_ms": s["itl_ms"]["p50"],
            "itl_p90_ms": s["itl_ms"]["p90"], "requests_per_s": s["requests_per_s"],
            "output_tokens_per_s": s["output_tokens_per_s"], "num_ok": s["num_ok"]}


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
        for load in ({"rate": args.rate}, {"concurrency": args.concurrency}):
            ours = splitserve_bench(cluster, load, args)
            print(json.dumps({"bench": "openai_tools", "tool": "splitserve bench (gRPC)", **load, **ours, **conf}),
                  flush=True)
            theirs = aiperf(args.aiperf, url, tokenizer, load, args)
            print(json.dumps({"bench": "openai_tools", "tool": "aiperf (HTTP)", **load, **theirs, **conf}), flush=True)
            ratios = {k: round(theirs[k] / ours[k], 3) for k in ("ttft_p50_ms", "itl_p50_ms", "requests_per_s")
                      if theirs.get(k) and ours.get(k)}
            print(json.dumps({"bench": "openai_tools", "aiperf_over_splitserve_bench": ratios, **load}), flush=True)


if __name__ == "__main__":
    main()
