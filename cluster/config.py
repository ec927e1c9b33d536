"""Cluster configuration: every field documented, units in names, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import CacheConfig, DType, EngineConfig, Role, SchedulerConfig
from router.admission import AdmissionConfig
from router.policy import RoutingConfig


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker (a Ray actor)."""

    model_dir: str
    """Local checkpoint directory, readable on every node."""
    dtype: DType = "float32"
    device: str = "cpu"
    block_size: int = 16
    """Tokens per KV block; must be the same on every worker and router."""
    kv_cache_bytes: int = 256 * 2**20
    """KV pool per worker."""
    protected_fraction: float = 0.5
    """Pool share kept for cached blocks that were hit again (see `CacheConfig`); 0 is plain LRU."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    cluster_secret: bytes = b"splitserve-default-secret"
    """Key of the block hashes: the same on every worker and router, kept private."""
    num_threads: int = 1
    """torch CPU threads per worker (workers share the machine's cores)."""
    host: str = "127.0.0.1"
    """Interface the worker's gRPC and kvfabric listeners bind to."""
    kv_lease_s: float = 10.0
    """A reservation not written and renewed within this long is revoked."""
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    """A worker whose heartbeat is older than this counts as gone."""

    def __post_init__(self) -> None:
        if self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.kv_lease_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("kv_lease_s and heartbeat_interval_s must be positive")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s})")

    def engine_config(self, role: Role) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir, dtype=self.dtype, device=self.device, role=role,
            max_model_len=self.max_model_len,
            cache=CacheConfig(block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
                              protected_fraction=self.protected_fraction, cluster_secret=self.cluster_secret),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs),
        )


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Interface the public gRPC server binds to (0.0.0.0 to serve other machines)."""
    port: int = 50051
    """0 picks a free port (router replicas all join the one the first replica got)."""
    share_port: bool = False
    """Bind with SO_REUSEPORT so several router replicas on one host serve one port (the
    kernel spreads connections over them). Off for a single router, so a port already
    taken (by another splitserve too) is an error instead of a silent split."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefill_timeout_s: float = 120.0
    """Longest a prefill worker may take to return a request's first token."""
    decode_idle_timeout_s: float = 60.0
    """Longest the router waits for the next tokens of a running request."""
    index_poll_ms: int = 200
    """How long one read of the workers' KV event streams may block."""
    load_refresh_s: float = 0.5
    """How often heartbeats (KV usage, queues) are re-read from Redis."""
    grace_s: float = 5.0
    """On shutdown, running streams get this long to finish."""
    max_attempts: int = 3
    """Tries per request when a worker fails under it (died, unreachable, out of KV). A
    later try avoids the workers that failed it and continues from the tokens already
    streamed (the prompt plus those tokens is prefilled again): the client sees one stream."""
    worker_down_s: float = 10.0
    """A worker that died or was unreachable gets no new requests for this long."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.prefill_timeout_s <= 0 or self.decode_idle_timeout_s <= 0:
            raise ValueError("prefill_timeout_s and decode_idle_timeout_s must be positive")
        if self.max_attempts < 1 or self.worker_down_s < 0:
            raise ValueError(f"max_attempts must be >= 1 and worker_down_s >= 0, got {self.max_attempts}, "
                             f"{self.worker_down_s}")


@dataclass(frozen=True)
class ClusterConfig:
    worker: WorkerConfig
    num_prefill: int = 1
    num_decode: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "splitserve"
    """Prefix of every Redis key of this cluster."""
    worker_num_cpus: float = 1.0
    """Ray CPUs each worker actor asks for (GPU workers ask for one GPU instead)."""
    num_routers: int = 1
    """Router replicas; more than one share one port (see `RouterConfig.share_port`),
    each with its own admission budget and its own KV index replayed from Redis."""

    def __post_init__(self) -> None:
        if self.num_decode <= 0:
            raise ValueError(f"num_decode must be at least 1, got {self.num_decode}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be at least 1, got {self.num_routers}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.num_prefill == 0 and self.router.routing.mode == "disaggregated":
            raise ValueError("mode disaggregated needs at least one prefill worker")
