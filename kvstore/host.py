"""A host's KV store as a service: the store, its gRPC API and its entry in the cluster's Redis.

    StoreHost.start -> KVStore (shared memory) + gRPC on `host` (free port)
                    -> `{namespace}:kvstore:{host id}` = its address and store id, refreshed
                       every second (expires 5 s after the store is gone)
                    -> its `stored` / `removed` events on the KV event stream of its store id,
                       as a worker's (control/publisher.py): routers index what each store holds
    a worker (`WorkerConfig.kv_store = "local"`) -> `find_store`: the entry of its own host;
    its heartbeat names the store id, so a router prices a hit there for that worker

The same class runs as a Ray actor (the controller starts one per node that hosts workers,
`serve --kv-store-mib`) or in a plain process (`splitserve kv-store`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from control.auth import Unsealed, metrics_token, opened, registry_key, seal
from control.heartbeat import StoreEntry, store_entry, store_key
from control.redis_url import readable
from control.tls import MemberTLS, tls_of
from control.worker_config import NODE_IP, dialable_host
from kvfabric.address import local_host_id

logger = logging.getLogger(__name__)

TTL_S = 5.0
"""A store's Redis entry outlives its last refresh by this long."""


def store_id_of(host_id: str) -> str:
    """The member id a host's store publishes its KV events under (the same after a restart)."""
    return "kvstore-" + hashlib.blake2b(host_id.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class StoreConfig:
    model_dir: str
    capacity_bytes: int
    """Host memory for blocks (a shared-memory segment of this size)."""
    block_size: int = 16
    dtype: str = "float32"
    model_id: str | None = None
    """As the workers' (`WorkerConfig.model_id`): the name their block hashes are keyed with."""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 0
    cluster_secret: bytes | None = field(default=None, repr=False)
    disk_dir: str | None = None
    """A directory (on an SSD) for blocks memory evicts; None: they leave the store."""
    disk_bytes: int = 0
    disk_direct: bool = False
    """The spill file with O_DIRECT: no page cache between the store and the disk."""
    internal_tls: bool = True
    """As the workers' (`WorkerConfig.internal_tls`): mutual TLS with them."""
    given_tls: MemberTLS | None = field(default=None, repr=False)
    """As the workers' (`WorkerConfig.given_tls`)."""
    kv_transport: str | None = None
    """As the workers' (`WorkerConfig.kv_transport`): nixl offers and pushes over NIXL too."""
    quantization: str | None = None
    """As the workers' (`WorkerConfig.quantization`): their KV is named apart when it is fp8."""
    kv_cache_dtype: str = "auto"
    """As the workers' (`WorkerConfig.kv_cache_dtype`): fp8 blocks are half the bytes, named apart."""


class StoreHost:
    def __init__(self, config: StoreConfig, redis_url: str | None, namespace: str) -> None:
        self.config, self.redis_url, self.namespace = config, redis_url, namespace
        self.store: Any = None
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._stop = threading.Event()
        self._registrar: threading.Thread | None = None
        self.store_id = store_id_of(local_host_id())
        self._seal_key = registry_key(self.config.cluster_secret) if self.config.cluster_secret else None
        """Its registry entry is sealed with the cluster's key (routers and workers check it)."""
        self.publisher: Any = None
        self.metrics: Any = None
        self.metrics_address = ""

    async def start(self) -> dict[str, object]:
        """Opens the store and serves it; returns `info()` (idempotent)."""
        if self.store is not None:
            return self.info()
        from kvstore.service import open_store, serve, store_layout

        c = self.config
        host = c.host
        if host == NODE_IP:  # the workers' "the node's IP": resolved where this actor runs
            import ray

            host = ray.util.get_node_ip_address()
        advertised = c.advertise_host or dialable_host(host, self.redis_url)
        layout = store_layout(c.model_dir, c.model_id or "", c.block_size, c.dtype, c.quantization, c.kv_cache_dtype)
        tls = tls_of(c.cluster_secret, c.internal_tls, c.given_tls)
        self.store = open_store(layout, c.capacity_bytes, host, advertised, c.cluster_secret, store_id=self.store_id,
                                disk_dir=c.disk_dir, disk_bytes=c.disk_bytes, disk_direct=c.disk_direct, tls=tls,
                                kv_transport=c.kv_transport)
        self.server, port = await serve(self.store, host, c.port, c.cluster_secret, tls)
        self.address = f"{advertised}:{port}"
        from control.metrics_http import MetricsServer

        self.metrics = MetricsServer(store_registry(self.store),
                                     token=metrics_token(c.cluster_secret) if c.cluster_secret else None)
        self.metrics_address = f"{advertised}:{await self.metrics.start(host)}"
        if self.redis_url:
            from control.publisher import Publisher

            self.publisher = Publisher(self.redis_url, self.namespace, self.store_id, lambda: None,
                                       seal_key=self._seal_key)
            self.publisher.start()
            self._registrar = threading.Thread(target=self._register, name="kvstore-registrar", daemon=True)
            self._registrar.start()
        logger.info("KV store of %d blocks (%d MiB) serving on %s", self.store.capacity,
                    c.capacity_bytes >> 20, self.address)
        return self.info()

    def info(self) -> dict[str, object]:
        s = self.store
        return {"address": self.address, "store_id": self.store_id, "host_id": local_host_id(),
                "metrics_address": self.metrics_address, "capacity_blocks": s.capacity if s else 0,
                "num_blocks": s.num_blocks if s else 0, "block_bytes": s.layout.block_bytes if s else 0,
                "disk_blocks": len(s.disk) if s and s.disk else 0, "disk_capacity_blocks": s.disk.capacity if s and s.disk else 0,
                **(asdict(s.stats) if s else {})}

    async def stop(self) -> None:
        self._stop.set()
        if self._registrar is not None:
            self._registrar.join(3)
        if self.publisher is not None:
            self.publisher.stop()
        if self.server is not None:
            await self.server.stop(1)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.store is not None:
            self.store.close()

    def _register(self) -> None:
        import redis

        client = redis.Redis.from_url(readable(self.redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
        key = store_key(self.namespace, local_host_id())
        next_entry = 0.0
        try:
            while not self._stop.is_set():
                self.publisher.publish_events(self.store.take_events())  # never blocks
                if time.monotonic() >= next_entry:
                    try:  # its address, id and counters: `splitserve status` reads them here
                        entry = json.dumps(self.info()).encode()
                        client.set(key, seal(self._seal_key, key, entry) if self._seal_key else entry,
                                   px=int(TTL_S * 1000))
                        next_entry = time.monotonic() + 1.0
                    except redis.RedisError as e:
                        logger.warning("KV store: cannot register in Redis (%s); retrying", e)
                        next_entry = time.monotonic() + 1.0
                self._stop.wait(0.1)
            try:
                client.delete(key)
            except redis.RedisError:
                pass
        finally:
            client.close()


def store_registry(store: Any) -> Any:
    """The store's Prometheus registry: what it holds and has moved, read at each scrape."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class StoreCollector:
        def collect(self) -> Any:
            s, p = store.stats, "splitserve:kv_store_"
            disk = store.disk
            for name, doc, value in (("capacity_blocks", "Blocks the store can hold in memory.", store.capacity),
                                     ("blocks", "Blocks it holds in memory now.", store.num_blocks),
                                     ("disk_capacity_blocks", "Blocks its spill file can hold.",
                                      disk.capacity if disk else 0),
                                     ("disk_blocks", "Blocks in its spill file now.", len(disk) if disk else 0)):
                g = GaugeMetricFamily(p + name, doc)
                g.add_metric([], value)
                yield g
            for name, doc, value in (
                    ("offered_blocks", "Blocks workers offered.", s.num_offered),
                    ("stored_blocks", "Blocks written in (offers taken).", s.num_stored),
                    ("lookups", "Lookups of a prompt's blocks.", s.num_lookups),
                    ("hit_blocks", "Blocks lookups found.", s.num_hit_blocks),
                    ("fetched_blocks", "Blocks pushed into workers' pools.", s.num_fetched),
                    ("evicted_blocks", "Blocks evicted for room.", s.num_evicted),
                    ("bytes_in", "Bytes written in.", s.bytes_in), ("bytes_out", "Bytes pushed out.", s.bytes_out),
                    ("fetch_failures", "Fetches that failed (evicted meanwhile, a worker gone).",
                     s.num_fetch_failures),
                    ("spilled_blocks", "Blocks memory evicted into the spill file.", s.num_spilled),
                    ("unspilled_blocks", "Blocks read back from the spill file for a fetch.", s.num_unspilled)):
                c = CounterMetricFamily(p + name, doc)
                c.add_metric([], value)
                yield c

    registry = CollectorRegistry()
    registry.register(StoreCollector())  # type: ignore[arg-type]
    return registry


def read_stores(redis_url: str, namespace: str) -> list[dict[str, Any]]:
    """Every registered store's entry (`StoreHost.info()`), by store id, as shown (seals unchecked)."""
    import redis

    client = redis.Redis.from_url(readable(redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        keys = list(client.scan_iter(match=store_key(namespace, "*"), count=100))
        values = client.mget(keys) if keys else []
        return sorted((json.loads(opened(None, "", v)) for v in values if v),
                      key=lambda e: str(e.get("store_id")))
    finally:
        client.close()


def find_store(redis_url: str | None, namespace: str, timeout_s: float = 10.0,
               seal_key: bytes | None = None) -> StoreEntry | None:
    """This host's store from the cluster's Redis (waits up to `timeout_s` for one starting
    beside this worker); None: there is none. With `seal_key`, an entry not sealed with it is
    none (a worker would show the cluster's token to a store anyone can name)."""
    if not redis_url:
        return None
    import redis

    client = redis.Redis.from_url(readable(redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                raw = client.get(store_key(namespace, local_host_id()))
            except redis.RedisError:
                raw = None
            if raw:
                try:
                    return store_entry(opened(seal_key, store_key(namespace, local_host_id()), raw))
                except (Unsealed, ValueError) as e:
                    logger.warning("the KV store entry for this host is refused: %s", e)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
    finally:
        client.close()
