"""The router's Prometheus metrics (torch-free): what clients see, named as vLLM names it.

Request-level metrics live here, at the router, as they live in vLLM's API server: the
router is where a request arrives, waits, gets its first token and ends, so a dashboard
summing every target counts each request once. Names are vLLM's with `splitserve:` in
place of `vllm:`; one label, `model_name`. Engine-level numbers (running, waiting, KV
usage, prefix cache, preemptions, transfers) come from each worker's own `/metrics`
(`control.worker_metrics`).

Observed on the request path (histograms and counters, a lock each): TTFT, inter-token
latency (one observation per token after the first), end-to-end latency, admission wait,
prompt/generation/cached tokens, finished requests by reason. Read at scrape time from
the router's own books (`RouterBooks`, on the event loop): routing decisions, refusals by
reason, retries, busy waits, admitted/queued requests and tokens, the longest forecast
admission wait, the HTTP door's idle and closed connections, and the workers this router
sees by role and state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "splitserve:"
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's TTFT buckets (seconds), so its dashboards' bucket queries carry over."""
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class RouterBooks:
    """What the collector reads at scrape time (callables into the router's live parts)."""

    stats: Callable[[], dict[str, int]]
    """Flow and servicer counters: num_local_prefill, num_remote_prefill, num_retries, ..."""
    refusals: Callable[[], dict[str, int]]
    admission: Callable[[], dict[str, float]]
    """num_admitted, num_queued, inflight_tokens (charged), used_tokens, budget_tokens,
    forecast_wait_s."""
    workers: Callable[[], list[tuple[str, str]]]
    """(role, state) of each worker this router sees."""
    connections: Callable[[], dict[str, int]] = dict
    """The HTTP door's connections (router/http_connections.py): num_idle, num_evicted,
    num_timed_out ({}: no HTTP door)."""


class RouterMetrics:
    def __init__(self, model_name: Callable[[], str] = str) -> None:
        """`model_name` reads the served model's id (the workers report it once they join)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r, p = self.registry, PREFIX

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(p + name, doc, labels, registry=r, buckets=buckets)

        def count(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, [*labels, *extra], registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival at the router to the first token sent.",
                         LATENCY_BUCKETS_S)
        self.itl = hist("inter_token_latency_seconds", "Time between tokens sent to the client.", ITL_BUCKETS_S)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival at the router to the last response.",
                        LATENCY_BUCKETS_S)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting for admission at the router.",
                               LATENCY_BUCKETS_S)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = count("generation_tokens", "Tokens generated and sent to clients.")
        self.cached_tokens = count("prompt_tokens_cached", "Prompt tokens served from a prefix cache, as "
                                                           "reported to clients (usage.cached_tokens).")
        self.success = count("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.wait_estimate = hist("admission_wait_estimate_ratio", "Queued requests admitted: actual wait for "
                                  "admission over the wait estimated when they were queued.", RATIO_BUCKETS)

    def observe_wait_estimate(self, ratio: float) -> None:
        self.wait_estimate.labels(self.model_name()).observe(ratio)

    def watch(self, books: RouterBooks) -> None:
        self.registry.register(_BooksCollector(books, self.model_name))

    # -- the request path -----------------------------------------------------------------------
    def observe_itl(self, gap_s: float, num_tokens: int) -> None:
        """One response carried `num_tokens` new tokens `gap_s` after the previous one."""
        h = self.itl.labels(self.model_name())
        for _ in range(num_tokens):
            h.observe(gap_s / num_tokens)

    def finished(self, *, queue_s: float, ttft_s: float | None, e2e_s: float, num_prompt: int, num_output: int,
                 num_cached: int, reason: str) -> None:
        m = self.model_name()
        self.queue_time.labels(m).observe(queue_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_len.labels(m).observe(num_prompt)
        self.output_len.labels(m).observe(num_output)
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.generation_tokens.labels(m).inc(num_output)
        self.cached_tokens.labels(m).inc(num_cached)
        self.success.labels(m, reason).inc()


class _BooksCollector(Collector):
    def __init__(self, books: RouterBooks, model_name: Callable[[], str]) -> None:
        self.books, self.model_name = books, model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        m, p = self.model_name(), PREFIX
        stats, admission = self.books.stats(), self.books.admission()
        routed = CounterMetricFamily(p + "routing_decisions", "Requests routed, by where the prompt was prefilled.",
                                     labels=["model_name", "kind"])
        routed.add_metric([m, "local_prefill"], stats.get("num_local_prefill", 0))
        routed.add_metric([m, "remote_prefill"], stats.get("num_remote_prefill", 0))
        yield routed
        refused = CounterMetricFamily(p + "admission_refusals", "Requests refused by admission, by reason.",
                                      labels=["model_name", "reason"])
        for reason, n in sorted(self.books.refusals().items()):
            refused.add_metric([m, reason], n)
        yield refused
        for name, key, doc in (("retries", "num_retries", "Tries after a worker failed a request."),
                               ("busy_waits", "num_busy_waits", "Waits on a busy (heartbeating) worker past a timeout."),
                               ("kv_waits", "num_kv_waits", "Admitted requests that waited for a decode worker's KV room."),
                               ("requests_invalid", "num_invalid", "Requests refused as invalid (INVALID_ARGUMENT).")):
            yield _counter(p + name, doc, m, stats.get(key, 0))
        for name, key, doc in (("router_requests_admitted", "num_admitted", "Requests admitted and not ended."),
                               ("router_requests_queued", "num_queued", "Requests waiting for admission."),
                               ("admission_inflight_tokens", "inflight_tokens",
                                "Tokens the admitted requests are charged: prompt and expected output, or what "
                                "they hold past it."),
                               ("admission_used_tokens", "used_tokens",
                                "Tokens the admitted requests really hold: uncached prompt and output so far."),
                               ("admission_budget_tokens", "budget_tokens", "The admission token budget now."),
                               ("admission_forecast_wait_seconds", "forecast_wait_s",
                                "The longest a queued request is forecast to wait for admission from now (0: none "
                                "queued, or no forecast yet).")):
            yield _gauge(p + name, doc, m, admission.get(key, 0))
        if connections := self.books.connections():
            yield _gauge(p + "http_idle_connections", "HTTP connections open with no request in flight.", m,
                         connections["num_idle"])
            closed = CounterMetricFamily(p + "http_connections_closed", "HTTP connections the router closed: "
                                         "evicted (the idle cap) or timed out (no request head in time).",
                                         labels=["model_name", "reason"])
            closed.add_metric([m, "evicted"], connections["num_evicted"])
            closed.add_metric([m, "timed_out"], connections["num_timed_out"])
            yield closed
        pool = GaugeMetricFamily(p + "pool_workers", "Workers this router sees, by role and state.",
                                 labels=["model_name", "role", "state"])
        seen: dict[tuple[str, str], int] = {}
        for role_state in self.books.workers():
            seen[role_state] = seen.get(role_state, 0) + 1
        for (role, state), n in sorted(seen.items()):
            pool.add_metric([m, role, state], n)
        yield pool


def _counter(name: str, doc: str, model_name: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family
