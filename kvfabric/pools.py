"""KV pools by device, in one place, and which transport a pair of pools uses.

`kv_allocator(device, transport)` is the engine `KVAllocator` a worker's pool comes from:
shared memory on CPU (same-host senders copy straight into it), private huge pages on CPU
when the cluster's transport is nixl (NIXL writes into them at 0.82-0.87 of memcpy, into
shared memory at 0.66-0.69), a dedicated cudaMalloc on GPU (exported as a CUDA IPC handle).
`pool_region(tensor)` sees a pool as blocks of bytes for kvfabric, `exports(allocator)` is
what a receiver offers senders. `pick_transport` is the rule: same host -> `shm` (CPU) or
`cuda_ipc` (GPU, also across two GPUs of one host); other hosts -> `tcp` (CPU) or `nccl`
(GPU), never nccl within one GPU; `nixl` where forced or where the measured defaults take it
(`NIXL_FIRST`) and the receiver offers it (`offers_nixl`). `require_cupy` gives one clear error at start-up when a GPU pool cannot use
the GPU transports.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfabric.cuda import CudaIpcKVAllocator, DeviceRegion
from kvfabric.errors import FabricError, HandshakeError
from kvfabric.layout import FabricLayout
from kvfabric.region import AgentRegion, BlockRegion, ShmKVAllocator, ShmSegment

if TYPE_CHECKING:
    import torch

    from kvfabric.nixl_ranks import RankPool

    from engine.kv_connector import KVMemory
    from engine.model.kv_pool import TensorAllocator

    KVAllocator = ShmKVAllocator | CudaIpcKVAllocator | TensorAllocator


def device_kind(device: str) -> str:
    """"cpu" or "cuda" for a torch device string ("cuda:1" -> "cuda")."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"KV pools live on cpu or cuda devices, not {device!r}")
    return kind


def kv_allocator(device: str, transport: str | None = None) -> KVAllocator:
    """A receiving worker's pool allocator; `transport`: the cluster's (None: chosen per pair)."""
    if device_kind(device) == "cuda":
        require_cupy()
        return CudaIpcKVAllocator()
    if transport == "nixl":  # no shm sender: the pool in private memory (huge pages), registered with NIXL
        from engine.model.kv_pool import TensorAllocator

        return TensorAllocator()
    return ShmKVAllocator()


def pool_region(tensor: torch.Tensor) -> BlockRegion | DeviceRegion:
    return DeviceRegion.from_tensor(tensor) if tensor.device.type == "cuda" else BlockRegion.from_tensor(tensor)


@dataclass
class WorkerPools:
    """A worker's KV pools as kvfabric moves them: one per tensor-parallel rank, rank 0's the
    engine's own, the others' mapped here from what each rank exported."""

    layout: FabricLayout
    regions: list[BlockRegion | DeviceRegion | AgentRegion]
    segments: list[ShmSegment] = field(default_factory=list)
    """The further ranks' shared pools, mapped by this process (closed by `close`)."""

    def local(self, what: str) -> list[BlockRegion | DeviceRegion]:
        """The pools, each in this process's reach; FabricError naming `what` where a further
        rank's is held by its own NIXL agent (only a NIXL receiver takes those)."""
        if any(isinstance(r, AgentRegion) for r in self.regions):
            raise FabricError(f"{what} needs every rank's KV pool in this process's reach; this split worker's "
                              "further ranks hold theirs with NIXL agents of their own (it receives over nixl only)")
        return self.regions  # type: ignore[return-value]

    def close(self) -> None:
        self.regions = self.regions[:1]
        for seg in self.segments:
            seg.close()
        self.segments = []


def worker_pools(model_id: str, pool: Any, model_kv_heads: int = 0, shards: Sequence[int] = (0,),
                 further: Sequence[dict[str, Any]] = ()) -> WorkerPools:
    """`pool`: the engine's (rank 0's) KVPool; `further`: the other ranks' pools as they
    exported them (engine.follower_pools). A rank that exported none (a GPU pool) makes the
    worker's KV immovable: FabricError, saying so."""
    layout = FabricLayout.of_pool(model_id, pool.layout, model_kv_heads, tuple(shards))
    if len(further) != layout.world - 1:
        raise ValueError(f"{len(further)} further pools for {layout.world} ranks")
    segments: list[ShmSegment] = []
    own = pool_region(pool.tensor)
    regions: list[BlockRegion | DeviceRegion | AgentRegion] = [own]
    try:
        for rank, export in enumerate(further, 1):
            if export.get("shm"):
                segments.append(ShmSegment.open(export["shm"], export["nonce"], export["bytes"]))
                regions.append(BlockRegion(segments[-1].data.reshape(-1, layout.block_bytes)))
            elif export.get("nixl"):  # the rank's own agent holds it (`RankPool`): NIXL writes reach it
                theirs = AgentRegion.from_export(own.num_blocks, layout.block_bytes, export)
                if theirs.pool[1] != own.num_blocks * layout.block_bytes:
                    raise FabricError(f"tensor-parallel rank {rank}'s pool is {theirs.pool[1]} bytes, rank 0's "
                                      f"{own.num_blocks} blocks of {layout.block_bytes}")
                regions.append(theirs)
            elif export.get("nixl_error"):
                raise FabricError(f"tensor-parallel rank {rank}'s KV pool is for NIXL, which did not start there: "
                                  f"{export['nixl_error']}")
            else:
                raise FabricError(f"tensor-parallel rank {rank}'s KV pool is not in memory this worker can map (on "
                                  "GPUs a split worker prefills its own prompts: serve it with --mode colocated)")
    except BaseException:
        for seg in segments:
            seg.close()
        raise
    return WorkerPools(layout, regions, segments)


def memory_pools(memory: KVMemory) -> WorkerPools:
    """An engine's pools as its connector describes them (engine/kv_connector.py)."""
    return worker_pools(memory.model_id, memory.pool, memory.num_kv_heads, memory.shards, memory.followers)


def rank_allocator(device: str, transport: str | None = None) -> type[ShmKVAllocator] | type[RankPool] | None:
    """What a tensor-parallel worker's further ranks put their pools in, so that the worker's
    kvfabric reaches them: shared memory on CPU (mapped here); on GPUs, where the cluster's
    transport is nixl, each rank's own memory registered with a NIXL agent of its own
    (`RankPool`, which a CPU rank can take too: host memory); else None (private to the rank)."""
    from kvfabric.nixl_ranks import RankPool

    if device_kind(device) == "cpu":
        return ShmKVAllocator
    return RankPool if transport == "nixl" else None


def exports(allocator: KVAllocator | None) -> dict[str, Any]:
    """The receiver's keyword arguments for what this pool offers senders."""
    if isinstance(allocator, CudaIpcKVAllocator):
        return {"cuda_ipc_handle": allocator.ipc_handle}
    if isinstance(allocator, ShmKVAllocator):
        return {"shm": allocator.segment}
    return {}


NIXL_FIRST: dict[tuple[str, bool], bool] = {("cpu", True): False, ("cpu", False): False,
                                           ("cuda", True): False, ("cuda", False): False}
"""(device kind, same host) -> whether a receiver's `nixl` is taken before the other transports
when it offers it and no transport is forced (benchmarks/kv/kvfabric_bandwidth.py; docs/kv.md's
KV transport section has the numbers)."""


def offers_nixl(device: str, transport: str | None) -> bool:
    """Whether a receiver of a worker on `device` registers its pool with NIXL: when the
    cluster's transport is nixl, or when the defaults take nixl in some case (`NIXL_FIRST`)."""
    return transport == "nixl" or any(NIXL_FIRST[(device_kind(device), same)] for same in (True, False))


def pick_transport(src_device: str, dst_device: str, same_host: bool, offered: tuple[str, ...],
                   forced: str | None = None, same_gpu: bool = False, nixl_here: bool = False) -> str:
    """The transport from a pool on `src_device` to a receiver on `dst_device` offering `offered`
    (`same_gpu`: both pools on one GPU, where NCCL cannot join the two processes; `nixl_here`:
    this process can load NIXL)."""
    src, dst = device_kind(src_device), device_kind(dst_device)
    if src != dst:
        raise HandshakeError(f"a {src} KV pool cannot push to a receiver whose pool is on {dst}: run both "
                             "workers on the same kind of device", "device")
    local, remote = ("cuda_ipc", "nccl") if src == "cuda" else ("shm", "tcp")
    if forced == "nixl" or (forced is None and nixl_here and "nixl" in offered and NIXL_FIRST[(src, same_host)]):
        if "nixl" not in offered:
            raise HandshakeError(f"nixl needs a receiver offering it (it offers {list(offered)}: is NIXL installed "
                                 "where it runs?)", "transport")
        if not nixl_here:
            raise HandshakeError("nixl needs NIXL here: pip install nixl-cu12 (or nixl-cu13)", "transport")
        return "nixl"
    if forced is not None and forced not in (local, remote):
        raise HandshakeError(f"transport {forced!r} cannot move {src} pools (use {local}, {remote} or nixl)",
                             "transport")
    if forced == local or (forced is None and same_host and local in offered):
        if not same_host or local not in offered:
            raise HandshakeError(f"{local} needs the receiver on this host offering it (it offers {list(offered)})",
                                 "transport")
        return local
    if remote not in offered:
        raise HandshakeError(f"the receiver offers {list(offered)}, none of which reaches it from here", "transport")
    if remote == "nccl" and same_gpu:
        raise HandshakeError("nccl cannot join two processes on one GPU (NCCL refuses a communicator whose ranks "
                             "share a GPU): use cuda_ipc, with the receiver's pool exported for it", "transport")
    return remote


def require_cupy(torch_cuda: str | None = None) -> Any:
    """CuPy for the GPU transports, built for torch's CUDA major version; else one clear error."""
    try:
        import cupy
    except ImportError:
        raise FabricError("GPU KV pools move over CUDA IPC and NCCL through CuPy, which is not installed: "
                          f"pip install 'splitserve[{gpu_extra(torch_cuda)}]'") from None
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    cupy_major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    if torch_cuda is not None and cupy_major != int(torch_cuda.split(".")[0]):
        raise FabricError(f"CuPy is built for CUDA {cupy_major}, torch for CUDA {torch_cuda}: "
                          f"pip install 'splitserve[{gpu_extra(torch_cuda)}]' instead")
    return cupy


def gpu_extra(torch_cuda: str | None) -> str:
    """The pip extra whose CuPy matches torch's CUDA: `gpu` (CUDA 12) or `gpu-cu13`."""
    return "gpu-cu13" if torch_cuda is not None and torch_cuda.split(".")[0] == "13" else "gpu"
