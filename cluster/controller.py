"""Controller: the Ray actor that creates a cluster's pools and router and answers for them.

`start()` creates N prefill and M decode worker actors (CPU actors here, `gpus_per_worker`
of a GPU each when the worker's device is cuda), waits for them to load the model and serve, then the
router replicas (`num_routers`, sharing one port: the first binds `router.port`, 0 for
a free one, and the others join the port it got), and waits until every router has
seen every worker's heartbeat in Redis (routers find workers there, not from here). `check_idle()` gathers every worker's
pool accounting (tests assert nothing leaked; a dead worker reports `dead`);
`kill_worker()` ends one abruptly (what a crash looks like to the rest); `shutdown()`
stops the routers first so no new work arrives, then the workers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import ray

from cluster.config import ClusterConfig, RouterConfig
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.service import RouterService

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 30.0


async def await_ref(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """Await a Ray ObjectRef with a timeout (Ray's own await has none)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


class Controller:
    def __init__(self, config: ClusterConfig, redis_url: str) -> None:
        self.config = config
        self.redis_url = redis_url
        self.prefills: dict[str, Any] = {}
        self.decodes: dict[str, Any] = {}
        self.routers: dict[str, Any] = {}
        self.info: dict[str, Any] = {}

    def _worker_options(self) -> dict[str, Any]:
        if self.config.worker.device.startswith("cuda"):
            return {"num_gpus": self.config.gpus_per_worker, "num_cpus": 1}
        return {"num_cpus": self.config.worker_num_cpus}

    async def start(self) -> dict[str, Any]:
        c = self.config
        opts = self._worker_options()
        P, D, R = ray.remote(PrefillWorker), ray.remote(DecodeWorker), ray.remote(RouterService)
        self.prefills = {f"prefill-{i}": P.options(**opts).remote(f"prefill-{i}", c.worker, self.redis_url, c.namespace)
                         for i in range(c.num_prefill)}
        self.decodes = {f"decode-{i}": D.options(**opts).remote(f"decode-{i}", c.worker, self.redis_url, c.namespace)
                        for i in range(c.num_decode)}
        workers = {**self.prefills, **self.decodes}
        infos = await asyncio.gather(*(await_ref(w.start.remote(), START_TIMEOUT_S) for w in workers.values()))
        self.routers = {f"router-{i}": R.options(num_cpus=0).remote(f"router-{i}", self._router_config(),
                                                                   self.redis_url, c.namespace)
                        for i in range(c.num_routers)}
        replicas = list(self.routers.values())
        first = await await_ref(replicas[0].start.remote(), START_TIMEOUT_S)
        port = int(first.rsplit(":", 1)[1])  # what port 0 resolved to; the other replicas join it
        addresses = [first, *await asyncio.gather(*(await_ref(r.start.remote(port), START_TIMEOUT_S)
                                                    for r in replicas[1:]))]
        await asyncio.gather(*(await_ref(r.await_workers.remote(list(workers), 30.0), 40.0) for r in replicas))
        prefill_info = [i for i in infos if i["role"] == "prefill"]
        decode_info = [i for i in infos if i["role"] == "decode"]
        self.info = {"address": addresses[0], "routers": dict(zip(self.routers, addresses, strict=True)),
                     "prefill": list(prefill_info), "decode": list(decode_info),
                     "mode": c.router.routing.mode, "redis_url": self.redis_url}
        logger.info("cluster up: %s", self.info)
        return self.info

    def _router_config(self) -> RouterConfig:
        c = self.config
        return dataclasses.replace(c.router, share_port=c.num_routers > 1,
                                   tokenizer_dir=c.router.tokenizer_dir or c.worker.model_dir,
                                   cluster_secret=c.worker.cluster_secret)

    async def check_idle(self) -> list[dict[str, Any]]:
        async def one(worker_id: str, actor: Any) -> dict[str, Any]:
            try:
                return dict(await await_ref(actor.check_idle.remote()))
            except ray.exceptions.RayActorError:
                return {"worker_id": worker_id, "dead": True}

        workers = {**self.prefills, **self.decodes}
        return list(await asyncio.gather(*(one(w, a) for w, a in workers.items())))

    def kill_worker(self, worker_id: str) -> None:
        """Ends the worker's process at once, as a crash would (no shutdown, no clean-up)."""
        actor = self.prefills.get(worker_id) or self.decodes.get(worker_id)
        if actor is None:
            raise KeyError(f"no worker {worker_id!r}")
        ray.kill(actor, no_restart=True)

    async def router_stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(await_ref(r.stats.remote()) for r in self.routers.values())))

    async def shutdown(self) -> None:
        for r in self.routers.values():
            await _quietly(r.shutdown.remote())
        for w in [*self.prefills.values(), *self.decodes.values()]:
            await _quietly(w.shutdown.remote())
        for a in [*self.routers.values(), *self.prefills.values(), *self.decodes.values()]:
            ray.kill(a)


async def _quietly(ref: Any) -> None:
    try:
        await await_ref(ref, 10.0)
    except (TimeoutError, ray.exceptions.RayError) as e:
        logger.warning("shutdown step failed: %s", e)
