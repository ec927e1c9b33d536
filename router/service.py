"""RouterService: the Ray actor body of a router replica — the gRPC server and its background tasks.

Serves `Generation` (the Router), standard health checking and server reflection on
`RouterConfig.host:port`; runs the Redis feed (KV index + heartbeats), the admission
expiry timer and the router's stats report (`splitserve status` reads it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.config import RouterConfig, WorkerConfig
from cluster.registry import RegistryReader
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.feed import RegistryFeed
from router.server import Router

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class RouterService:
    def __init__(self, router_id: str, config: RouterConfig, worker: WorkerConfig, prefills: dict[str, object],
                 decodes: dict[str, dict[str, object]], redis_url: str | None, namespace: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self.router_id = router_id
        self.config = config
        self.worker = worker
        self.prefills, self.decodes = prefills, decodes
        self.redis_url, self.namespace = redis_url, namespace
        self.router: Router | None = None
        self.feed: RegistryFeed | None = None
        self.reader: RegistryReader | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address = ""

    async def start(self, port: int | None = None) -> str:
        """Serves on `port` (default: the configured one; 0 picks a free one) and returns host:port."""
        port = self.config.port if port is None else port
        self.router = Router(self.config, self.worker, self.prefills, self.decodes)
        server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.config.share_port))])
        pb_grpc.add_GenerationServicer_to_server(self.router, server)
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
        port = bound
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{self.config.host}:{port}"
        if self.redis_url:
            self.reader = RegistryReader(self.redis_url, self.namespace)
            self.feed = RegistryFeed(self.reader, self.router.index, self.router.loads,
                                     [*self.decodes, *self.prefills], self.config.load_refresh_s,
                                     self.config.index_poll_ms)
            self._tasks.append(asyncio.create_task(self.feed.run()))
        self._tasks.append(asyncio.create_task(self._tick()))
        logger.info("router %s serving on %s", self.router_id, self.address)
        return self.address

    async def stats(self) -> dict[str, object]:
        r = self.router
        assert r is not None
        return {"router_id": self.router_id, "address": self.address, **r.stats,
                "num_admitted": r.admission.num_admitted, "num_queued": r.admission.num_queued,
                "queued_by_priority": {str(k): v for k, v in r.admission.queued_by_priority().items()},
                "inflight_tokens": r.admission.inflight_tokens,
                "redis_healthy": bool(self.feed and self.feed.healthy),
                "down_workers": r.down_workers(), "index_gaps": r.index.num_gaps,
                "index_events": self.feed.num_events if self.feed else 0}

    async def _tick(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(0.1)
            assert self.router is not None
            self.router.expire_queued()
            n += 1
            if self.reader is not None and n % 10 == 0:
                with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
                    await self.reader.set_router_stats(self.router_id, await self.stats(), ttl_s=5.0)

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=self.config.grace_s)
        for t in self._tasks:
            t.cancel()
        if self.router is not None:
            await self.router.close()
        if self.reader is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                await self.reader.close()
