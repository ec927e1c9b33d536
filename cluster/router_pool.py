"""RouterPool: the controller's router replicas (Ray actors on the head node), started on one
shared port pair and kept at `num_routers`.

    prepare(): the replicas' actors are created while the workers start (their processes and
             imports overlap the workers' loading)
    start(): replica 0 binds the configured gRPC and HTTP ports (0: free ones), the others join
             the ports it got (SO_REUSEPORT); each replays the workers' KV event streams into
             its index before it listens
    check(): on every controller tick, a replica whose actor died is dropped and relaunched
             with the same id on the same ports (the survivors serve meanwhile); one whose
             relaunch fails is tried again on the next tick
    saved() / adopt(): what a restarted controller needs to find the replicas again (they
             are detached actors named by their ids, cluster/named_actors.py) and their ports
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import named_actors
from cluster.ray_calls import await_ref
from control.router_stats import RouterStats
from router.config import RouterConfig
from router.service import RouterService

logger = logging.getLogger(__name__)


class RouterPool:
    def __init__(self, config: RouterConfig, redis_url: str, namespace: str, act: Callable[[str], None],
                 start_timeout_s: float) -> None:
        """`act(what)`: the controller's action log."""
        self.config, self.redis_url, self.namespace, self.act = config, redis_url, namespace, act
        self.start_timeout_s = start_timeout_s
        self.actors: dict[str, Any] = {}
        """Live replicas by id; one missing from here (of `ids`) is being replaced."""
        self.ids: list[str] = []
        self.address = ""
        self.http_address = ""
        self._relaunching: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._prepared: dict[str, Any] = {}
        """Replicas created by `prepare`, not started yet."""

    def prepare(self, num_routers: int) -> None:
        """Creates the replicas' actors ahead of `start`, so their processes start and import
        while the workers load (an idle 1P+1D start here: 9.2-9.8 s before, 8.0-8.9 s); a
        replica reads nothing of the workers until `start`."""
        self._prepared = {f"router-{i}": self._actor(f"router-{i}") for i in range(num_routers)}

    async def start(self, num_routers: int, worker_ids: list[str]) -> dict[str, str]:
        """Starts the replicas, waits until each sees these workers; returns id -> address."""
        ids = [f"router-{i}" for i in range(num_routers)]
        self.actors = {i: self._prepared.pop(i) if i in self._prepared else self._actor(i) for i in ids}
        self.ids = list(self.actors)
        replicas = list(self.actors.values())
        first = await await_ref(replicas[0].start.remote(), self.start_timeout_s)
        self.http_address = (await await_ref(replicas[0].endpoints.remote(), self.start_timeout_s))["http"]
        self.address = first
        port, http_port = self._ports()  # what 0 resolved to; the other replicas join them
        addresses = [first, *await asyncio.gather(*(await_ref(r.start.remote(port, http_port), self.start_timeout_s)
                                                    for r in replicas[1:]))]
        await asyncio.gather(*(await_ref(r.await_workers.remote(worker_ids, 30.0), 40.0) for r in replicas))
        return dict(zip(self.ids, addresses, strict=True))

    def saved(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "address": self.address, "http_address": self.http_address}

    def adopt(self, saved: dict[str, Any] | None) -> None:
        """After a controller restart: the replicas still running, found by name; `check()`
        relaunches the others on the saved ports (with no record: those of a replica found)."""
        if saved is not None:
            self.ids, self.address, self.http_address = list(saved["ids"]), saved["address"], saved["http_address"]
        else:
            self.ids = [n for n in named_actors.list_names(self.namespace) if named_actors.role_of(n) == "router"]
        self.actors = {i: a for i in self.ids if (a := named_actors.find(i, self.namespace)) is not None}

    async def check(self) -> None:
        for router_id, actor in list(self.actors.items()):
            try:
                await await_ref(actor.endpoints.remote(), 10.0)
            except ray.exceptions.RayActorError:
                del self.actors[router_id]
                self.act(f"{router_id} died; replacing it")
            except (TimeoutError, ray.exceptions.RayError):
                pass  # busy or slow, not known dead
        for router_id in self.ids:
            if router_id not in self.actors and router_id not in self._relaunching:
                self._relaunching.add(router_id)
                task = asyncio.create_task(self._relaunch(router_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _relaunch(self, router_id: str) -> None:
        try:
            if not self.address:  # adopted with no record: the ports come from a live replica
                ends = await await_ref(next(iter(self.actors.values())).endpoints.remote(), 10.0)
                self.address, self.http_address = ends["grpc"], ends["http"]
            actor = self._actor(router_id)
            try:
                address = await await_ref(actor.start.remote(*self._ports()), self.start_timeout_s)
            except (TimeoutError, ray.exceptions.RayError) as e:
                ray.kill(actor)
                self.act(f"{router_id} did not start again ({type(e).__name__}); trying again on the next tick")
                return
        except (StopIteration, TimeoutError, ray.exceptions.RayError):
            self.act(f"{router_id} cannot be relaunched yet: no saved ports and no replica to ask")
            return
        finally:
            self._relaunching.discard(router_id)
        self.actors[router_id] = actor
        self.act(f"{router_id} serving again on {address}")

    async def stats(self) -> list[RouterStats]:
        """Each live replica's stats (one that just died, not yet replaced, is left out)."""
        results = await asyncio.gather(*(await_ref(r.stats.remote()) for r in self.actors.values()),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, (TimeoutError, ray.exceptions.RayError)):
                raise r
        return [r for r in results if not isinstance(r, BaseException)]

    def stop_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _ports(self) -> tuple[int, int | None]:
        port = int(self.address.rsplit(":", 1)[1])
        return port, int(self.http_address.rsplit(":", 1)[1]) if self.http_address else None

    def _actor(self, router_id: str) -> Any:
        """A replica on this (the head) node, where the public endpoint is served."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return named_actors.create(RouterService, router_id, self.namespace,
                                   {"num_cpus": 0, "scheduling_strategy": here},
                                   router_id, self.config, self.redis_url, self.namespace)
