"""Recovery: how a restarted controller takes its cluster back (the part of `Controller` that
talks to its own past).

    _save(): targets, next ids, members, router ports, autoscaler memory, history
        -> Redis (cluster/controller_state.py), before each launch and drain and every tick
    _recover(): (Ray restarted the actor; nobody calls start()) the saved record joined with
        the actors Ray still has by name (cluster/named_actors.py) -> `controller_state.plan`
        -> each worker kept, drained, started again, replaced, or launched anew; routers
        adopted; then supervision resumes
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import redis

from cluster import controller_state, named_actors
from cluster.controller_state import ROLES, History, Saved, Worker

if TYPE_CHECKING:
    from cluster.controller import Controller

logger = logging.getLogger(__name__)

RECOVER_TIMEOUT_S = 300.0
"""Longest a restarted controller waits for Redis before it recovers from Ray's names alone."""


class Recovery:
    async def _recover(self: Controller) -> None:
        """After a restart: the saved record and Ray's names tell which workers and routers
        run; each is adopted (a launch or drain the last controller began is finished), one
        that is gone is accounted dead and the pools are brought back to target by supervision."""
        c = self.config
        saved = await self._load_saved() or Saved(dict(self.targets), {}, {}, {}, history={})
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

    async def _load_saved(self: Controller) -> Saved | None:
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while True:
            try:
                return await controller_state.load(self.reader.client, self.config.namespace)
            except (redis.RedisError, OSError, TimeoutError) as e:
                if time.monotonic() > deadline:
                    logger.error("controller: Redis unreachable (%s); recovering from Ray's names alone", e)
                    return None
                await asyncio.sleep(1.0)

    async def _save(self: Controller) -> None:
        saved = Saved(dict(self.targets), dict(self._next),
                      {w.worker_id: {"role": w.role, "state": w.state, "info": w.info} for w in self.workers.values()},
                      self.routers.saved(), controller_state.autoscale_out(self._autoscale_state),
                      self.history.to_wire())
        try:
            await controller_state.save(self.reader.client, self.config.namespace, saved)
        except (redis.RedisError, OSError, TimeoutError) as e:
            logger.warning("controller: could not save its state (%s); recovery falls back to Ray's names", e)

