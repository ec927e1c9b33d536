"""Which transport a pair of KV pools uses, and the one place pools are allocated by device."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.errors import HandshakeError
from kvfabric.pools import NIXL_FIRST, device_kind, exports, gpu_extra, kv_allocator, offers_nixl, pick_transport
from kvfabric.region import ShmKVAllocator

CPU_OFFER = ("shm", "tcp")
GPU_OFFER = ("cuda_ipc", "nccl")


@pytest.mark.parametrize(("src", "dst", "same_host", "offered", "want"), [
    ("cpu", "cpu", True, CPU_OFFER, "shm"),
    ("cpu", "cpu", False, CPU_OFFER, "tcp"),  # another host: its shared memory is out of reach
    ("cpu", "cpu", True, ("tcp",), "tcp"),  # a receiver whose pool is not in shared memory
    ("cuda", "cuda", True, GPU_OFFER, "cuda_ipc"),
    ("cuda:1", "cuda:0", True, GPU_OFFER, "cuda_ipc"),  # two GPUs of one host
    ("cuda", "cuda", False, GPU_OFFER, "nccl"),
    ("cuda", "cuda", True, ("nccl",), "nccl"),  # a device pool not exported for IPC
])
def test_the_transport_follows_host_identity_and_device(src: str, dst: str, same_host: bool,
                                                         offered: tuple[str, ...], want: str) -> None:
    assert pick_transport(src, dst, same_host, offered) == want


@pytest.mark.parametrize(("src", "dst", "same_host", "offered", "forced", "field", "match"), [
    ("cpu", "cuda", True, GPU_OFFER, None, "device", "cpu KV pool cannot push to a receiver whose pool is on cuda"),
    ("cuda", "cpu", True, CPU_OFFER, None, "device", "same kind of device"),
    ("cpu", "cpu", False, CPU_OFFER, "shm", "transport", "shm needs the receiver on this host"),
    ("cuda", "cuda", False, GPU_OFFER, "cuda_ipc", "transport", "cuda_ipc needs the receiver on this host"),
    ("cuda", "cuda", True, GPU_OFFER, "tcp", "transport", "'tcp' cannot move cuda pools"),
    ("cpu", "cpu", False, ("shm",), None, "transport", "none of which reaches it"),
])
def test_impossible_pairs_are_refused_with_a_reason(src: str, dst: str, same_host: bool, offered: tuple[str, ...],
                                                    forced: str | None, field: str, match: str) -> None:
    with pytest.raises(HandshakeError, match=match) as e:
        pick_transport(src, dst, same_host, offered, forced)
    assert e.value.field == field


def test_forcing_the_remote_transport_on_one_host_is_allowed() -> None:
    assert pick_transport("cpu", "cpu", True, CPU_OFFER, forced="tcp") == "tcp"
    assert pick_transport("cuda", "cuda", True, GPU_OFFER, forced="nccl") == "nccl"  # two GPUs of one host


def test_nccl_is_never_chosen_between_two_processes_on_one_gpu() -> None:
    """NCCL refuses a communicator whose two ranks share a GPU: cuda_ipc is taken where
    offered, and where it is not (or nccl is forced) the pair is refused with the reason."""
    assert pick_transport("cuda:0", "cuda:0", True, GPU_OFFER, same_gpu=True) == "cuda_ipc"
    for offered, forced in ((("nccl",), None), (GPU_OFFER, "nccl")):
        with pytest.raises(HandshakeError, match="nccl cannot join two processes on one GPU") as e:
            pick_transport("cuda", "cuda", True, offered, forced, same_gpu=True)
        assert e.value.field == "transport"


def test_nixl_is_taken_where_forced_or_first_by_the_measured_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced, nixl needs the receiver to offer it and NIXL here; otherwise each case's default
    (`NIXL_FIRST`, from benchmarks/kv/kvfabric_bandwidth.py) decides, and no offer changes the rest."""
    offer = (*CPU_OFFER, "nixl")
    assert pick_transport("cpu", "cpu", False, offer, forced="nixl", nixl_here=True) == "nixl"
    assert pick_transport("cuda", "cuda", True, (*GPU_OFFER, "nixl"), forced="nixl", nixl_here=True) == "nixl"
    with pytest.raises(HandshakeError, match="nixl needs a receiver offering it") as e:
        pick_transport("cpu", "cpu", False, CPU_OFFER, forced="nixl", nixl_here=True)
    assert e.value.field == "transport"
    with pytest.raises(HandshakeError, match="nixl needs NIXL here: pip install nixl-cu12"):
        pick_transport("cpu", "cpu", False, offer, forced="nixl", nixl_here=False)
    for same_host, other in ((True, "shm"), (False, "tcp")):
        monkeypatch.setitem(NIXL_FIRST, ("cpu", same_host), True)
        assert pick_transport("cpu", "cpu", same_host, offer, nixl_here=True) == "nixl"
        assert pick_transport("cpu", "cpu", same_host, offer, nixl_here=False) == other  # NIXL not loadable here
        assert pick_transport("cpu", "cpu", same_host, CPU_OFFER, nixl_here=True) == other  # not offered
        monkeypatch.setitem(NIXL_FIRST, ("cpu", same_host), False)
        assert pick_transport("cpu", "cpu", same_host, offer, nixl_here=True) == other
    assert not offers_nixl("cpu", None) and offers_nixl("cpu", "nixl")  # the defaults take nixl nowhere (yet)


def test_cpu_pools_come_from_shared_memory_and_other_devices_are_refused() -> None:
    assert isinstance(kv_allocator("cpu"), ShmKVAllocator)
    assert isinstance(kv_allocator("cpu", "tcp"), ShmKVAllocator)
    assert device_kind("cuda:3") == "cuda"
    with pytest.raises(ValueError, match="cpu or cuda devices, not 'mps'"):
        kv_allocator("mps")


def test_the_gpu_extra_matches_torchs_cuda_major() -> None:
    assert gpu_extra("12.8") == "gpu"
    assert gpu_extra("13.0") == "gpu-cu13"
    assert gpu_extra(None) == "gpu"


def test_a_missing_cupy_is_one_error_naming_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvfabric.errors import FabricError
    from kvfabric.pools import require_cupy

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(FabricError, match=r"CuPy, which is not installed: pip install 'splitserve\[gpu\]'"):
        require_cupy("12.8")
    with pytest.raises(FabricError, match=r"splitserve\[gpu-cu13\]"):
        require_cupy("13.0")
    with pytest.raises(FabricError, match="not installed"):
        kv_allocator("cuda")


def test_a_nixl_clusters_cpu_pool_is_private_memory_on_huge_page_boundaries() -> None:
    """With the transport nixl no sender maps the pool: it lives in this process's own memory,
    starting on a 2 MiB boundary and advised for huge pages (NIXL's CMA writes pin each
    destination page), zero-filled, offering no shared-memory export."""
    import torch

    from engine.model.kv_pool import HUGE_PAGE_BYTES, TensorAllocator

    allocator = kv_allocator("cpu", "nixl")
    assert isinstance(allocator, TensorAllocator) and exports(allocator) == {}
    pool = allocator.allocate((3, 2, HUGE_PAGE_BYTES // 4), torch.float16, "cpu")
    assert pool.shape == (3, 2, HUGE_PAGE_BYTES // 4) and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0 and not pool.any()
    pool.fill_(1.5)
    start = pool.data_ptr()
    mapping = next(line for line in Path("/proc/self/maps").read_text().splitlines()
                   if int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16))
    assert mapping.split()[1] == "rw-p"  # private: no other process writes it but through NIXL
    small = allocator.allocate((5,), torch.int32, "cpu")  # under one huge page: plain pages, still zeroed
    assert small.tolist() == [0] * 5
    allocator.close()


def test_a_further_rank_held_by_its_own_nixl_agent_is_named_not_mapped_and_only_nixl_receives() -> None:
    """A split worker's further rank whose pool its own NIXL agent holds (`RankPool`, a GPU
    rank's way: its memory is private to its process) exports the agent's metadata and where
    the pool is registered; the worker sees an `AgentRegion` for it, which only a NIXL receiver
    takes (or a sender whose ranks post their own writes), and what must reach every pool
    itself (the KV tier) is refused naming the reason. On GPUs with the transport nixl the
    ranks take `RankPool`."""
    from types import SimpleNamespace

    import torch

    from engine.model.kv_pool import KVLayout, KVPool
    from kvfabric import ReceiverConfig
    from kvfabric.errors import FabricError
    from kvfabric.nixl_ranks import RankPool
    from kvfabric.pools import rank_allocator, worker_pools
    from kvfabric.receiver import FabricReceiver
    from kvfabric.region import AgentRegion

    assert rank_allocator("cuda", "nixl") is RankPool and rank_allocator("cuda", "tcp") is None
    assert rank_allocator("cpu", "nixl") is ShmKVAllocator  # host ranks are mapped: one agent registers them all
    layout = KVLayout(2, 4, 1, 8, torch.float32)  # 2 layers, 4 tokens a block, 1 KV head each rank, 8 dims
    pool = KVPool(layout, 6, "cpu")
    block_bytes = pool.tensor[0].numel() * 4
    theirs = {"nixl": b"rank-1-agent", "nixl_pool": [0x7F0000000000, 6 * block_bytes, 0]}
    pools = worker_pools("m", SimpleNamespace(tensor=pool.tensor, layout=layout), 2, (0, 1), [theirs])
    assert pools.regions[1] == AgentRegion(6, block_bytes, b"rank-1-agent", (0x7F0000000000, 6 * block_bytes, 0))
    with pytest.raises(FabricError, match="the KV tier needs every rank's KV pool in this process's reach"):
        pools.local("the KV tier")
    with pytest.raises(FabricError, match="receive over nixl only: this receiver does not offer nixl"):
        FabricReceiver(pools.layout, pools.regions, ReceiverConfig(nixl=False))
    short = {**theirs, "nixl_pool": [0x7F0000000000, 5 * block_bytes, 0]}
    with pytest.raises(FabricError, match=f"rank 1's pool is {5 * block_bytes} bytes, rank 0's 6 blocks"):
        worker_pools("m", SimpleNamespace(tensor=pool.tensor, layout=layout), 2, (0, 1), [short])
    with pytest.raises(FabricError, match="is for NIXL, which did not start there: no UCX"):
        worker_pools("m", SimpleNamespace(tensor=pool.tensor, layout=layout), 2, (0, 1), [{"nixl_error": "no UCX"}])
    mapped = worker_pools("m", SimpleNamespace(tensor=pool.tensor, layout=layout), 1, (0,), [])
    assert mapped.local("the KV tier") == mapped.regions  # rank 0 alone: in reach
