"""The controller's memory in Redis, so that a controller Ray restarts picks up where the dead one stopped.

    Controller --(end of every tick; before every launch and drain)--> save() --msgpack-->
        {ns}:controller:state (no expiry; deleted by shutdown)
    restarted Controller --> load() --> Saved --> Controller._recover (with the actors Ray
        still has by name, cluster/named_actors.py)

What is saved is what Ray cannot tell a new controller: the pool targets, the next worker
ids, each member's role, state and info (a member recorded `starting` or `draining` was
being launched or drained when the controller died), the router replicas' ports, the
autoscaler's memory and the history `status` shows. Which actors are alive is never taken
from here: Ray's names say that. Launches and drains are saved before they begin (write
ahead), so no actor exists that a restarted controller cannot account for; if Redis lost
the record too (an embedded Redis restarts empty), every named worker found is adopted.

The autoscaler's times are `time.monotonic()` in the controller; they are saved as wall
times and turned back on load, so a restart on another host reads them right.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import redis.asyncio

from cluster.named_actors import index_of, role_of
from control.autoscaler import AutoscaleState
from control.heartbeat import Role


ROLES: tuple[Role, Role] = ("prefill", "decode")


@dataclass
class Worker:
    """The controller's view of one worker actor."""

    worker_id: str
    role: Role
    actor: Any
    """Its detached actor, named `worker_id` (None for the moment between saving a launch and creating it)."""
    state: str = "starting"
    """starting -> serving -> draining (then gone)."""
    info: dict[str, Any] = field(default_factory=dict)


def state_key(ns: str) -> str:
    return f"{ns}:controller:state"


@dataclass
class Saved:
    targets: dict[str, int]
    next_ids: dict[str, int]
    members: dict[str, dict[str, Any]]
    """worker id -> {"role", "state": starting | serving | draining, "info"}."""
    routers: dict[str, Any]
    """{"ids": [...], "address": gRPC host:port, "http_address": HTTP host:port or ""}."""
    autoscale: dict[str, dict[str, float]] = field(default_factory=dict)
    """AutoscaleState's fields, each pool's time as a wall time."""
    history: dict[str, Any] = field(default_factory=dict)
    """`History.to_wire()`."""


@dataclass
class History:
    """What `status` shows of the controller's past, carried over its restarts."""

    dead: deque[str] = field(default_factory=lambda: deque(maxlen=100))
    drains: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))
    """The last finished drains: the worker, requests left to continue elsewhere, late calls."""
    actions: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    num_dead: int = 0
    num_drains: int = 0

    def act(self, what: str) -> None:
        self.actions.append(f"{time.strftime('%H:%M:%S')} {what}")

    def died(self, worker_id: str) -> None:
        self.dead.append(worker_id)
        self.num_dead += 1

    def drained(self, report: dict[str, Any]) -> None:
        self.drains.append(report)
        self.num_drains += 1

    def to_wire(self) -> dict[str, Any]:
        return {"dead": list(self.dead), "drains": list(self.drains), "actions": list(self.actions),
                "num_dead": self.num_dead, "num_drains": self.num_drains}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> History:
        h = cls(num_dead=d.get("num_dead", 0), num_drains=d.get("num_drains", 0))
        for book in ("dead", "drains", "actions"):
            getattr(h, book).extend(d.get(book, []))
        return h


Action = Literal["keep", "finish_drain", "finish_launch", "dead", "drained", "launch_lost"]


@dataclass(frozen=True)
class Step:
    """What a restarted controller does about one worker."""

    worker_id: str
    role: str
    state: str
    """As saved; "unknown" for a worker found by name alone (its record lost)."""
    info: dict[str, Any]
    action: Action
    """keep: serving, adopted as is; finish_drain: drain it again (idempotent) and stop it;
    finish_launch: call its start() again (idempotent) and serve, or drain it if it says it
    was draining; dead: its actor is gone, account it and replace it; drained: a drain that
    ended while the controller was down; launch_lost: saved, never created, launched anew."""


def plan(members: dict[str, dict[str, Any]], live: set[str]) -> list[Step]:
    """One step per worker in the saved `members` or among the `live` actor names, in id order."""
    steps = []
    for worker_id in sorted({*members, *live}):
        record = members.get(worker_id, {"role": role_of(worker_id), "state": "unknown", "info": {}})
        state = record["state"]
        if worker_id not in live:
            action: Action = {"draining": "drained", "starting": "launch_lost"}.get(state, "dead")  # type: ignore[assignment]
        else:
            action = {"serving": "keep", "draining": "finish_drain"}.get(state, "finish_launch")  # type: ignore[assignment]
        steps.append(Step(worker_id, record["role"], state, record["info"], action))
    return steps


def next_ids(saved: dict[str, int], names: list[str]) -> dict[str, int]:
    """Per role, past every id saved or seen: a new worker never takes a live one's name."""
    out = dict(saved)
    for name in names:
        if (index := index_of(name)) is not None:
            out[role_of(name)] = max(out.get(role_of(name), 0), index + 1)
    return out


def autoscale_out(state: AutoscaleState) -> dict[str, dict[str, float]]:
    shift = time.time() - time.monotonic()
    return {name: {pool: t + shift for pool, t in getattr(state, name).items()}
            for name in ("up_since", "down_since", "last_action_at")}


def autoscale_in(saved: dict[str, dict[str, float]]) -> AutoscaleState:
    shift = time.monotonic() - time.time()
    return AutoscaleState(**{name: {pool: t + shift for pool, t in saved.get(name, {}).items()}
                             for name in ("up_since", "down_since", "last_action_at")})


async def save(client: redis.asyncio.Redis, ns: str, saved: Saved) -> None:
    await client.set(state_key(ns), msgpack.packb({
        "targets": saved.targets, "next_ids": saved.next_ids, "members": saved.members, "routers": saved.routers,
        "autoscale": saved.autoscale, "history": saved.history}))


async def load(client: redis.asyncio.Redis, ns: str) -> Saved | None:
    raw = await client.get(state_key(ns))
    if raw is None:
        return None
    d = msgpack.unpackb(raw)
    return Saved(d["targets"], d["next_ids"], d["members"], d["routers"], d.get("autoscale", {}),
                 d.get("history", {}))
