"""The cluster's KV stores (kvstore/host.py): one per Ray node, started by the controller.

    controller start, then every tick -> `KVStores.ensure`: each alive node without a store
    gets one (a detached actor named `kvstore-<node id>`, pinned to that node, no CPU of
    the workers' taken); it registers itself in Redis, where the node's workers find it

A store that dies loses only cached blocks: the next tick starts another, and workers
compute meanwhile (a fetch from the dead one fails, they run on without it).
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import named_actors
from cluster.ray_calls import await_ref
from kvstore.host import StoreConfig, StoreHost

logger = logging.getLogger(__name__)

PREFIX = "kvstore-"
START_TIMEOUT_S = 60.0


class KVStores:
    def __init__(self, config: StoreConfig | None, redis_url: str, namespace: str) -> None:
        """`config` None: the cluster has no KV tier."""
        self.config, self.redis_url, self.namespace = config, redis_url, namespace
        self.info: dict[str, dict[str, Any]] = {}
        """Node id -> the store's `info()` once it serves."""

    async def ensure(self) -> list[str]:
        """Starts a store on every alive node that has none; returns the nodes it started one on."""
        if self.config is None:
            return []
        started = []
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in self.info:
                continue
            name = PREFIX + node_id[:16]
            actor = named_actors.find(name, self.namespace)
            if actor is None:
                actor = named_actors.create(StoreHost, name, self.namespace, {
                    "num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)},
                    self.config, self.redis_url, self.namespace)
                started.append(node_id)
            try:
                self.info[node_id] = await await_ref(actor.start.remote(), START_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001  (one node's store: the next tick tries again)
                logger.warning("KV store on node %s did not start: %s", node_id[:16], e)
                ray.kill(actor)
        for node_id in list(self.info):  # a store whose node left, or that died: forgotten, started again
            name = PREFIX + node_id[:16]
            if named_actors.find(name, self.namespace) is None:
                del self.info[node_id]
        return started
