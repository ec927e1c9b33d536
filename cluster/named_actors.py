"""A cluster's actors in Ray, by name: how they outlive the controller that launched them.

Every worker and router replica is a *detached* named actor in the cluster's own Ray
namespace (`ray_namespace`, one per `ClusterConfig.namespace`): its lifetime is not tied to
the controller's (a non-detached actor dies with its owner), so a controller that is killed
and restarted by Ray finds them again by name (`find`, `list_names`) and supervises them on.
The cost of detaching is that the cluster must end them itself: the controller's `shutdown`
stops those it knows, and `stop_all` (what `LocalCluster.stop` runs last, and what a new
cluster runs on a namespace whose controller is gone) ends whatever named actor is left.

The controller itself is named `CONTROLLER` in the same namespace and owned by the driver
(`serve`): the cluster lives as long as the `serve` that started it.
"""
from __future__ import annotations

import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)

CONTROLLER = "controller"


def ray_namespace(namespace: str) -> str:
    """The Ray namespace of the cluster whose Redis keys start with `namespace`."""
    return f"splitserve-{namespace}"


def role_of(name: str) -> str:
    """`prefill-3` -> `prefill`; `router-0` -> `router`."""
    return name.rsplit("-", 1)[0]


def index_of(name: str) -> int | None:
    """`prefill-3` -> 3; None for a name without a number."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


SERVING_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}
"""Ray starts its worker processes at niceness 15 (its `RAY_worker_niceness`), for batch
tasks that should yield to everything else. Ours serve requests: at 15, any process on the
host at the default priority takes the cores first (two busy loops beside a cluster held its
actors to a few per cent of the CPU, and it took minutes to start). Ray's own job supervisor
asks for 0 the same way."""


def create(cls: type, name: str, namespace: str, options: dict[str, Any], *args: Any) -> Any:
    """A detached actor named `name` in the cluster's namespace, at the default priority."""
    return ray.remote(cls).options(name=name, namespace=ray_namespace(namespace), lifetime="detached",
                                   runtime_env=SERVING_ENV, **options).remote(*args)


def find(name: str, namespace: str) -> Any | None:
    """The live (or restarting) actor of that name, else None."""
    try:
        return ray.get_actor(name, namespace=ray_namespace(namespace))
    except ValueError:
        return None


def list_names(namespace: str) -> list[str]:
    """Every named actor of this cluster (workers, routers and the controller)."""
    ns = ray_namespace(namespace)
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns)


def stop_all(namespace: str, keep: tuple[str, ...] = ()) -> list[str]:
    """Kills every named actor of this cluster but `keep`; returns their names (their shared
    memory is swept on this node by `kvfabric.region.sweep_dead_segments`)."""
    killed = []
    for name in list_names(namespace):
        if name in keep:
            continue
        actor = find(name, namespace)
        if actor is not None:
            ray.kill(actor, no_restart=True)
            killed.append(name)
    return killed
