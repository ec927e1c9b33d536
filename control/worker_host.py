"""WorkerHost: the process side of a worker, shared by both roles.

A role (prefill or decode) builds its engine and servicer, then hands them here:
`start()` serves the servicer and the standard health service on `host:0`, and
Prometheus `/metrics` on another free port of `host` (`WorkerMetrics`), registers
the worker (heartbeats with its addresses, state, incarnation, model facts and load,
through a `Publisher` thread) and marks it serving; `stop()` marks it draining, lets
running calls finish within the grace period and removes its registry entry. The load
is read through `read_load`, which the role runs on its engine thread with a bound.
`status_for` is the one map from a worker-side failure to the gRPC status the router's
client maps back.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Container
from typing import Any, TypeVar

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from control import tracing
from control.auth import TokenCheck, cluster_token, metrics_token, registry_key
from control.tls import add_member_port
from control.heartbeat import Heartbeat, ModelFacts, Role, TierSpeed, WorkerState
from control.metrics_http import MetricsServer
from control.publisher import Publisher
from control.worker_config import WorkerConfig
from control.worker_metrics import WorkerMetrics
from engine.core.block_pool import KVEvent
from engine.types import EngineLoad, EngineStopped, InvalidRequestError
from kvfabric.errors import FabricError

logger = logging.getLogger(__name__)

T = TypeVar("T")

LoadReader = Callable[[], EngineLoad | None]
"""Returns the engine's load, or None when the engine thread is too busy to answer now
(the beat keeps the last one alive)."""


def engine_died(worker_id: str) -> Callable[[BaseException], None]:
    """What a worker does when its engine loop dies (a device fault, a tensor-parallel rank
    lost): it exits at once, as a crashed worker would. Its gRPC streams break, so routers
    retry its requests on other workers; its heartbeat stops; the controller replaces it."""
    def die(error: BaseException) -> None:
        logger.critical("worker %s: its engine died (%r); the worker exits", worker_id, error)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(70)  # EX_SOFTWARE

    return die


class NoRoom(Exception):
    """The worker has no room for the request now (KV blocks): elsewhere, or later."""


class NotHere(Exception):
    """The worker cannot serve the request as it was routed (a decode worker that takes no
    pushed KV asked to take a prompt's): another worker can."""


class Stalled(Exception):
    """The request's next event did not come within the worker's idle bound."""


def status_for(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """A worker-side failure of one request as (status code, message for the router). Every
    status here is answered by a live worker; the router's `failure_for` (router/clients.py)
    marks a worker down only for UNAVAILABLE (it is stopping) and for the channel's own
    failures."""
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, FabricError):
        return grpc.StatusCode.ABORTED, f"KV transfer failed: {e}"
    if isinstance(e, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, str(e) or "the worker is stopping"
    if isinstance(e, NoRoom):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, NotHere):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, Stalled):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


STREAM_IDLE_TIMEOUT_S = 120.0
"""Longest a worker's call waits for its request's next event (the KV lease and the
transfer timeouts bound the waits behind it); then the call ends DEADLINE_EXCEEDED."""


async def next_event(events: asyncio.Queue[T], context: grpc.aio.ServicerContext, what: str) -> T:
    """A running call's next item from the engine thread, within `STREAM_IDLE_TIMEOUT_S`."""
    try:
        return await asyncio.wait_for(events.get(), STREAM_IDLE_TIMEOUT_S)
    except TimeoutError:
        await context.abort(*status_for(Stalled(f"{what}: nothing for {STREAM_IDLE_TIMEOUT_S:.0f} s")))
        raise  # abort raises; this line is for the type checker


def engine_load_reader(loop: Any) -> LoadReader:
    """A `LoadReader` over an `EngineLoop` (`loop.call(fn)` runs `fn(engine)` on its thread):
    reads `engine.load()` there, waiting at most 2 s (a `/metrics` scrape: the load now)."""
    def read() -> EngineLoad | None:
        fut = loop.call(lambda engine: engine.load())
        try:
            return fut.result(timeout=2.0)  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - busy or stopped: none this time
            return None
    return read


def latest_load_reader(loop: Any) -> LoadReader:
    """A `LoadReader` for heartbeats that never waits for the engine: each read asks the engine
    thread for its load (unless a request is still pending) and returns the newest load it has
    answered (the first read waits up to 2 s for one). A beat that waited up to 2 s for an
    engine busy in a step came later than its TTL on a loaded machine, and routers took the
    busy worker for gone (it left and rejoined, and its calls were cut)."""
    pending: list[Any] = []
    latest: list[EngineLoad] = []

    def collect() -> None:
        if pending and pending[0].done():
            fut = pending.pop()
            if not fut.cancelled() and fut.exception() is None:
                latest[:] = [fut.result()]

    def read() -> EngineLoad | None:
        collect()
        if not pending:
            try:
                pending.append(loop.call(lambda engine: engine.load()))
            except Exception:  # noqa: BLE001 - stopped: the last load stands
                pass
        if pending and not latest:  # the first load: worth a short wait (the worker's first beat)
            with contextlib.suppress(Exception):
                pending[0].result(timeout=2.0)
            collect()
        return latest[0] if latest else None
    return read


class WorkerHost:
    def __init__(self, worker_id: str, role: Role, config: WorkerConfig, facts: ModelFacts, read_load: LoadReader,
                 redis_url: str | None, namespace: str, beat_load: LoadReader | None = None) -> None:
        """`read_load`: the load now (a `/metrics` scrape waits for it); `beat_load`: the newest
        one without waiting, for heartbeats (`latest_load_reader`; None: `read_load`)."""
        self.worker_id, self.role, self.config, self.facts = worker_id, role, config, facts
        tracing.setup(f"splitserve-{role}", worker_id, config.otlp_endpoint)
        self.read_load = read_load
        self.beat_load = beat_load or read_load
        self.redis_url = redis_url
        self.incarnation = secrets.token_hex(8)
        self.state: WorkerState = "starting"
        self.num_late_calls = 0
        """Calls that arrived after draining began (refused UNAVAILABLE; the router tries elsewhere)."""
        self.address = ""
        self.metrics = WorkerMetrics(role, facts.model_id, read_load) if config.serve_metrics else None
        self._metrics_server = MetricsServer(
            self.metrics.registry, self.metrics.refresh,
            metrics_token(config.cluster_secret) if config.cluster_secret else None) if self.metrics else None
        self.metrics_address = ""
        self.read_step_model: Callable[[], tuple[float, float, float] | None] = lambda: None
        """Decode workers: the engine's step model (engine/core/step_model.py), for the heartbeat."""
        self.step_profile: tuple[tuple[float, float, float], ...] = ()
        """Decode workers: their start-up profile of decode steps (engine/step_profile.py)."""
        self.read_tier: Callable[[], tuple[str, TierSpeed] | None] = lambda: None
        """The id of the KV store the worker fetches from and what it measured of fetching
        (kvstore/tier.py `KVTier.heartbeat`), for the heartbeat; None: no tier."""
        self.server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.publisher = Publisher(redis_url, namespace, worker_id, self.heartbeat, config.heartbeat_interval_s,
                                   config.heartbeat_ttl_s, seal_key=registry_key(config.cluster_secret)
                                   if config.cluster_secret else None) if redis_url else None

    @property
    def service_name(self) -> str:
        return "splitserve.v1.PrefillWorker" if self.role == "prefill" else "splitserve.v1.DecodeWorker"

    async def start(self, add_servicer: Callable[[grpc.aio.Server], None]) -> str:
        """Serves on `config.host`, a free port; returns the address it advertises (`advertised_host`)."""
        self.server = grpc.aio.server(interceptors=[TokenCheck(cluster_token(self.config.cluster_secret))]
                                      if self.config.cluster_secret else None)
        add_servicer(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        port = add_member_port(self.server, f"{self.config.host}:0", self.config.tls)
        await self.server.start()
        host = self.config.advertised_host(self.redis_url)
        self.address = f"{host}:{port}"
        if self._metrics_server is not None:
            self.metrics_address = f"{host}:{await self._metrics_server.start(self.config.host)}"
        await self._health.set(self.service_name, health_pb2.HealthCheckResponse.SERVING)
        self.state = "serving"
        if self.publisher:
            self.publisher.start()
        logger.info("%s worker %s serving on %s", self.role, self.worker_id, self.address)
        return self.address

    def info(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "role": self.role, "address": self.address,
                "metrics_address": self.metrics_address, "state": self.state, "incarnation": self.incarnation,
                "pid": os.getpid(), **msgspec.structs.asdict(self.facts)}

    def publish_events(self, events: list[KVEvent]) -> None:
        if self.publisher:
            self.publisher.publish_events(events)

    def heartbeat(self) -> Heartbeat | None:
        load = self.beat_load()
        if load is None:
            return None
        store, speed = self.read_tier() or ("", TierSpeed())
        return Heartbeat(self.worker_id, self.role, self.address, self.state, self.incarnation,
                         self.facts, load, metrics_address=self.metrics_address,
                         sent_at=time.time(), step_model=list(self.read_step_model() or ()),
                         step_profile=[x for row in self.step_profile for x in row], kv_store=store, tier_speed=speed)

    def refusal(self, request_id: str, running: Container[str]) -> tuple[grpc.StatusCode, str] | None:
        """For a new call of `request_id`: None when this worker takes it, else the status to
        end it with (a request id empty or already running here is the caller's fault)."""
        if not request_id or request_id in running:
            return status_for(InvalidRequestError(f"request id {request_id!r} is empty or already running here"))
        if self.state == "serving":
            return None
        if self.state == "draining":
            self.num_late_calls += 1
        return status_for(EngineStopped(f"{self.worker_id} is {self.state}: try another worker"))

    async def drain(self, timeout_s: float, num_running: Callable[[], int]) -> int:
        """Takes no new calls (routers see `draining` in the next heartbeat; a call that still
        arrives is refused UNAVAILABLE and tried elsewhere) and waits up to `timeout_s` for the
        running ones to finish; returns how many are left (`stop` cuts them, and the router
        continues them elsewhere from the tokens already streamed)."""
        self.state = "draining"
        await self._health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        while num_running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return num_running()

    async def stop(self) -> None:
        """Draining: no new calls; running ones get `grace_s`; then the registry entry goes."""
        self.state = "draining"
        await self._health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server is not None:
            await self.server.stop(grace=self.config.grace_s)
        if self.publisher:
            self.publisher.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        tracing.shutdown()


class HostedWorker:
    """The actor surface both roles share; a role sets `loop` (its EngineLoop), `host`, the
    running calls in `_requests`, and defines `_add_servicer(server)` and `_idle_report(engine)`."""

    loop: Any
    host: WorkerHost
    _requests: dict[str, Any]
    _aio: asyncio.AbstractEventLoop | None
    _starting: asyncio.Future[None] | None = None

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def _idle_report(self, engine: Any) -> dict[str, object]:
        raise NotImplementedError

    async def start(self) -> dict[str, object]:
        """Starts the engine thread and the gRPC server; returns this worker's info. Idempotent:
        a controller restarted during a launch calls it again (and gets the same worker)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start_once())
        await asyncio.shield(self._starting)
        return self.info()

    async def _start_once(self) -> None:
        self._aio = asyncio.get_running_loop()
        self.loop.start()
        await self.host.start(self._add_servicer)

    def info(self) -> dict[str, object]:
        return self.host.info()

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """No new requests; waits for the running ones: how many were left, and how many new
        calls still arrived after draining began (refused; routers are told before)."""
        left = await self.host.drain(timeout_s, lambda: len(self._requests))
        return {"left": left, "late_calls": self.host.num_late_calls}

    async def check_idle(self) -> dict[str, object]:
        """For tests and drains: pool accounting, and what is still held."""
        return await asyncio.wrap_future(self.loop.call(self._idle_report))
