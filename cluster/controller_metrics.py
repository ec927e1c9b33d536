"""The controller's Prometheus metrics (torch-free): the pools as it runs them.

Read at scrape time on the controller's event loop: each pool's target (what the
autoscaler or `splitserve scale` asked for), its workers by state, the workers that died
and were replaced, and the drains finished. Routers report the workers they see
(`splitserve:pool_workers`); this is the controller's side: what it aims for.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "splitserve:"


class ControllerMetrics(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        """`read` returns targets {role: n}, workers [(role, state)], num_dead, num_drains."""
        self.read = read
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        books = self.read()
        target = GaugeMetricFamily(PREFIX + "pool_target_workers", "Workers the controller aims for, per pool "
                                   "(the autoscaler's or `splitserve scale`'s target).", labels=["role"])
        for role, n in sorted(books["targets"].items()):
            target.add_metric([role], n)
        yield target
        counts: dict[tuple[str, str], int] = {}
        for role_state in books["workers"]:
            counts[role_state] = counts.get(role_state, 0) + 1
        running = GaugeMetricFamily(PREFIX + "controller_workers", "Workers the controller runs, by role and state.",
                                    labels=["role", "state"])
        for (role, state), n in sorted(counts.items()):
            running.add_metric([role, state], n)
        yield running
        yield CounterMetricFamily(PREFIX + "workers_dead", "Workers found dead (then replaced).",
                                  value=books["num_dead"])
        yield CounterMetricFamily(PREFIX + "pool_drains", "Workers drained and removed by a scale-down.",
                                  value=books["num_drains"])
