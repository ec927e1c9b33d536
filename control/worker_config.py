"""WorkerConfig: what a prefill or decode worker reads (every field documented, units in names)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlparse

from engine.config import CacheConfig, DType, EngineConfig, Role, SchedulerConfig, SpeculativeConfig, StepFloor
from engine.checkpoints.quant_config import KV_CACHE_DTYPES
from control.tls import MemberTLS, tls_of
from kvfabric.address import route_address
from kvfabric.config import TRANSPORTS


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker (a Ray actor, or a plain process)."""

    model_dir: str
    """Local checkpoint directory or GGUF file, readable at this path on every node (each
    node converts a GGUF file into its own cache once)."""
    dtype: DType = "float32"
    quantization: str | None = None
    """"fp8": the projections quantized to FP8 at load (`EngineConfig.quantization`); None: as
    the checkpoint is."""
    kv_cache_dtype: str = "auto"
    """"fp8": the KV pool in e4m3 (`CacheConfig.kv_cache_dtype`); "auto": the model's dtype."""
    device: str = "cpu"
    block_size: int = 16
    """Tokens per KV block; must be the same on every worker."""
    kv_cache_bytes: int | None = None
    """KV pool per worker; None: sized from memory on a GPU (`gpu_memory_utilization`), 256 MiB on CPU."""
    gpu_memory_utilization: float = 0.9
    """Share of its GPU this worker may use in all (weights, activations, KV pool), as vLLM's
    flag: two workers sharing one GPU take about half each."""
    protected_fraction: float = 0.5
    """Pool share kept for cached blocks that were hit again (see `CacheConfig`); 0 is plain LRU."""
    max_num_batched_tokens: int | None = None
    """A step's token budget; None: by the device (engine/config.py `step_tokens`)."""
    max_num_seqs: int = 128
    fair_burst_tokens: int = 32768
    """How far a light tenant's burst may run ahead of a heavy tenant's backlog (`SchedulerConfig`)."""
    max_model_len: int | None = None
    model_id: str | None = None
    """Name the block hashes are keyed with; None uses the model directory's name. Set it
    when hosts reach one checkpoint by different paths."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """Key of the block hashes: the same on every worker and router of a cluster, known to
    nobody else. There is no built-in one: a local cluster generates it (`Controller`), plain
    processes read it from $SPLITSERVE_CLUSTER_SECRET_FILE or $SPLITSERVE_CLUSTER_SECRET."""
    internal_tls: bool = True
    """Mutual TLS on every connection between members (gRPC between routers, workers and KV
    stores; kvfabric tcp), with certificates each member makes from the cluster secret
    (control/tls.py). Off only on a network you trust, and on every member alike."""
    given_tls: MemberTLS | None = field(default=None, repr=False)
    """The certificate the deployment's own PKI gave this member (`control.tls.given_tls`,
    flags --tls-ca/--tls-cert/--tls-key) in place of the one made from the secret; every
    member of a cluster then trusts that CA."""
    num_threads: int = 1
    """torch CPU threads per worker (workers share the machine's cores)."""
    host: str = "127.0.0.1"
    """Interface the worker's gRPC and kvfabric listeners bind to (0.0.0.0: every one;
    `NODE_IP`: the IP of the Ray node the worker is placed on, which `serve --ray-address`
    uses unless `--worker-host` says otherwise)."""
    advertise_host: str | None = None
    """The address peers (routers, prefill workers) dial to reach this worker; None: `host`,
    or for a wildcard `host` this machine's address on its route to the cluster's Redis."""
    kv_transport: str | None = None
    """Force the KV transport of pushes (tcp, shm, cuda_ipc, nccl); None picks by host and
    device. tcp between workers on one host exercises the cross-host path."""
    kv_lease_s: float = 10.0
    """A reservation not written and renewed within this long is revoked."""
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    """A worker whose heartbeat is older than this counts as gone."""
    grace_s: float = 5.0
    """On shutdown, running calls get this long to finish."""
    serve_metrics: bool = True
    """Serve Prometheus `/metrics` on a free port of `host` (`control.worker_metrics`)."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector for this worker's trace spans (`control.tracing`); None:
    `$OTEL_EXPORTER_OTLP_ENDPOINT`, or no tracing."""
    step_profile_s: float = 2.0
    """Decode workers: at most this long, before serving, timing decode steps at batch sizes up
    to `max_num_seqs` (engine/step_profile.py), for the routers' admission wait forecast; 0: none."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding; decode workers (and colocated ones) use it, prefill workers stop
    at the first token."""
    step_floor: StepFloor | None = None
    """Hold each engine step to at least this long (an emulated accelerator, `StepFloor`):
    for measuring the control plane on a few cores, never for serving."""
    tensor_parallel: int = 1
    """Processes (GPUs) one worker's model is split across (engine/parallel/tensor_parallel.py): the
    worker and tensor_parallel - 1 child ranks (engine/parallel/tp_ranks.py). On CPU the child ranks'
    KV pools are in shared memory the worker maps, so KV moves between workers of any two
    degrees; on GPUs they stay private (a split decode worker prefills its own prompts, a
    prefill worker runs whole)."""

    kv_store: str | None = None
    """This host's shared KV tier (kvstore/): "local" finds it in the cluster's Redis (the store
    started on this host, `serve --kv-store-mib`), HOST:PORT names it; None: none. The worker
    offers the blocks its pool caches and fetches a prompt's blocks from it before computing."""

    @property
    def tls(self) -> MemberTLS | None:
        """This worker's TLS identity in its cluster (None: internal TLS off, or no secret)."""
        return tls_of(self.cluster_secret, self.internal_tls, self.given_tls)

    def advertised_host(self, redis_url: str | None) -> str:
        """Where peers reach this worker (see `advertise_host`)."""
        return self.advertise_host or dialable_host(self.host, redis_url)

    def __post_init__(self) -> None:
        if self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.kv_lease_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("kv_lease_s and heartbeat_interval_s must be positive")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s})")
        if self.kv_transport not in (None, *TRANSPORTS):
            raise ValueError(f"kv_transport must be one of {TRANSPORTS} or None, got {self.kv_transport!r}")
        if self.kv_transport == "nixl":
            from kvfabric.nixl import unavailable  # only then: it loads NIXL (and NumPy)
            if (why := unavailable()) is not None:
                raise ValueError(f"kv_transport nixl: {why}")
        if self.step_profile_s < 0:
            raise ValueError(f"step_profile_s must be >= 0, got {self.step_profile_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.device.startswith("cuda"):
            raise ValueError("--kv-cache-dtype fp8 serves on CPU workers for now: on GPUs the engine reads FP8 KV "
                             "through the Triton decode kernel, which has not run on a GPU yet (tests/gpu has the "
                             "check)")
        if self.kv_store and self.device.startswith("cuda"):
            raise ValueError("the shared KV tier moves host-memory pools (CPU workers) for now: a GPU worker "
                             "runs without --kv-store")

    def engine_config(self, role: Role) -> EngineConfig:
        """The engine of a worker that serves a router: the router detokenizes."""
        if not self.cluster_secret:
            raise ValueError(NO_SECRET)
        return EngineConfig(
            model_dir=self.model_dir, dtype=self.dtype, quantization=self.quantization, device=self.device, role=role,
            max_model_len=self.max_model_len, model_id=self.model_id, detokenize=False,
            cache=CacheConfig(block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              protected_fraction=self.protected_fraction, cluster_secret=self.cluster_secret,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, fair_burst_tokens=self.fair_burst_tokens),
            speculative=self.speculative, step_floor=self.step_floor,
        )


NO_SECRET = ("no cluster secret: set SPLITSERVE_CLUSTER_SECRET_FILE (a file only this user can read) or "
             "SPLITSERVE_CLUSTER_SECRET; every worker and router of one cluster needs the same one")


NODE_IP = "ray-node-ip"
"""`WorkerConfig.host` for "the IP Ray gives the node this worker runs on"."""


def on_this_node(config: WorkerConfig) -> WorkerConfig:
    """`config` with a `NODE_IP` host resolved where the worker runs (inside its Ray actor)."""
    if config.host != NODE_IP:
        return config
    import ray  # only a Ray actor gets NODE_IP

    return dataclasses.replace(config, host=ray.util.get_node_ip_address())


def dialable_host(host: str, redis_url: str | None) -> str:
    """`host`, or for a wildcard bind (0.0.0.0) this machine's address on its route to Redis:
    what a peer (or a Prometheus scraper) on the cluster's network dials."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return route_address(urlparse(redis_url).hostname or "127.0.0.1" if redis_url else "127.0.0.1")
