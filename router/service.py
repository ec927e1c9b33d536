"""RouterService: one router replica — its gRPC server and background tasks (a Ray actor body).

Serves `Generation` (the `router.servicer.Generation` over a `RequestFlow`), standard
health checking and server reflection on `RouterConfig.host:port`, and the OpenAI HTTP API
(`router.http_api`, the same `Generation` underneath) on `host:http_port`, on one event loop; runs the Redis feed
(membership, KV index, heartbeats), the admission expiry timer and the router's stats
report (`splitserve status` reads it); serves Prometheus `/metrics` on `metrics_port`. Workers are found in the registry, not given:
a router needs a Redis URL. This module and everything it imports are torch-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control import tracing
from control.auth import cluster_token, is_loopback, metrics_token, registry_key
from control.router_stats import RouterStats
from control.metrics_http import MetricsServer
from control.reader import RegistryReader
from control.worker_config import NO_SECRET, dialable_host
from proto import generate_pb2 as pb
from router.clients import GrpcStreams, WorkerClients
from router.config import RouterConfig
from router.feed import RegistryFeed
from router.flow import RequestFlow
from router.frontend import Frontend
from router.gate import AdmissionGate
from router.api_keys import KeyCheck
from router.http_api import OpenAIServer
from router.http_guard import HttpGuard
from router.kv_index import KVIndex
from router.loads import LoadBook
from router.members import Members
from router.metrics import RouterBooks, RouterMetrics
from router.response_store import ResponseStore
from router.servicer import Generation

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
CATCH_UP_TIMEOUT_S = 30.0
"""Longest a starting router replays the workers' KV event streams before it reports SERVING."""


class RouterService:
    def __init__(self, router_id: str, config: RouterConfig, redis_url: str, namespace: str) -> None:
        logging.basicConfig(level=logging.INFO)
        if not config.cluster_secret:
            raise ValueError(NO_SECRET)
        self.router_id, self.config = router_id, config
        tracing.setup("splitserve-router", router_id, config.otlp_endpoint)
        self.reader = RegistryReader(redis_url, namespace, seal_key=registry_key(config.cluster_secret))
        self.redis_url = redis_url
        self.members = Members(config.worker_networks)
        self.index = KVIndex(time.monotonic)
        self.stores = KVIndex(time.monotonic)
        """What each host's KV store holds (kvstore/), by store id."""
        self.loads = LoadBook({})
        self.streams = GrpcStreams(cluster_token(config.cluster_secret), config.tls)
        self.flow = RequestFlow(config, self.members, WorkerClients(self.streams, self.members.address), self.index,
                                self.loads, stores=self.stores)
        self.gate = AdmissionGate(config.admission, time.monotonic)
        self.metrics = RouterMetrics(lambda: self.members.facts.model_id if self.members.facts else "") \
            if config.metrics_port is not None else None
        frontend = Frontend(config.tokenizer_dir, config.chat_template)
        self.generation = Generation(frontend, self.gate, self.flow, self.members, metrics=self.metrics,
                                     api_keys=config.api_keys, default_timeout_s=config.request_timeout_s)
        guard = HttpGuard.for_bind(config.host, config.api_keys, config.open_paths, config.allowed_hosts)
        self.http = OpenAIServer(self.generation, frontend, self.members, config.served_model_name,
                                 config.max_request_bytes, config.tool_call_parser,
                                 config.reasoning_parser, guard, config.request_limits, config.http_deadlines,
                                 self.generation.off_loop,
                                 ResponseStore(redis_url, namespace, config.responses_ttl_s,
                                               config.responses_max_bytes)) \
            if config.http_port is not None else None
        self.http_address = ""
        self.metrics_server: MetricsServer | None = None
        if self.metrics is not None:
            self.metrics.watch(RouterBooks(stats=lambda: {**self.generation.stats, **self.flow.stats},
                                           refusals=lambda: dict(self.gate.refusals), admission=self._admission_books,
                                           workers=self.members.roles_and_states,
                                           connections=self.http.connections.counts if self.http else dict))
            self.metrics_server = MetricsServer(self.metrics.registry, token=metrics_token(config.cluster_secret))
            self.gate.queue.on_wait_estimate = self.metrics.observe_wait_estimate
        self.metrics_address = ""
        self.feed = RegistryFeed(self.reader, self.members, self.index, self.loads, config.load_refresh_s,
                                 config.index_poll_ms, self.streams.forget, stores=self.stores,
                                 confirm=self.streams.serving)
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address = ""

    async def start(self, port: int | None = None, http_port: int | None = None) -> str:
        """Serves gRPC on `port` and the HTTP API on `http_port` (default: the configured ones; 0
        picks a free one) and returns gRPC's host:port (`http_address` has the other)."""
        port = self.config.port if port is None else port
        if not self.config.api_keys and not is_loopback(self.config.host):
            logger.warning("router %s: serving on %s without API keys: anyone who reaches this address may call it "
                           "(set --api-key or --api-key-file, or bind loopback)", self.router_id, self.config.host)
        server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.config.share_port)),
                                          ("grpc.max_receive_message_length", self.config.max_request_bytes)],
                                 interceptors=[KeyCheck(self.config.api_keys, frozenset({f"/{SERVICE_NAME}/Generate"}))]
                                 if self.config.api_keys else None)
        self.generation.add_to_server(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            bound = server.add_insecure_port(f"{self.config.host}:{port}")
        except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
            bound = 0
        if bound == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{port}: the port is in use "
                               "(another splitserve? pick another with --port)")
        # before any traffic: the workers serving and what they cache (a replacement router
        # rebuilds its KV index here from the workers' event streams)
        with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
            replayed = await self.feed.catch_up(CATCH_UP_TIMEOUT_S)
            logger.info("router %s: %d KV events replayed from %d workers", self.router_id, replayed,
                        len(self.members.ids()))
        await server.start()
        if self.http is not None:
            bound_http = await self.http.start(self.config.host, self.config.http_port if http_port is None
                                               else http_port, self.config.share_port)
            self.http_address = f"{self.config.host}:{bound_http}"
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{self.config.host}:{bound}"
        if self.metrics_server is not None and self.config.metrics_port is not None:
            metrics_port = await self.metrics_server.start(self.config.host, self.config.metrics_port)
            self.metrics_address = f"{dialable_host(self.config.host, self.redis_url)}:{metrics_port}"
        with contextlib.suppress(redis.RedisError, OSError, TimeoutError):  # found by `status` at once
            await self.reader.set_router_stats(self.router_id, await self.stats(), ttl_s=5.0)
        self._tasks += [asyncio.create_task(self.feed.run()), asyncio.create_task(self._tick())]
        logger.info("router %s serving on %s%s", self.router_id, self.address,
                    f", HTTP on {self.http_address}" if self.http_address else "")
        return self.address

    async def await_workers(self, worker_ids: list[str], timeout_s: float) -> None:
        """Returns once every one of these workers is a member here (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while missing := [w for w in worker_ids if w not in self.members]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {self.router_id}: no heartbeat from {missing} in {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def drain_worker(self, worker_id: str) -> None:
        """The controller is about to drain this worker: route nothing new to it."""
        self.members.drain(worker_id)

    def _admission_books(self) -> dict[str, float]:
        q = self.gate.queue
        now = q.clock()
        return {"num_admitted": q.num_admitted, "num_queued": q.num_queued, "inflight_tokens": q.charged_tokens,
                "used_tokens": q.used_tokens, "budget_tokens": q.budget_tokens,
                "forecast_wait_s": max((at - now for at in q.queued_admission_times().values()), default=0.0)}

    async def stats(self) -> RouterStats:
        """This replica's books (`splitserve status`, the autoscaler's gauge), published every second."""
        q = self.gate.queue
        return RouterStats(
            router_id=self.router_id, address=self.address, http_address=self.http_address,
            metrics_address=self.metrics_address, pid=os.getpid(),
            **self.generation.stats, **self.flow.stats, **self._admission_books(),
            queued_by_priority={str(k): v for k, v in q.queued_by_priority().items()},
            tenant_tokens=q.tenant_tokens(), refusals=dict(self.gate.refusals), forecast_scale=q.forecast.model_scale,
            itl_p50_ms=self.generation.itl.p50_ms(), redis_healthy=self.feed.healthy, members=self.members.ids(),
            serving={role: self.members.serving(role) for role in ("prefill", "decode")},
            down_workers=self.flow.down_workers(), late_heartbeats_kept=self.feed.num_silent_kept,
            bad_registry_entries=self.reader.num_bad_entries, refused_addresses=self.members.num_refused_addresses,
            heartbeat_at={w: b.sent_at for w, b in self.flow.loads.heartbeats.items()},
            active={w: self.flow.loads.load(w).num_active for w in self.members.ids()},
            index_events=self.feed.num_events, index_gaps=self.index.num_gaps,
            index_blocks={w: self.index.num_blocks(w) for w in self.members.ids()},
            store_blocks={s: self.stores.num_blocks(s) for s in self.members.stores()}, rss_mib=_rss_mib())

    async def _tick(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(0.1)
            facts = self.members.facts
            self.gate.set_capacity(self.members.decode_kv_tokens(), facts.max_held_tokens if facts else None)
            self.gate.set_step_model(*self.members.decode_step_model())
            self.gate.expire()
            n += 1
            if n % 10 == 0:
                with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
                    await self.reader.set_router_stats(self.router_id, await self.stats(), ttl_s=5.0)

    async def endpoints(self) -> dict[str, str]:
        """Where this replica serves: gRPC and (when on) HTTP host:port."""
        return {"grpc": self.address, "http": self.http_address}

    async def shutdown(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(grace=self.config.grace_s)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        tracing.shutdown()
        for t in self._tasks:
            t.cancel()
        await self.flow.clients.close()
        self.generation.off_loop.close()
        with contextlib.suppress(redis.RedisError, OSError):
            await self.reader.close()
            if self.http is not None and self.http.store is not None:
                await self.http.store.close()


def _rss_mib() -> float:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
