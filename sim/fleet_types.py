"""The simulator's configuration and records (sim/fleet.py runs them): what a fleet is made
of (`FleetConfig`), what prices its work (`Hardware`), one worker and one request as the fleet
follows them, and what a run returns."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from control.autoscaler import AutoscaleConfig
from engine.config import SchedulerConfig, SpeculativeConfig
from router.admission import AdmissionConfig
from router.policy import RoutingConfig

if TYPE_CHECKING:
    from loadgen.runner import Outcome, Run
    from loadgen.workload import WorkloadRequest
    from kvfabric.reservations import ReservationTable
    from router.loads import Booking
    from router.policy import RouteDecision
    from sim.engine_sim import SimEngine

Role = Literal["prefill", "decode"]


class Hardware(Protocol):
    """What a worker's forward pass and the wire cost (sim/cost_model.py Roofline, or the CPU fit)."""

    def step_s(self, chunks: list[tuple[int, int]], num_sampled: int | None = None) -> float: ...

    def for_worker(self) -> Callable[[list[tuple[int, int]], int | None], float]:
        """`step_s` for one worker's engine (the CPU fit's remembers the sizes that worker ran)."""

    def transfer_s(self, num_tokens: int, same_node: bool) -> float: ...

    def store_s(self, num_tokens: int) -> float:
        """Fetching `num_tokens` tokens of KV from the node's KV store into a worker's pool."""

    def disk_s(self, num_tokens: int) -> float:
        """Reading `num_tokens` tokens of KV back from the store's spill (an SSD) first."""

    @property
    def rpc_s(self) -> float:
        """From a request's arrival to its work starting on a worker (the router's hops)."""

    @property
    def hops_s(self) -> Sequence[float]:
        """Samples of the router's hops through the first token's delivery, one drawn per
        request in place of `rpc_s` (empty: `rpc_s` for all)."""

    @property
    def hop_token_s(self) -> float:
        """What the hops add per prompt token."""

    @property
    def push_token_s(self) -> float:
        """A prefill worker's own time to push one token of KV (0: the push uses no compute)."""

    @property
    def delivery_s(self) -> Sequence[Sequence[float]]:
        """Measured streams' delivery patterns, one replayed per simulated stream: its later
        tokens' offsets from their steps' ends, cyclic, the first decode token's 0 (empty:
        every token seen as its step ends)."""


@dataclass(frozen=True)
class FleetConfig:
    num_prefill: int = 4
    num_decode: int = 4
    """Prefill workers 0 (mode colocated): the decode workers prefill everything themselves."""
    num_blocks: int = 27000
    """KV blocks per worker (Roofline.kv_capacity_tokens // block_size for a GPU model)."""
    block_size: int = 16
    max_model_len: int = 131072
    kv_window: int = 0
    """The model's sliding window where every layer has one (ModelConfig.kv_window): a request
    holds at most that many keys' blocks; 0: its whole context."""
    gpus_per_worker: int = 1
    prefill_gpus_per_worker: int | None = None
    """A prefill worker's tensor-parallel degree where it differs from a decode worker's
    (`gpus_per_worker`): prefill likes a wide TP, decode many narrow replicas."""
    prefill_num_blocks: int | None = None
    """A prefill worker's KV blocks where its degree differs (None: `num_blocks`)."""
    gpus_per_node: int = 8
    """Workers fill nodes in order; P and D on one node move KV over NVLink, else the NIC."""
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(mode="disaggregated"))
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    autoscale: AutoscaleConfig | None = None
    """None: fixed pools."""
    startup_s: float = 30.0
    """A scaled-up worker serves this long after the decision (placement, weights, warm-up)."""
    heartbeat_s: float = 0.5
    kv_lease_s: float = 10.0
    kv_wait_s: float = 1.0
    """How long a request waits for a decode worker with room (RouterConfig.kv_wait_s)."""
    seed: int = 0
    kv_store_blocks: int = 0
    """Each node's shared KV store, in blocks (sim/fleet_tier.py); 0: no tier."""
    kv_store_disk_blocks: int = 0
    """Each node store's spill (an SSD), in blocks: what its memory evicts goes there."""
    speculative: SpeculativeConfig | None = None
    """Decode workers' speculative decoding (sim/engine_sim.py: the engine's own policy)."""
    spec_acceptance: float = 0.0
    """The workload's: the chance a proposal is right if all before it were."""

    def gpus(self, role: Role) -> int:
        """GPUs one worker of `role` spans (its tensor-parallel degree)."""
        return (self.prefill_gpus_per_worker or self.gpus_per_worker) if role == "prefill" else self.gpus_per_worker

    def blocks(self, role: Role) -> int:
        return (self.prefill_num_blocks or self.num_blocks) if role == "prefill" else self.num_blocks

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.gpus("prefill") + self.num_decode * self.gpus("decode")


@dataclass
class Worker:
    worker_id: str
    role: Role
    engine: SimEngine
    node: int
    created_at: float
    state: str = "starting"
    busy: bool = False
    stopped_at: float | None = None
    table: ReservationTable | None = None
    """Decode workers: the KV reservations prefill workers write into."""
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    """Calls into its engine loop made while a step ran: (function, *args), run when it ends."""
    beat: tuple[Any, Any] | None = None
    """Its last heartbeat and what it was built from (a heartbeat of the same load and state
    is the same heartbeat: most beats of a large fleet are)."""


@dataclass
class Flight:
    """One request in the fleet, as the router follows it."""

    rid: str
    item: WorkloadRequest
    outcome: Outcome
    hashes: list[bytes]
    cost_tokens: int
    admitted_at: float | None = None
    decision: RouteDecision | None = None
    booking: Booking | None = None
    reservation_id: int | None = None
    last_seen: float = 0.0
    """When the client got its last token (its step's end, moved by its delivery pattern)."""
    delivery: Sequence[float] = ()
    """The delivery pattern its stream replays (drawn at its first decode token, from a phase
    of the measured cycle drawn with it, the first decode token's offset 0)."""
    room_until: float = 0.0
    done: bool = False


@dataclass
class FleetResult:
    run: Run
    gpu_seconds: float
    actions: list[tuple[float, str]]
    """Each scale action: (virtual time, the autoscaler's reason)."""
    pool_sizes: list[tuple[float, int, int]]
    """(time, prefill workers, decode workers) after each change."""
    config: FleetConfig
    stats: dict[str, Any]
    decided: bool | None = None
    """The `SloVerdict` the run stopped at (None: it ran to its end, or had none)."""
