"""ClusterConfig: how `cluster` wires pools and routers (each role's own config lives with it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from control.autoscaler import AutoscaleConfig
from control.worker_config import WorkerConfig
from router.config import RouterConfig

__all__ = ["ClusterConfig", "RouterConfig", "WorkerConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    worker: WorkerConfig
    num_prefill: int = 1
    num_decode: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_host: str = "127.0.0.1"
    """Interface the embedded Redis binds (`LocalCluster`): on a Ray cluster's head, its private
    address or 0.0.0.0, so that workers on other nodes reach it (it always requires a password)."""
    namespace: str = "splitserve"
    """Prefix of every Redis key of this cluster."""
    worker_num_cpus: float = 1.0
    """Ray CPUs each worker actor asks for on CPU (GPU workers ask for one CPU and `gpus_per_worker`)."""
    gpus_per_worker: float = 1.0
    """Ray GPUs each worker actor asks for when the workers run on cuda; a fraction lets
    workers share a GPU (see `engine.model.devices.default_gpus_per_worker`)."""
    replace_dead_workers: bool = True
    """The controller replaces a worker whose actor died (a new id, a fresh KV pool); off, a
    dead worker lowers its pool's target instead."""
    supervise_interval_s: float = 1.0
    """How often the controller checks liveness, targets and the autoscaler."""
    drain_timeout_s: float = 30.0
    """Scale-down: how long a draining worker's running requests may take before the rest
    continue on other workers (through the routers' retry, from the tokens already streamed)."""
    place_timeout_s: float = 300.0
    """A new worker not serving within this long (Ray could not place it) is cancelled and reported."""
    role_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    """Extra Ray resources per role's actors, e.g. {"prefill": {"prefill": 1}}, so that on a
    real cluster the Ray autoscaler provisions the right node type."""
    ray_address: str | None = None
    """Join this Ray cluster ("auto": the one this host belongs to, or head HOST:PORT) instead
    of starting a private local Ray node."""
    autoscale: AutoscaleConfig | None = None
    """None: pools stay at their targets (`num_prefill`, `num_decode`, `splitserve scale`)."""
    controller_max_restarts: int = 10
    """Times Ray restarts a controller that died (its workers and routers serve on meanwhile;
    the new one adopts them, cluster/controller_state.py); past them `serve` says the cluster
    can no longer be supervised."""
    decode_tp: int = 1
    """Tensor-parallel degree of each decode worker: its model split across this many
    processes (GPUs), Ray giving it as many GPUs (engine/parallel/tensor_parallel.py)."""
    prefill_tp: int = 1
    """The same for each prefill worker. Degrees may differ: each rank of a prefill worker
    pushes its KV heads into the decode ranks that hold them (kvfabric's `HeadMap`); on GPUs
    a split worker's ranks keep their pools private, so there a split decode worker prefills
    its own prompts (mode colocated) and prefill workers run whole."""
    kv_store_mib: int = 0
    """Host memory of the shared KV tier's store on each node (kvstore/): blocks a worker's pool
    evicts live on there, and any worker of the node fetches them instead of computing them
    again; 0: no tier. CPU workers only for now."""
    kv_store_dir: str | None = None
    """A directory (an SSD) where each node's store spills the blocks its memory evicts."""
    kv_store_disk_gib: float = 0.0
    """How much of `kv_store_dir` a store may fill."""
    kv_store_direct_io: bool = False
    """The spill file with O_DIRECT (no page cache): benchmarks/kv/kv_tier_fetch.py compares."""
    num_routers: int = 1
    """Router replicas; more than one share one port (see `RouterConfig.share_port`),
    each with its own admission budget and its own KV index replayed from Redis."""

    def __post_init__(self) -> None:
        if self.num_decode <= 0:
            raise ValueError(f"num_decode must be at least 1, got {self.num_decode}")
        if self.controller_max_restarts < 0:
            raise ValueError(f"controller_max_restarts must be >= 0, got {self.controller_max_restarts}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be at least 1, got {self.num_routers}")
        if min(self.supervise_interval_s, self.drain_timeout_s, self.place_timeout_s) <= 0:
            raise ValueError("supervise_interval_s, drain_timeout_s and place_timeout_s must be positive")
        if not 0 < self.gpus_per_worker <= 8:
            raise ValueError(f"gpus_per_worker must be in (0, 8], got {self.gpus_per_worker}")
        if min(self.decode_tp, self.prefill_tp) < 1:
            raise ValueError(f"decode_tp and prefill_tp must be at least 1, got {self.decode_tp}, {self.prefill_tp}")
        if self.worker.device.startswith("cuda") and (self.prefill_tp > 1 or (
                self.decode_tp > 1 and self.router.routing.mode != "colocated")):
            raise ValueError("on GPUs a split worker's KV moves within it only: --decode-tp above 1 needs --mode "
                             "colocated, and --prefill-tp stays 1 (on CPU both split, at any degrees)")
        if self.kv_store_mib < 0:
            raise ValueError(f"kv_store_mib must be >= 0, got {self.kv_store_mib}")
        if (self.kv_store_dir is None) != (self.kv_store_disk_gib <= 0) or (self.kv_store_dir and not self.kv_store_mib):
            raise ValueError("a store's spill needs --kv-store-dir and a positive --kv-store-disk-gib, beside "
                             "--kv-store-mib")
        if self.kv_store_direct_io and not self.kv_store_dir:
            raise ValueError("--kv-store-direct-io is how the spill file is read and written: it needs --kv-store-dir")
        if self.kv_store_mib and self.worker.device.startswith("cuda"):
            raise ValueError("the shared KV tier (--kv-store-mib) moves host-memory pools: CPU workers only for now")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.num_prefill == 0 and self.router.routing.mode == "disaggregated":
            raise ValueError("mode disaggregated needs at least one prefill worker")
