"""Controller: the Ray actor that creates a cluster's pools and routers and keeps the pools at their targets.

`start()` launches `num_prefill` prefill and `num_decode` decode worker actors (CPU actors
here, `gpus_per_worker` of a GPU each when the workers run on cuda), waits for them to
serve, then the router replicas (`num_routers`, sharing one port: the first binds
`router.port`, 0 for a free one, the others join the port it got), and waits until every
router has seen every worker's heartbeat (routers find workers in Redis, not from here).

Then it supervises, once per `supervise_interval_s` (`tick`):
- targets: `splitserve scale ROLE N` writes `{ns}:target:{role}` in Redis; with
  `autoscale` the policy in control/autoscaler.py sets them from heartbeats and router stats;
- routers: a replica whose actor died is replaced on the same ports (`RouterPool.check`);
- liveness: a worker whose actor is dead is forgotten (its Redis keys deleted) and, with
  `replace_dead_workers`, replaced by a new one (a new id, a fresh KV pool);
- reconcile: a pool under its target launches workers (one that cannot be placed within
  `place_timeout_s` is cancelled and reported); a pool over it drains the worker whose
  removal costs least (fewest running requests): it takes no new requests, its running
  ones finish within `drain_timeout_s` or continue elsewhere through the routers' retry,
  and only then is the actor stopped and its KV pool released;
- status: targets, every worker's state, the last actions and the autoscaler's last
  decision go to `{ns}:controller` for `splitserve status`; its own state goes to
  `{ns}:controller:state` (cluster/controller_state.py), also before each launch and drain.
Killed, it is restarted by Ray and `_recover()` takes the running workers and routers back
(detached named actors, cluster/named_actors.py) as `controller_state.plan` says.
`check_idle()` gathers every live worker's pool accounting (and lists the dead);
`kill_worker()` ends one abruptly (what a crash looks like); `shutdown()` stops the routers
first so no new work arrives, then the workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import warnings
from typing import Any

import ray
import redis
import redis.asyncio

from cluster import controller_state, named_actors
from cluster.config import ClusterConfig, RouterConfig
from cluster.controller_metrics import ControllerMetrics
from cluster.controller_recovery import StateStore
from cluster.controller_state import ROLES, History, Saved, Worker
from cluster.kv_stores import KVStores
from cluster.processes import redacted
from cluster.ray_calls import await_ref
from cluster.router_pool import RouterPool
from control.autoscaler import AutoscaleState, Decision, decide, started
from control.auth import metrics_token, registry_key
from control.heartbeat import Heartbeat, Role, controller_key, hb_key, kv_key, target_key
from control.metrics_http import MetricsServer
from control.pool_gauge import PoolGauge, removal_cost
from control.reader import RegistryReader
from control.router_stats import ControllerStatus, RouterStats, to_wire
from control.worker_config import dialable_host
from decode_worker.worker import DecodeWorker
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from kvstore.host import StoreConfig
from prefill_worker.worker import PrefillWorker

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
MAX_MANUAL_TARGET = 256
"""The largest pool `splitserve scale` may ask for (a target read from Redis past it is refused)."""


class Controller:
    def __init__(self, config: ClusterConfig, redis_url: str) -> None:
        if not config.worker.cluster_secret:  # a restart must hand its workers and routers the same one
            raise ValueError("the controller needs the cluster secret in its config (LocalCluster makes one)")
        self.config = config
        self.redis_url = redis_url
        self.targets: dict[str, int] = {"prefill": config.num_prefill, "decode": config.num_decode}
        self.workers: dict[str, Worker] = {}
        self.history = History()
        self.routers = RouterPool(self._router_config(), self.redis_url, config.namespace, self._act, START_TIMEOUT_S)
        self.stores = KVStores(self._store_config(), redis_url, config.namespace)
        """The shared KV tier's stores, one per node (`kv_store_mib`; none: no tier)."""
        self.info: dict[str, Any] = {}
        self.decision: Decision | None = None
        self._autoscale_state = AutoscaleState()
        self.gauge = PoolGauge()
        self._next = {"prefill": 0, "decode": 0}
        self._tasks: set[asyncio.Task[None]] = set()
        self._supervisor: asyncio.Task[None] | None = None
        self.reader = RegistryReader(redis_url, config.namespace, seal_key=registry_key(config.worker.cluster_secret))
        self.store = StateStore(self.reader.client, config.namespace)
        self._beats: dict[str, Heartbeat] = {}
        self.metrics = MetricsServer(ControllerMetrics(self._metrics_books).registry,
                                     token=metrics_token(config.worker.cluster_secret))
        self.metrics_address = ""
        with warnings.catch_warnings():  # Ray warns about its own use of a deprecated call here
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if restarted:  # Ray started this one after the last died: nobody calls start()
            self._spawn(self._recover())

    # -- start, and start again after a restart ------------------------------------------------
    async def _recover(self) -> None:
        """After a restart: the saved record and Ray's names tell which workers and routers
        run; each is adopted (a launch or drain the last controller began is finished), one
        that is gone is accounted dead and the pools are brought back to target by supervision."""
        c = self.config
        saved = await self.store.load() or Saved(dict(self.targets), {}, {}, {}, history={})
        names = [n for n in named_actors.list_names(c.namespace) if named_actors.role_of(n) in ROLES]
        self.targets.update(saved.targets)
        self._next = controller_state.next_ids(self._next | saved.next_ids, names)
        self._autoscale_state = controller_state.autoscale_in(saved.autoscale)
        self.history = History.from_wire(saved.history)
        for step in controller_state.plan(saved.members, set(names)):
            w = Worker(step.worker_id, step.role, named_actors.find(step.worker_id, c.namespace), step.state,
                       step.info)
            if step.action in ("keep", "finish_drain", "finish_launch"):
                self.workers[w.worker_id] = w
            if step.action == "finish_drain":
                self._spawn(self._drain(w))
            elif step.action == "finish_launch":
                w.state = "starting"
                self._spawn(self._await_serving(w, c.place_timeout_s))
            elif step.action == "dead":
                await self._forget_dead(w)
            elif step.action == "drained":
                self.history.drained({"worker_id": w.worker_id, "error": "ended while the controller was down"})
            elif step.action == "launch_lost":
                self._act(f"{w.worker_id}: its launch did not survive the controller; launching another")
        self.routers.adopt(saved.routers or None)
        self._act(f"controller restarted (pid {os.getpid()}): adopted {sorted(self.workers)}, routers "
                  f"{sorted(self.routers.actors)}")
        await self._supervise_from_now()

    async def _save(self) -> None:
        await self.store.save(Saved(
            dict(self.targets), dict(self._next),
            {w.worker_id: {"role": w.role, "state": w.state, "info": w.info} for w in self.workers.values()},
            self.routers.saved(), controller_state.autoscale_out(self._autoscale_state), self.history.to_wire()))

    async def start(self) -> dict[str, Any]:
        c = self.config
        left = named_actors.stop_all(c.namespace, keep=(named_actors.CONTROLLER,))
        if left:  # its controller is gone (ours has the name now): a serve that was killed
            self._act(f"stopped {len(left)} actor(s) an earlier cluster of namespace {c.namespace!r} left: {left}")
        self.routers.prepare(c.num_routers)  # their processes start beside the workers'
        await self.stores.ensure()  # before the workers, which look for their node's store as they start
        await asyncio.gather(*(self._launch(role, START_TIMEOUT_S) for role in ROLES for _ in range(self.targets[role])))
        short = {r: self.targets[r] - len(self._live(r)) for r in ROLES if len(self._live(r)) < self.targets[r]}
        if short:
            raise RuntimeError(f"workers did not start: {short} short; last actions: {list(self.history.actions)}")
        routers = await self.routers.start(c.num_routers, list(self.workers))
        self.info = {"address": self.routers.address, "http_address": self.routers.http_address, "routers": routers,
                     "prefill": [w.info for w in self._live("prefill")], "decode": [w.info for w in self._live("decode")],
                     "mode": c.router.routing.mode, "redis_url": self.redis_url}
        await self._supervise_from_now()
        logger.info("cluster up: %s", {**self.info, "redis_url": redacted(self.redis_url)})  # no password in logs
        return self.info

    async def _supervise_from_now(self) -> None:
        c = self.config
        host = c.router.host if c.router.metrics_port is not None else None
        if host is not None:  # on the routers' interface, a free port (`splitserve metrics-targets` lists it)
            self.metrics_address = f"{dialable_host(host, self.redis_url)}:{await self.metrics.start(host)}"
        await self._publish()  # `status` and `metrics-targets` find it at once
        self._supervisor = asyncio.create_task(self._supervise())

    def _router_config(self) -> RouterConfig:
        c = self.config
        return dataclasses.replace(c.router, share_port=c.num_routers > 1,
                                   tokenizer_dir=c.router.tokenizer_dir or str(resolve_model_dir(c.worker.model_dir)),
                                   cluster_secret=c.worker.cluster_secret, internal_tls=c.worker.internal_tls,
                                   given_tls=c.worker.given_tls)

    def _store_config(self) -> StoreConfig | None:
        c, w = self.config, self.config.worker
        if not c.kv_store_mib:
            return None
        return StoreConfig(w.model_dir, c.kv_store_mib << 20, w.block_size, w.dtype, w.model_id,
                           w.host, w.advertise_host, cluster_secret=w.cluster_secret, disk_dir=c.kv_store_dir,
                           disk_bytes=int(c.kv_store_disk_gib * 2**30), disk_direct=c.kv_store_direct_io,
                           internal_tls=w.internal_tls, given_tls=w.given_tls, kv_transport=w.kv_transport,
                           quantization=w.quantization, kv_cache_dtype=w.kv_cache_dtype)

    def _worker_options(self, role: Role) -> dict[str, Any]:
        c = self.config
        ranks = c.decode_tp if role == "decode" else c.prefill_tp  # a split worker's processes: one GPU (or CPU share) each
        opts: dict[str, Any] = ({"num_gpus": c.gpus_per_worker * ranks, "num_cpus": 1}
                                if c.worker.device.startswith("cuda") else {"num_cpus": c.worker_num_cpus * ranks})
        if c.role_resources.get(role):
            opts["resources"] = dict(c.role_resources[role])
        return opts

    async def _launch(self, role: Role, timeout_s: float) -> None:
        """Starts one worker; one that is not serving within `timeout_s` (not placed, or failed) is cancelled."""
        worker_id = f"{role}-{self._next[role]}"
        self._next[role] += 1
        w = self.workers[worker_id] = Worker(worker_id, role, None)
        await self._save()  # before the actor exists: a restarted controller looks for it by name
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        worker = dataclasses.replace(self.config.worker, tensor_parallel=self.config.decode_tp if role == "decode"
                                     else self.config.prefill_tp,
                                     kv_store="local" if self.config.kv_store_mib else self.config.worker.kv_store)
        launched = time.monotonic()
        w.actor = named_actors.create(cls, worker_id, self.config.namespace, self._worker_options(role),
                                      worker_id, worker, self.redis_url, self.config.namespace)
        await self._await_serving(w, timeout_s)
        if w.state == "serving":  # the forecast reads as far ahead as a launch takes here
            self._autoscale_state = started(self._autoscale_state, time.monotonic() - launched)

    async def _await_serving(self, w: Worker, timeout_s: float) -> None:
        """Its `start()` (idempotent: a restarted controller calls it again on a worker it finds starting)."""
        worker_id, role, actor = w.worker_id, w.role, w.actor
        try:
            w.info = await await_ref(actor.start.remote(), timeout_s)
        except (TimeoutError, ray.exceptions.RayError) as e:
            ray.kill(actor)
            self.workers.pop(worker_id, None)
            self.targets[role] = max(self.targets[role] - 1, 1 if role == "decode" else 0)  # undone, not retried forever
            why = f"not serving within {timeout_s:.0f} s" if isinstance(e, TimeoutError) else type(e).__name__
            self._act(f"cancelled {worker_id}: {why} (it may need resources no node has); {role} target "
                      f"back to {self.targets[role]}")
            return
        if w.info.get("state") == "draining":  # a drain the last controller began
            self._spawn(self._drain(w))
            return
        w.state = "serving"
        with contextlib.suppress(TimeoutError, ray.exceptions.RayError):
            w.info["node_id"] = await await_ref(actor.__ray_call__.remote(_node_id))
        self._act(f"{worker_id} serving at {w.info.get('address')}")

    # -- supervision -------------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.config.supervise_interval_s)
            try:
                await self.tick()
            except Exception:  # a bug or Redis away: log, keep supervising
                logger.exception("controller tick failed")

    async def tick(self) -> None:
        try:
            self._beats = await self.reader.heartbeats()
            await self._read_manual_targets()
        except (redis.RedisError, OSError, TimeoutError) as e:
            logger.warning("controller: Redis unavailable (%s); supervising from the last view", e)
        await self._check_liveness()
        await self.routers.check()
        for node in await self.stores.ensure():
            self._act(f"started a KV store on node {node[:16]}")
        if self.config.autoscale is not None:
            await self._autoscale()
        self._reconcile()
        await self._publish()

    async def _read_manual_targets(self) -> None:
        for role in ROLES:
            value = await self.reader.client.getdel(target_key(self.config.namespace, role))
            if value is None:
                continue
            text = value.decode("ascii", "replace")[:20] if isinstance(value, bytes) else str(value)[:20]
            if not text.isdigit() or int(text) > MAX_MANUAL_TARGET:  # whoever wrote it, not a pool size we run
                logger.warning("controller: %s target %r from Redis refused (an integer up to %d)", role, text,
                               MAX_MANUAL_TARGET)
                continue
            n = max(int(text), 1 if role == "decode" else 0)
            self._act(f"{role} target {self.targets[role]} -> {n} (splitserve scale)")
            self.targets[role] = n

    async def _check_liveness(self) -> None:
        serving = [w for w in self.workers.values() if w.state == "serving"]
        alive = await asyncio.gather(*(self._alive(w) for w in serving))
        for w, ok in zip(serving, alive, strict=True):
            if not ok:
                await self._forget_dead(w)

    @staticmethod
    async def _alive(w: Worker) -> bool:
        try:
            await await_ref(w.actor.info.remote(), 10.0)
        except ray.exceptions.RayActorError:
            return False
        except (TimeoutError, ray.exceptions.RayError):
            return True  # busy or slow, not known dead: routers' heartbeat TTL and retries cover it
        return True

    async def _forget_dead(self, w: Worker) -> None:
        self.workers.pop(w.worker_id, None)
        self.history.died(w.worker_id)
        if not self.config.replace_dead_workers:
            self.targets[w.role] = max(self.targets[w.role] - 1, 0)
        self._act(f"{w.worker_id} died" + ("; replacing it" if self.config.replace_dead_workers else ""))
        try:  # its heartbeat would expire anyway; its KV event stream would not
            await self.reader.client.delete(hb_key(self.config.namespace, w.worker_id),
                                            kv_key(self.config.namespace, w.worker_id))
        except (redis.RedisError, OSError, TimeoutError):
            pass

    def _reconcile(self) -> None:
        for role in ROLES:
            live = self._live(role)
            for _ in range(self.targets[role] - len(live)):
                self._spawn(self._launch(role, self.config.place_timeout_s))
            draining = [w for w in self.workers.values() if w.role == role and w.state == "draining"]
            serving = [w for w in live if w.state == "serving"]
            if len(live) > self.targets[role] and not draining and serving:
                self._spawn(self._drain(min(serving, key=self._cost)))

    def _cost(self, w: Worker) -> tuple[int, int, str]:
        return removal_cost(w.worker_id, self._beats.get(w.worker_id))

    async def _drain(self, w: Worker) -> None:
        """Routers first (no new requests), then the worker (finish or hand back the running
        ones), then the actor and its KV pool."""
        w.state = "draining"
        self._act(f"draining {w.worker_id}")
        await self._save()  # a restarted controller finishes this drain
        await asyncio.gather(*(_quietly(r.drain_worker.remote(w.worker_id)) for r in self.routers.actors.values()))
        timeout_s = self.config.drain_timeout_s
        try:
            report = dict(await await_ref(w.actor.drain.remote(timeout_s), timeout_s + 10.0))
        except (TimeoutError, ray.exceptions.RayError) as e:
            report = {"error": type(e).__name__}
        await _quietly(w.actor.shutdown.remote())
        ray.kill(w.actor)
        self.workers.pop(w.worker_id, None)
        self.history.drained({"worker_id": w.worker_id, **report})
        left = report.get("left")
        self._act(f"{w.worker_id} drained and stopped" + (f"; {left} request(s) continued elsewhere" if left else ""))
        await self._save()

    def _live(self, role: str) -> list[Worker]:
        """Workers that count toward the pool's target (starting or serving)."""
        return [w for w in self.workers.values() if w.role == role and w.state in ("starting", "serving")]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _act(self, what: str) -> None:
        logger.info("controller: %s", what)
        self.history.act(what)

    # -- autoscaling -----------------------------------------------------------------------------
    async def _autoscale(self) -> None:
        config = self.config.autoscale
        assert config is not None
        routers = await self.reader.router_stats() if self.routers.actors else {}
        members = [(w.worker_id, w.role, w.state) for w in self.workers.values()]
        self.decision = decide(self.gauge.snapshot(members, self._beats, routers), self._autoscale_state,
                               time.monotonic(), config)
        self._autoscale_state = self.decision.state
        for role in ROLES:
            if self.decision.target(role) != self.targets[role]:  # type: ignore[arg-type]
                self._act(f"autoscaler: {self.decision.reason}")
                self.targets[role] = self.decision.target(role)  # type: ignore[arg-type]

    async def _publish(self) -> None:
        try:
            await self.reader.client.set(controller_key(self.config.namespace), to_wire(await self.status()),
                                         px=10_000)
        except (redis.RedisError, OSError, TimeoutError):
            pass
        await self._save()  # (again each tick: an embedded Redis that restarted empty has it back)

    # -- for `status`, tests and the local cluster ----------------------------------------------------
    async def check_idle(self) -> list[dict[str, Any]]:
        async def one(w: Worker) -> dict[str, Any]:
            try:
                return dict(await await_ref(w.actor.check_idle.remote()))
            except ray.exceptions.RayActorError:
                return {"worker_id": w.worker_id, "dead": True}

        live = [w for w in self.workers.values() if w.state == "serving"]
        return [*await asyncio.gather(*(one(w) for w in live)), *({"worker_id": w, "dead": True} for w in self.history.dead)]

    async def status(self) -> ControllerStatus:
        """What `splitserve status` shows (published to Redis every tick)."""
        h = self.history
        return ControllerStatus(targets=dict(self.targets),
                                workers={w.worker_id: w.state for w in self.workers.values()}, dead=list(h.dead), drains=list(h.drains), num_drains=h.num_drains,
                                actions=list(h.actions), decision=self.decision.reason if self.decision else None,
                                autoscale=self.config.autoscale is not None, metrics_address=self.metrics_address,
                                pid=os.getpid())

    def _metrics_books(self) -> dict[str, Any]:
        return {"targets": dict(self.targets), "workers": [(w.role, w.state) for w in self.workers.values()],
                "num_dead": self.history.num_dead, "num_drains": self.history.num_drains}

    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker the controller runs: its info (address, pid, model facts) and state."""
        return [{"worker_id": w.worker_id, "role": w.role, **w.info, "state": w.state} for w in self.workers.values()]

    def kill_worker(self, worker_id: str) -> None:
        """Ends the worker's process at once, as a crash would (no shutdown, no clean-up)."""
        w = self.workers.get(worker_id)
        if w is None:
            raise KeyError(f"no worker {worker_id!r}")
        ray.kill(w.actor, no_restart=True)

    async def router_stats(self) -> list[RouterStats]:
        return await self.routers.stats()

    async def shutdown(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.routers.stop_tasks()
        for r in self.routers.actors.values():
            await _quietly(r.shutdown.remote())
        for w in list(self.workers.values()):
            if w.actor is not None:
                await _quietly(w.actor.shutdown.remote())
        for a in [*self.routers.actors.values(), *(w.actor for w in self.workers.values() if w.actor is not None)]:
            ray.kill(a)
        named_actors.stop_all(self.config.namespace, keep=(named_actors.CONTROLLER,))
        with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
            await self.reader.client.delete(controller_state.state_key(self.config.namespace))
        await self.metrics.stop()
        await self.reader.close()


def _node_id(_actor: Any) -> str:
    """Runs inside a worker actor: the Ray node it was placed on."""
    return str(ray.get_runtime_context().get_node_id())


async def _quietly(ref: Any) -> None:
    try:
        await await_ref(ref, 10.0)
    except (TimeoutError, ray.exceptions.RayError) as e:
        logger.warning("shutdown step failed: %s", e)
