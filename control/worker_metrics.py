"""A worker's Prometheus metrics (torch-free): its engine's state, named as vLLM names it.

Engine-level numbers, read from the engine at scrape time (`refresh` reads
`LLMEngine.load()` through the engine thread, on a helper thread so the event loop never
waits): requests running and waiting, KV cache usage, prefix-cache queries and hits (in
tokens, as vLLM counts them), preemptions, speculative decoding's proposals and acceptances
(overall and per position). Names are vLLM's with `splitserve:` in place of
`vllm:`; labels `model_name` and `role`. Request-level latencies are the router's
(`router.metrics`): counted here too, a request would be counted twice by a dashboard
that sums every target.

Ours only: KV transfers a prefill worker pushed, by the transport kvfabric chose for the
pair (bytes, blocks, seconds from open to the decode worker's `ready` ack, failures),
observed as each hand-off ends (on a push-lane thread; prometheus_client locks).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.types import EngineLoad

PREFIX = "splitserve:"
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics(Collector):
    def __init__(self, role: str, model_name: str, read_load: Callable[[], EngineLoad | None],
                 block_bytes: int = 0) -> None:
        self.role, self.model_name, self.read_load, self.block_bytes = role, model_name, read_load, block_bytes
        self.registry = CollectorRegistry()
        self._load: EngineLoad | None = None
        self.read_reservations: Callable[[], int] | None = None
        """A decode worker's open kvfabric reservations (set by the decode worker)."""
        self._reservations: int | None = None
        self.read_tier: Callable[[], object] | None = None
        """The worker's KV tier counters (kvstore/tier_meters.py `TierCounters`), when it has a tier."""
        labels = ["model_name", "role", "transport"]
        r, p = self.registry, PREFIX
        self.transfer_bytes = Counter(p + "kv_transfer_bytes", "KV bytes pushed to decode workers.", labels, registry=r)
        self.transfer_blocks = Counter(p + "kv_transfer_blocks", "KV blocks pushed to decode workers.", labels,
                                       registry=r)
        self.transfer_failures = Counter(p + "kv_transfer_failures", "KV hand-offs that failed.", labels, registry=r)
        self.transfer_seconds = Histogram(p + "kv_transfer_seconds", "A hand-off from open to the decode worker's "
                                          "ready ack.", labels, registry=r, buckets=TRANSFER_BUCKETS_S)
        self.registry.register(self)

    async def refresh(self) -> None:
        """Reads the engine's state for the next scrape (the engine thread answers between steps)."""
        self._load = await asyncio.to_thread(self.read_load)
        if self.read_reservations is not None:
            self._reservations = await asyncio.to_thread(self.read_reservations)

    def transferred(self, transport: str, num_blocks: int, seconds: float, failed: bool) -> None:
        """One hand-off ended (any thread)."""
        labels = (self.model_name, self.role, transport or "none")
        if failed:
            self.transfer_failures.labels(*labels).inc()
            return
        self.transfer_blocks.labels(*labels).inc(num_blocks)
        self.transfer_bytes.labels(*labels).inc(num_blocks * self.block_bytes)
        self.transfer_seconds.labels(*labels).observe(seconds)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        load = self._load
        if load is None:
            return
        values = [self.model_name, self.role]
        p, labels = PREFIX, ["model_name", "role"]
        in_use = load.num_total_blocks - load.num_free_blocks - load.num_cached_blocks
        gauges = [("num_requests_running", "Requests in the engine's batches.", load.num_running),
                  ("num_requests_waiting", "Requests waiting in the engine's queue.", load.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1); evictable cached blocks are free.",
                   in_use / max(load.num_total_blocks, 1))]
        if self._reservations is not None:
            gauges.append(("kv_reservations", "Open kvfabric reservations (KV blocks held for transfers that have "
                           "not landed).", self._reservations))
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(p + name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", load.num_prompt_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", load.num_cached_tokens),
                ("num_preemptions", "Requests preempted (by recompute).", load.num_preemptions),
                ("spec_decode_num_drafts", "Speculative verifications (one request's proposals in one step).",
                 load.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.",
                 load.spec_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
                 load.spec_num_accepted_tokens)):
            counter = CounterMetricFamily(p + name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        if self.read_tier is not None:
            tier = self.read_tier()
            for name, doc, attr in (
                    ("kv_tier_fetched_blocks", "Blocks fetched from the host's KV store instead of computed.",
                     "num_fetched_blocks"),
                    ("kv_tier_far_fetched_blocks", "Of those, blocks fetched from another host's store.",
                     "num_far_fetched_blocks"),
                    ("kv_tier_fetch_failures", "Fetches that fell back to computing.", "num_fetch_failures"),
                    ("kv_tier_fetches_priced_out", "Fetches skipped: measured no faster than computing.",
                     "num_fetches_priced_out"),
                    ("kv_tier_offloaded_blocks", "Cached blocks written into the host's KV store.",
                     "num_offloaded_blocks"),
                    ("kv_tier_offload_failures", "Offloads that failed.", "num_offload_failures"),
                    ("kv_tier_offload_skipped_blocks", "Cached blocks not offered (the offload lane was behind).",
                     "num_offload_skipped")):
                counter = CounterMetricFamily(p + name, doc, labels=labels)
                counter.add_metric(values, getattr(tier, attr))
                yield counter
        per_pos = CounterMetricFamily(p + "spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal (0: the first).",
                                      labels=[*labels, "position"])
        for position, value in enumerate(load.spec_accepted_per_pos):
            per_pos.add_metric([*values, str(position)], value)
        yield per_pos
