"""Observability overhead: one workload with metrics and tracing off, with metrics on (the
default), with metrics on and every span exported to a local OTLP receiver, and off once more.

Each arm starts its own local cluster (1 prefill + 1 decode, tiny llama, CPU), warms it up,
then runs the same closed-loop workload (`loadgen.runner`); the arms alternate for
--rounds rounds and each arm's rounds are pooled. Printed: one JSON line per arm and round,
then the ratios against "off" (throughput and TTFT p50; targets: metrics <= 1 % cost,
tracing <= 3 %), with the spans the receiver got. "off_again" against "off" is the noise
floor: on a small shared machine two runs of the same thing land further apart than the
targets. So the cost is also accounted for directly: the CPU time the instrumentation adds per
request, its code paths timed in this process (every metric a request updates in the router
and the workers; every span of a request, exported, and every trace-context write and read
across the hops), as a share of the CPU a request costs the serving processes (router and
workers, /proc/PID/stat, over the measured run; the machine's busy CPU per request is
printed beside it).

    ./dev python benchmarks/serving/observe_overhead.py [--num-requests 96] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadgen import report
from loadgen.runner import Run, run
from loadgen.workload import synthetic
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.model.tiny_model import make_tiny_model
from router.policy import RoutingConfig

ARMS = ("off", "metrics", "traced", "off_again")
"""`off_again` is "off" once more: how far two runs of the same thing land apart (the noise floor)."""


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """A local OTLP receiver that counts what it gets (the export cost is the sender's)."""

    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        n = sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        with self._lock:
            self.num_spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def config(model: str, arm: str, endpoint: str) -> ClusterConfig:
    on = arm in ("metrics", "traced")
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=16 * 2**20, serve_metrics=on,
                            otlp_endpoint=endpoint if arm == "traced" else None),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, metrics_port=0 if on else None, otlp_endpoint=endpoint if arm == "traced" else None,
                            routing=RoutingConfig(mode="disaggregated")))


def busy_cpu_s() -> float:
    """CPU seconds this machine has spent busy (all processes), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) these processes have used, from /proc/PID/stat."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def one_arm(model: str, arm: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    items = synthetic(args.num_requests, args.prompt_len, args.output_len, 0.0, 0, 0, 512, args.seed)
    with LocalCluster(config(model, arm, endpoint)) as cluster:
        asyncio.run(run(cluster.address, items[:8], concurrency=4))  # warm-up
        serving = [int(w["pid"]) for w in cluster.workers()] + [int(r["pid"]) for r in cluster.router_stats()]
        cpu, own = busy_cpu_s(), process_cpu_s(serving)
        result: Run = asyncio.run(run(cluster.address, items, concurrency=args.concurrency))
        cpu, own = busy_cpu_s() - cpu, process_cpu_s(serving) - own
    summary = report.summarize(result, 2.0, 0.1)
    summary["cpu_ms_per_request"] = round(cpu * 1e3 / max(summary["num_ok"], 1), 2)
    summary["serving_cpu_ms_per_request"] = round(own * 1e3 / max(summary["num_ok"], 1), 3)
    return summary


def instrumentation_us(endpoint: str, output_len: int, n: int = 2000, n_traced: int = 250) -> dict[str, float]:
    """CPU microseconds the instrumentation itself adds per request, timed in this process: the
    router's metric observations (one request's histograms and counters, an ITL per token) and
    one request's seven spans with their attributes, exported to the receiver in batches (few
    enough that the exporter's queue never drops one; the final flush is timed too)."""
    from control import tracing
    from control.worker_metrics import WorkerMetrics
    from router.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: "tiny")
    worker = WorkerMetrics("prefill", "tiny", lambda: None, block_bytes=4096)
    started = time.process_time()
    for _ in range(n):
        for _ in range(output_len - 1):
            metrics.observe_itl(0.02, 1)
        metrics.finished(queue_s=0.001, ttft_s=0.05, e2e_s=0.7, num_prompt=128, num_output=output_len, num_cached=0,
                         reason="length")
        worker.transferred("shm", 8, 0.002, failed=False)  # the prefill worker's hand-off
    metrics_us = (time.process_time() - started) / n * 1e6
    traced_off_us = _one_trace_per_request(output_len, n) / n * 1e6  # tracing off: spans are no-ops
    tracing.setup("observe-overhead", "bench", endpoint)
    started = time.process_time()
    _one_trace_per_request(output_len, n_traced)
    tracing.shutdown()
    tracing_us = (time.process_time() - started) / n_traced * 1e6
    return {"metrics_us_per_request": round(metrics_us, 1), "tracing_us_per_request": round(tracing_us, 1),
            "tracing_off_us_per_request": round(traced_off_us, 2)}


def _one_trace_per_request(output_len: int, n: int) -> float:
    """n requests' worth of what tracing does for a request in all three processes: the client's
    context read at the router, the seven spans, and the context written into each call
    (prefill, decode, the kvfabric push) and read back on the other side; CPU seconds."""
    from control import tracing

    client = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    started = time.process_time()
    for i in range(n):
        root = tracing.child("router.generate", tracing.extract(client), tracing.SpanKind.SERVER,
                             splitserve__request_id=str(i))
        for name in ("router.admit", "router.route"):
            tracing.end(tracing.child(name, root), splitserve__cost_tokens=128)
        to_prefill, to_decode = tracing.headers(root), tracing.headers(root)
        fwd = tracing.child("prefill.forward", tracing.extract(to_prefill), tracing.SpanKind.SERVER)
        push = tracing.headers(fwd)
        tracing.end(tracing.child("kvfabric.transfer", fwd, splitserve__transport="shm", splitserve__blocks=8))
        tracing.end(fwd, splitserve__cached_tokens=0)
        stream = tracing.child("decode.stream", tracing.extract(to_decode), tracing.SpanKind.SERVER)
        tracing.end(tracing.child("kvfabric.receive", tracing.extract(push)), splitserve__blocks=8)
        tracing.end(stream, splitserve__preemptions=0)
        tracing.end(root, gen_ai__usage__input_tokens=128, gen_ai__usage__output_tokens=output_len)
    return time.process_time() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    receiver = SpanCounter()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    conf = {k: v for k, v in vars(args).items()} | {"cluster": "1 prefill + 1 decode, tiny llama, CPU"}
    pooled: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        for r in range(args.rounds):
            for arm in ARMS:
                s = one_arm(model, arm, endpoint, args)
                pooled[arm].append(s)
                print(json.dumps({"bench": "observe_overhead", "arm": arm, "round": r, "requests_per_s":
                                  s["requests_per_s"], "ttft_p50_ms": s["ttft_ms"]["p50"], "num_ok": s["num_ok"],
                                  "cpu_ms_per_request": s["cpu_ms_per_request"],
                                  "serving_cpu_ms_per_request": s["serving_cpu_ms_per_request"],
                                  **conf}), flush=True)
        micro = instrumentation_us(endpoint, args.output_len)
    finally:
        server.stop(grace=None)
    mean = {arm: {"requests_per_s": statistics.mean(s["requests_per_s"] for s in runs),
                  "ttft_p50_ms": statistics.mean(s["ttft_ms"]["p50"] for s in runs),
                  "cpu_ms_per_request": statistics.mean(s["cpu_ms_per_request"] for s in runs),
                  "serving_cpu_ms_per_request": statistics.mean(s["serving_cpu_ms_per_request"] for s in runs)}
            for arm, runs in pooled.items()}
    ratios = {f"{arm}_over_off": {k: round(v / mean["off"][k], 4) for k, v in mean[arm].items()}
              for arm in ARMS[1:]}
    print(json.dumps({"bench": "observe_overhead", "summary": {a: {k: round(v, 2) for k, v in m.items()}
                                                              for a, m in mean.items()},
                      "ratios": ratios, "spans_received": receiver.num_spans, **micro,
                      "instrumentation_share_of_cpu_per_request": {
                          k.removesuffix("_us_per_request"): round(v / 1e3 / mean["off"]["serving_cpu_ms_per_request"], 4)
                          for k, v in micro.items() if k != "tracing_off_us_per_request"}, **conf}), flush=True)


if __name__ == "__main__":
    main()
