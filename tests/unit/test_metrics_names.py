"""The metric names: vLLM's (with `splitserve:`), and every one the shipped dashboard charts exists.

The registries are built as the processes build them, fed one of everything, rendered with
prometheus_client and parsed back with its parser (no cluster: `test_metrics` scrapes a real one).
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.controller_metrics import ControllerMetrics
from control.worker_metrics import WorkerMetrics
from engine.types import EngineLoad
from router.metrics import RouterBooks, RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
VLLM_NAMES = {  # vLLM's metrics (docs/design/metrics.md, v1) that have a meaning here
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens", "prompt_tokens",
    "generation_tokens", "request_success", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"}


def exported() -> dict[str, set[str]]:
    """Family name -> the sample names it renders (with _total, _bucket, ...)."""
    router = RouterMetrics(lambda: "m")
    router.watch(RouterBooks(stats=lambda: {"num_remote_prefill": 2}, refusals=lambda: {"wait": 1},
                             admission=lambda: {"num_admitted": 1}, workers=lambda: [("decode", "serving")],
                             connections=lambda: {"num_idle": 1, "num_evicted": 0, "num_timed_out": 0}))
    router.finished(queue_s=0.1, ttft_s=0.2, e2e_s=0.5, num_prompt=10, num_output=3, num_cached=4, reason="length")
    router.observe_itl(0.02, 2)
    worker = WorkerMetrics("prefill", "m", lambda: EngineLoad(10, 4, 2, 1, 1, 5, 100, 40, 3, 6, 24, 10, (5, 3, 2, 0)),
                           block_bytes=1024)
    asyncio.run(worker.refresh())
    worker.transferred("shm", 4, 0.01, failed=False)
    worker.transferred("tcp", 0, 0.0, failed=True)
    controller = ControllerMetrics(lambda: {"targets": {"prefill": 1, "decode": 2}, "num_dead": 1, "num_drains": 0,
                                            "workers": [("decode", "serving"), ("decode", "starting")]})
    out: dict[str, set[str]] = {}
    for registry in (router.registry, worker.registry, controller.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            out[family.name] = {s.name for s in family.samples}
    return out


def test_vllm_names_are_kept_with_our_prefix() -> None:
    names = exported()
    assert {n.removeprefix("splitserve:") for n in names} >= VLLM_NAMES
    assert all(n.startswith("splitserve:") for n in names)


def test_the_router_exports_its_admission_forecast_and_its_http_connections() -> None:
    """Read at scrape time: the longest forecast admission wait, the HTTP door's idle
    connections and those it closed by why (absent where the router serves no HTTP)."""
    router = RouterMetrics(lambda: "m")
    books = {"num_idle": 3, "num_evicted": 7, "num_timed_out": 2}
    router.watch(RouterBooks(stats=dict, refusals=dict, admission=lambda: {"num_queued": 2, "forecast_wait_s": 1.5},
                             workers=list, connections=lambda: books))
    samples = {(s.name, s.labels.get("reason")): s.value
               for f in text_string_to_metric_families(generate_latest(router.registry).decode()) for s in f.samples}
    assert samples["splitserve:admission_forecast_wait_seconds", None] == 1.5
    assert samples["splitserve:http_idle_connections", None] == 3
    assert samples["splitserve:http_connections_closed_total", "evicted"] == 7
    assert samples["splitserve:http_connections_closed_total", "timed_out"] == 2
    grpc_only = RouterMetrics(lambda: "m")
    grpc_only.watch(RouterBooks(stats=dict, refusals=dict, admission=dict, workers=list))
    assert "http_idle_connections" not in generate_latest(grpc_only.registry).decode()


def test_worker_gauges_read_the_engine() -> None:
    loads = [EngineLoad(10, 4, 2, 3, 1, 5, 100, 40, 7, 6, 24, 10, (5, 3, 2, 0))]
    worker = WorkerMetrics("decode", "m", loads.pop)
    worker.read_reservations = lambda: 2
    assert generate_latest(worker.registry).decode().count("splitserve:num_requests_running") == 0  # nothing read yet
    asyncio.run(worker.refresh())
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(worker.registry).decode())
               for s in f.samples}
    assert samples["splitserve:kv_cache_usage_perc"] == 0.4  # 10 - 4 free - 2 cached = 4 in use
    assert samples["splitserve:num_requests_running"] == 3
    assert (samples["splitserve:prefix_cache_queries_total"], samples["splitserve:prefix_cache_hits_total"]) == (100, 40)
    assert samples["splitserve:num_preemptions_total"] == 7
    assert samples["splitserve:kv_reservations"] == 2  # a decode worker's open kvfabric reservations
    assert (samples["splitserve:spec_decode_num_drafts_total"], samples["splitserve:spec_decode_num_draft_tokens_total"],
            samples["splitserve:spec_decode_num_accepted_tokens_total"]) == (6, 24, 10)
    per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(generate_latest(worker.registry)
               .decode()) for s in f.samples if s.name == "splitserve:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 5, "1": 3, "2": 2, "3": 0}


def test_every_series_the_dashboard_charts_is_exported() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"splitserve:[a-z0-9_]+", e)}
    samples = set().union(*exported().values())
    assert used and used <= samples, used - samples
