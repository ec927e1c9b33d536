"""A whole cluster on this machine: an embedded Redis server (child process), local Ray, the controller.

`LocalCluster(config).start()` is what `splitserve serve` and the integration tests
run. The Redis server is the real `redis-server` binary (Debian's package; `./dev`
installs it), started on a free loopback port with persistence off, and stopped
with the cluster.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import threading
import time
from typing import Any

import msgspec
import ray
import redis
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import named_actors
from cluster.config import ClusterConfig
from cluster.controller import START_TIMEOUT_S, Controller
from cluster.redis_server import EmbeddedRedis
from control.heartbeat import target_key
from control.redis_url import readable
from control.auth import is_loopback
from control.tls import tls_of
from kvfabric.region import sweep_dead_segments

logger = logging.getLogger(__name__)

REDIS_WATCH_INTERVAL_S = 0.5
"""How often the local cluster checks its embedded redis-server is alive."""
PROBE_TIMEOUT_S = 5.0
"""How long `problem()` waits for the controller's answer (no answer is busy, not dead)."""
LOCAL_HEADROOM_WORKERS = 4
"""Workers a local cluster can add beyond its initial pools (splitserve scale)."""
LOCAL_NODE_ATTEMPTS, LOCAL_NODE_RETRY_S = 3, 10.0
"""Tries at starting Ray's local node, and the pause between: on a loaded 2-core machine its
raylet sometimes misses Ray's 30 s start window, twice in a row right after another node
shut down (seen in this suite), and starts a minute later."""

NODE_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
"""Ray starts one idle worker process per CPU when the first driver connects, for tasks to
come; every actor of ours asks for its own runtime env (named_actors.SERVING_ENV), which an
idle worker never has, so each went unused: about 0.6 CPU-seconds and 100 MB each per start."""


class LocalCluster:
    def __init__(self, config: ClusterConfig, embedded_redis: bool = True) -> None:
        self.config = config
        self.embedded_redis = embedded_redis
        self.redis: EmbeddedRedis | None = None
        self.supervise_redis = True
        """False: a dead embedded redis-server stays dead (to keep Redis away on purpose)."""
        self.controller: Any = None
        self.info: dict[str, Any] = {}
        self._owns_ray = False
        self.redis_error: str | None = None
        """The last failure to restart the embedded redis-server (None: it runs)."""
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.num_redis_restarts = 0

    @property
    def redis_url(self) -> str:
        return self.redis.url if self.redis else self.config.redis_url

    @property
    def address(self) -> str:
        return str(self.info["address"])

    def start(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        c = self.config
        if not c.worker.cluster_secret:  # made here, once (the controller restarts with the same config)
            c = self.config = dataclasses.replace(c, worker=dataclasses.replace(
                c.worker, cluster_secret=secrets.token_bytes(32)))
        if self.embedded_redis:
            # reached beyond loopback (a Ray cluster's head), it speaks TLS as the members do
            wide = not is_loopback(c.redis_host)
            self.redis = EmbeddedRedis(host=c.redis_host, tls=tls_of(c.worker.cluster_secret,
                                                                      c.worker.internal_tls and wide,
                                                                      c.worker.given_tls))
            self._watcher = threading.Thread(target=self._watch_redis, name="redis-watch", daemon=True)
            self._watcher.start()
        try:
            if not ray.is_initialized():
                self._init_ray()
            self.controller = self._create_controller()
            self.info = ray.get(self.controller.start.remote(), timeout=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.info

    def _create_controller(self) -> Any:
        """On this (the head) node, as its routers (`address` is served where `serve` runs);
        named, owned by this process, restarted by Ray up to `controller_max_restarts` times
        with the same config (its cluster secret made in `start`)."""
        c = self.config
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        if named_actors.find(named_actors.CONTROLLER, c.namespace) is not None:
            raise RuntimeError(f"a splitserve cluster of namespace {c.namespace!r} already runs on this Ray "
                               "cluster: give this one another --namespace")
        return ray.remote(Controller).options(
            name=named_actors.CONTROLLER, namespace=named_actors.ray_namespace(c.namespace),
            max_restarts=c.controller_max_restarts, num_cpus=0, scheduling_strategy=here,
            runtime_env=named_actors.SERVING_ENV).remote(c, self.redis_url)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _init_ray(self) -> None:
        """A local Ray node; one more try when its raylet never registers or its GCS never
        writes its port file (each seen about once in a hundred Ray starts on a loaded
        2-core machine)."""
        c = self.config
        if c.ray_address:  # a cluster of many nodes: its resources are the nodes' own
            ray.init(address=c.ray_address, logging_level=logging.WARNING, configure_logging=False,
                     log_to_driver=True)
            self._owns_ray = True  # (shutdown only disconnects this driver from that cluster)
            return
        # Ray's CPUs are bookkeeping here (a worker runs one torch thread): room for the pools
        # to grow by LOCAL_HEADROOM_WORKERS (or to the autoscaler's maxima) on any machine.
        # address="local": a node of our own, even where `ray start` ran on this machine (a bare
        # ray.init() would join that cluster, or fail on the record a killed one left in /tmp/ray).
        most = c.num_prefill + c.num_decode + LOCAL_HEADROOM_WORKERS
        if c.autoscale is not None:
            most = max(most, c.autoscale.prefill_max + c.autoscale.decode_max)
        num_cpus = max(os.cpu_count() or 1, int(most * c.worker_num_cpus + 0.999))
        for attempt in range(1, LOCAL_NODE_ATTEMPTS + 1):
            try:
                ray.init(address="local", num_cpus=num_cpus, resources=self._role_resources(),
                         include_dashboard=False, logging_level=logging.WARNING, configure_logging=False,
                         log_to_driver=True, _system_config=NODE_SYSTEM_CONFIG)
                self._owns_ray = True
                return
            except Exception as e:  # Ray raises a bare Exception for this
                ray.shutdown()  # whatever half of the node did start
                if attempt == LOCAL_NODE_ATTEMPTS or not any(
                        m in str(e) for m in ("timed out during startup", "Timed out waiting for file")):
                    raise
                logger.warning("Ray's local node did not start (%s); trying again in %g s", e, LOCAL_NODE_RETRY_S)
                time.sleep(LOCAL_NODE_RETRY_S)

    def _role_resources(self) -> dict[str, float]:
        """This node offers exactly the custom resources the initial pools ask for (`role_resources`)."""
        c = self.config
        total: dict[str, float] = {}
        for role, n in (("prefill", c.num_prefill), ("decode", c.num_decode)):
            for name, amount in c.role_resources.get(role, {}).items():
                total[name] = total.get(name, 0.0) + amount * n
        return total

    def check_idle(self) -> list[dict[str, Any]]:
        return ray.get(self.controller.check_idle.remote(), timeout=60)

    def router_stats(self) -> list[dict[str, Any]]:
        """Each router replica's `RouterStats`, as a dict."""
        return [msgspec.to_builtins(s) for s in ray.get(self.controller.router_stats.remote(), timeout=60)]

    def holdings(self) -> list[str]:
        """What the cluster still holds for requests, one line each; [] when idle: every live
        worker has no request, reservation, hand-off or transfer and free + cached = total
        blocks, and every router has nothing admitted, queued or counted in flight."""
        held = []
        for r in self.check_idle():
            if r.get("dead"):
                continue
            u = r["usage"]
            busy = {k: r.get(k) for k in ("num_unfinished", "num_handed_off", "held_blocks", "num_reservations",
                                          "num_transfers", "num_streams", "num_waiters") if r.get(k)}
            if u["num_in_use"] or busy or u["num_free"] + u["num_cached"] != u["num_total"]:
                held.append(f"worker {r['worker_id']}: {u} {busy}")
        for s in self.router_stats():
            books = {k: s[k] for k in ("num_admitted", "num_queued", "inflight_tokens", "used_tokens") if s.get(k)}
            if books:
                held.append(f"router {s['router_id']}: {books}")
        return held

    def scale(self, role: str, n: int) -> None:
        """As `splitserve scale` does: the target goes through Redis; the controller takes it on its next tick."""
        client = redis.Redis.from_url(readable(self.redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            client.set(target_key(self.config.namespace, role), n, ex=60)
        finally:
            client.close()

    def controller_status(self) -> dict[str, Any]:
        """The controller's `ControllerStatus`, as a dict."""
        return msgspec.to_builtins(ray.get(self.controller.status.remote(), timeout=60))

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's info (worker_id, role, address, pid, ...) and state."""
        return ray.get(self.controller.worker_info.remote(), timeout=60)

    def problem(self) -> str | None:
        """Why the cluster cannot be kept serving any more (None while it can): its controller
        died past its restarts (its workers and routers serve on, but nothing replaces or
        scales them), or the embedded Redis cannot be restarted."""
        if self.controller is not None:
            try:
                ray.get(self.controller.status.remote(), timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.ActorUnavailableError:
                pass  # restarting
            except ray.exceptions.RayActorError as e:
                return (f"the cluster is unsupervised: the controller died past its {self.config.controller_max_restarts}"
                        f" restart(s) ({type(e).__name__}); workers and routers serve on, but none is replaced or "
                        "scaled")
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                pass  # busy, not known dead
        if self.redis_error is not None:
            return f"the cluster cannot serve: the embedded redis-server died and cannot be started again " \
                   f"({self.redis_error})"
        return None

    def kill_worker(self, worker_id: str) -> None:
        ray.get(self.controller.kill_worker.remote(worker_id), timeout=60)

    def controller_pid(self) -> int:
        return int(self.controller_status()["pid"])

    def _watch_redis(self) -> None:
        """Supervises the embedded redis-server: one that dies is started again on its port."""
        while not self._stopping.wait(REDIS_WATCH_INTERVAL_S):
            server = self.redis
            if server is None or not self.supervise_redis or server.alive():
                continue
            logger.warning("the embedded redis-server (pid %d) died; starting it again on port %d",
                           server.pid, server.port)
            try:
                server.restart()
                self.num_redis_restarts += 1
                self.redis_error = None
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                self.redis_error = str(e)
                logger.error("could not restart redis-server: %s; retrying", e)

    def stop(self) -> None:
        self._stopping.set()
        if self.controller is not None:
            try:
                ray.get(self.controller.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as e:
                logger.warning("controller shutdown failed: %s", e)
            ray.kill(self.controller)
            self.controller = None
        if ray.is_initialized():  # what a dead controller could not stop (its actors are detached)
            left = named_actors.stop_all(self.config.namespace)
            if left:
                logger.warning("stopped actors the controller left: %s", left)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        if self._watcher is not None:
            self._watcher.join(timeout=15)
            self._watcher = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        sweep_dead_segments()  # the KV pools of workers that were killed
