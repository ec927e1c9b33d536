"""kvfabric's GPU transports: cuda_ipc between two processes on one GPU (and two senders into one
pool at once, and a push that must wait for the stream that wrote its blocks), nccl to itself,
nccl between two processes on two GPUs, and nixl between two processes on one GPU (device
memory registered with NIXL: needs NIXL's wheel too). Need CUDA and CuPy (the `gpu` extra)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch

from kvfabric import (
    FabricError, FabricLayout, FabricReceiver, FabricSender, KVArrived, ReceiverConfig, SenderConfig, Ticket,
)
from kvfabric.address import FabricAddress
from kvfabric.cuda import CudaIpcKVAllocator, DeviceRegion, NcclLink, nccl_unique_id, record_event

LAYOUT = FabricLayout("gpu-test", "bfloat16", num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype_bytes=2)
NUM_BLOCKS = 32


@pytest.fixture(autouse=True)
def _needs_cupy() -> None:
    pytest.importorskip("cupy")


def receiver_child(pipe: Connection, device: int, use_ipc: bool, lease_s: float = 30.0, nixl: bool = False) -> None:
    torch.cuda.set_device(device)
    allocator = CudaIpcKVAllocator()
    pool = allocator.allocate((NUM_BLOCKS, LAYOUT.block_bytes // 2), torch.bfloat16, f"cuda:{device}")
    receiver = FabricReceiver(LAYOUT, DeviceRegion.from_tensor(pool), ReceiverConfig(lease_s=lease_s, nixl=nixl),
                              cuda_ipc_handle=allocator.ipc_handle if use_ipc else None)
    serve_receiver(pipe, receiver, pool)


def serve_receiver(pipe: Connection, receiver: FabricReceiver, pool: torch.Tensor) -> None:
    """A receiver child's commands from the test, until "exit"; `pool`: rank 0's."""
    pipe.send(receiver.address.to_wire())
    while True:
        cmd = pipe.recv()
        if cmd[0] == "expect":
            pipe.send(receiver.expect(cmd[1], cmd[2], 0).to_wire())
        elif cmd[0] == "poll":
            pipe.send([(e.request_id, type(e).__name__) for e in receiver.poll(timeout_s=10)])
        elif cmd[0] == "cancel":
            pipe.send(receiver.cancel(cmd[1]))
        elif cmd[0] == "held":
            pipe.send(receiver.held_block_ids())
        elif cmd[0] == "bytes":
            torch.cuda.synchronize()
            pipe.send(pool.view(torch.uint8)[cmd[1]].cpu().numpy().tobytes())
        else:
            receiver.close()
            return


def run_pair(transport: str, sender_device: int, receiver_device: int, written_late: bool = False) -> None:
    """Five blocks pushed in two pieces land byte for byte. `written_late`: the source blocks
    are written on torch's stream behind half a second of GPU sleep, and the pushes wait for
    that stream's event, not for the host (a copy that ignored it would read zeros)."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_child, args=(child, receiver_device, transport == "cuda_ipc", 30.0,
                                                   transport == "nixl"), daemon=True)
    proc.start()
    try:
        assert pipe.poll(120)
        FabricAddress.from_wire(pipe.recv())
        g = torch.Generator(device=f"cuda:{sender_device}").manual_seed(0)
        payload = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8,
                                device=f"cuda:{sender_device}", generator=g)
        src = torch.zeros_like(payload) if written_late else payload
        sender = FabricSender(LAYOUT, DeviceRegion.from_tensor(src), SenderConfig(transport=transport))
        dst_ids, src_ids = [3, 4, 5, 9, 20], [7, 8, 9, 1, 30]
        pipe.send(("expect", "g", dst_ids))
        transfer = sender.open(Ticket.from_wire(pipe.recv()))
        assert transfer.transport == transport
        after = None
        if written_late:
            torch.cuda.synchronize(sender_device)
            torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time on torch's stream
            src.copy_(payload)
            after = record_event(torch.cuda.current_stream(sender_device).cuda_stream, sender_device)
        transfer.push(src_ids[:3], 0, after)
        transfer.push(src_ids[3:], 3, after)
        transfer.finish(5, len(dst_ids) * LAYOUT.block_size)
        pipe.send(("poll",))
        assert pipe.recv() == [("g", KVArrived.__name__)]
        pipe.send(("bytes", dst_ids))
        assert pipe.recv() == payload[src_ids].cpu().numpy().tobytes()
        sender.close()
    finally:
        pipe.send(("exit",))
        proc.join(10)
        proc.kill()


def test_cuda_ipc_between_two_processes_on_one_gpu() -> None:
    run_pair("cuda_ipc", 0, 0)


def test_a_cuda_ipc_push_waits_for_the_event_of_the_stream_that_wrote_its_blocks() -> None:
    run_pair("cuda_ipc", 0, 0, written_late=True)


@pytest.mark.parametrize("written_late", [False, True])
def test_nixl_between_two_processes_on_one_gpu(written_late: bool) -> None:
    """Device memory registered with NIXL on both sides (VRAM), written one-sided; a write
    posted only once the stream that wrote its blocks got there."""
    from kvfabric.nixl import unavailable

    if (why := unavailable()) is not None:
        pytest.skip(why)
    run_pair("nixl", 0, 0, written_late=written_late)


def test_nccl_send_to_self() -> None:
    uid, uid_is_bytes = nccl_unique_id()
    link = NcclLink(uid, uid_is_bytes, 1, 0, 0, 30.0)
    src = torch.randint(0, 256, (4, 4096), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    link.exchange(0, [(src[1].data_ptr(), 8192)], [(dst[2].data_ptr(), 8192)], timeout_s=30)
    assert torch.equal(dst[2:4], src[1:3]) and not dst[:2].any()
    link.close()


def sender_child(pipe: Connection, ticket_wire: dict, seed: int) -> None:
    """A second prefill process: pushes its own blocks 0..n-1 into the ticket's, in two pieces."""
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    src = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8, device="cuda:0", generator=g)
    sender = FabricSender(LAYOUT, DeviceRegion.from_tensor(src), SenderConfig(transport="cuda_ipc"))
    ticket = Ticket.from_wire(ticket_wire)
    n = len(ticket.block_ids)
    pipe.send("ready")
    pipe.recv()  # go
    transfer = sender.open(ticket)
    transfer.push(list(range(n // 2)), 0)
    transfer.push(list(range(n // 2, n)), n // 2)
    transfer.finish(5, n * LAYOUT.block_size)
    pipe.send(src[:n].cpu().numpy().tobytes())
    sender.close()


def test_two_senders_push_into_one_pool_at_once() -> None:
    """Two prefill processes' pushes into disjoint blocks of one decode pool, at the same time:
    both arrive, each block holds its sender's bytes."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    receiver = ctx.Process(target=receiver_child, args=(child, 0, True), daemon=True)
    receiver.start()
    other = None
    try:
        assert pipe.poll(120)
        pipe.recv()
        pipe.send(("expect", "a", list(range(0, 12))))
        ticket_a = Ticket.from_wire(pipe.recv())
        pipe.send(("expect", "b", list(range(12, 24))))
        ticket_b = pipe.recv()
        to_other, theirs = ctx.Pipe()
        other = ctx.Process(target=sender_child, args=(theirs, ticket_b, 9), daemon=True)
        other.start()
        assert to_other.poll(120) and to_other.recv() == "ready"
        src = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8, device="cuda:0")
        sender = FabricSender(LAYOUT, DeviceRegion.from_tensor(src), SenderConfig(transport="cuda_ipc"))
        transfer = sender.open(ticket_a)
        to_other.send("go")
        for k in range(12):  # one block a push, interleaving with the other process's pushes
            transfer.push([20 - k], k)
        transfer.finish(5, 12 * LAYOUT.block_size)
        assert to_other.poll(60)
        their_bytes = to_other.recv()
        arrived: set[str] = set()
        for _ in range(3):
            pipe.send(("poll",))
            arrived |= {rid for rid, kind in pipe.recv() if kind == KVArrived.__name__}
            if arrived == {"a", "b"}:
                break
        assert arrived == {"a", "b"}
        pipe.send(("bytes", list(range(12))))
        assert pipe.recv() == src[[20 - k for k in range(12)]].cpu().numpy().tobytes()
        pipe.send(("bytes", list(range(12, 24))))
        assert pipe.recv() == their_bytes
        sender.close()
    finally:
        pipe.send(("exit",))
        receiver.join(10)
        receiver.kill()
        if other is not None:
            other.join(10)
            other.kill()


def test_nccl_between_two_pools_on_one_gpu_is_refused_at_the_handshake() -> None:
    """Both sides know their GPU's PCI address: a sender forcing nccl to a receiver on its own
    GPU is refused before NCCL is asked (it would refuse the duplicate GPU itself, less clearly)."""
    from kvfabric.cuda import gpu_identity
    from kvfabric.errors import HandshakeError

    dst = torch.zeros((8, LAYOUT.block_bytes), dtype=torch.uint8, device="cuda:0")
    src = torch.zeros_like(dst)
    receiver = FabricReceiver(LAYOUT, DeviceRegion.from_tensor(dst), ReceiverConfig())
    sender = FabricSender(LAYOUT, DeviceRegion.from_tensor(src), SenderConfig(transport="nccl"))
    try:
        assert receiver.address.gpu == gpu_identity(0) and receiver.address.transports == ("nccl",)
        with pytest.raises(HandshakeError, match="nccl cannot join two processes on one GPU"):
            sender.open(receiver.expect("r", [0, 1], 0))
        assert sorted(receiver.held_block_ids()) == [0, 1]  # nothing was sent; the lease frees them
    finally:
        sender.close()
        receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl between processes needs two GPUs")
def test_nccl_between_two_processes_on_two_gpus() -> None:
    run_pair("nccl", 0, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl between processes needs two GPUs")
def test_nccl_abort_and_dropped_multi_run_frames_leave_nothing_hanging() -> None:
    """A revoked reservation's multi-run frames are received into scratch run by run (NCCL
    stays in step: the next transfer on the same link still arrives), and nothing is held."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_child, args=(child, 1, False), daemon=True)
    proc.start()
    try:
        assert pipe.poll(120)
        pipe.recv()
        src = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8, device="cuda:0")
        sender = FabricSender(LAYOUT, DeviceRegion.from_tensor(src), SenderConfig(transport="nccl", io_timeout_s=20))
        pipe.send(("expect", "a", [0, 1, 2, 5, 6, 9]))
        doomed = sender.open(Ticket.from_wire(pipe.recv()))
        doomed.push([3, 4, 10, 11, 12], 0)  # three runs on the sender, three receives
        pipe.send(("cancel", "a"))
        pipe.recv()
        with contextlib.suppress(FabricError):  # revoked: the frame is dropped, or refused before it goes
            doomed.push([20, 21, 22, 30], 2)
        pipe.send(("expect", "b", [12, 13, 14]))
        after = sender.open(Ticket.from_wire(pipe.recv()))
        after.push([1, 2, 7], 0)
        after.finish(9, 3 * LAYOUT.block_size)
        pipe.send(("poll",))
        assert ("b", KVArrived.__name__) in pipe.recv()
        pipe.send(("bytes", [12, 13, 14]))
        assert pipe.recv() == src[[1, 2, 7]].cpu().numpy().tobytes()
        pipe.send(("held",))
        assert pipe.recv() == []
        sender.close()
    finally:
        pipe.send(("exit",))
        proc.join(10)
        proc.kill()


SPLIT = FabricLayout("gpu-test", "bfloat16", num_layers=4, block_size=16, num_kv_heads=1, head_dim=64, dtype_bytes=2,
                     model_kv_heads=2, shards=(0, 1))
"""A worker split over two ranks, a KV head each."""


def rank_pool_child(pipe: Connection, seed: int | None) -> None:
    """A further rank: its pool on this GPU, private to this process and held by a NIXL agent of
    its own (`RankPool`); `seed`: filled with the sender's bytes, else zeros (a receiver's)."""
    from kvfabric.nixl_ranks import RankPool

    pool = RankPool()
    blocks = pool.allocate((NUM_BLOCKS, SPLIT.block_bytes), torch.uint8, "cuda:0")
    if seed is not None:
        g = torch.Generator(device="cuda:0").manual_seed(seed)
        blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, device="cuda:0", generator=g))
    pipe.send(pool.export())
    while True:
        cmd = pipe.recv()
        if cmd[0] == "bytes":
            torch.cuda.synchronize()
            pipe.send(blocks[cmd[1]].cpu().numpy().tobytes())
        else:
            pool.close()
            pipe.send(None)
            return


def split_receiver_child(pipe: Connection, rank1: dict) -> None:
    """Rank 0 of a split decode worker: its own pool, and rank 1's through that rank's agent."""
    from kvfabric.region import AgentRegion

    pool = torch.zeros((NUM_BLOCKS, SPLIT.block_bytes), dtype=torch.uint8, device="cuda:0")
    further = AgentRegion.from_export(NUM_BLOCKS, SPLIT.block_bytes, rank1)
    serve_receiver(pipe, FabricReceiver(SPLIT, [DeviceRegion.from_tensor(pool), further], ReceiverConfig(nixl=True)),
                   pool)


def test_nixl_between_split_workers_whose_further_ranks_hold_their_pools_with_agents_of_their_own() -> None:
    """The registration a split GPU worker needs (one GPU here, one agent per pool): a sender
    split over two ranks, its rank 1 posting its own writes from its own agent, into a receiver
    split over two, its rank 1's pool reached through that rank's agent; every rank's blocks
    land byte for byte."""
    from kvfabric.nixl import unavailable
    from kvfabric.region import AgentRegion

    if (why := unavailable()) is not None:
        pytest.skip(why)
    ctx = mp.get_context("spawn")
    children = []
    try:
        pipes = []
        for target, args in ((rank_pool_child, (None,)), (rank_pool_child, (1,))):
            pipe, child = ctx.Pipe()
            children.append(ctx.Process(target=target, args=(child, *args), daemon=True))
            children[-1].start()
            pipes.append(pipe)
        assert all(p.poll(120) for p in pipes)
        rx_rank1, tx_rank1 = (p.recv() for p in pipes)
        rx_pipe, child = ctx.Pipe()
        children.append(ctx.Process(target=split_receiver_child, args=(child, rx_rank1), daemon=True))
        children[-1].start()
        assert rx_pipe.poll(120)
        FabricAddress.from_wire(rx_pipe.recv())
        g = torch.Generator(device="cuda:0").manual_seed(0)
        src0 = torch.randint(0, 256, (NUM_BLOCKS, SPLIT.block_bytes), dtype=torch.uint8, device="cuda:0", generator=g)
        further = AgentRegion.from_export(NUM_BLOCKS, SPLIT.block_bytes, tx_rank1)
        sender = FabricSender(SPLIT, [DeviceRegion.from_tensor(src0), further], SenderConfig(transport="nixl"))
        dst_ids, src_ids = [3, 4, 5, 9, 20], [7, 8, 9, 1, 30]
        rx_pipe.send(("expect", "g", dst_ids))
        transfer = sender.open(Ticket.from_wire(rx_pipe.recv()))
        assert transfer.transport == "nixl" and sender.rank_posts
        transfer.push(src_ids[:3], 0)
        transfer.push(src_ids[3:], 3)
        transfer.finish(5, len(dst_ids) * SPLIT.block_size)
        rx_pipe.send(("poll",))
        assert rx_pipe.recv() == [("g", KVArrived.__name__)]
        rx_pipe.send(("bytes", dst_ids))
        assert rx_pipe.recv() == src0[src_ids].cpu().numpy().tobytes()
        pipes[1].send(("bytes", src_ids))
        pipes[0].send(("bytes", dst_ids))
        assert pipes[0].recv() == pipes[1].recv()  # rank 1's heads, from its agent into the other's
        sender.close()
        rx_pipe.send(("exit",))
        for p in pipes:
            p.send(("exit",))
            assert p.poll(30) and p.recv() is None
    finally:
        for proc in children:
            proc.join(10)
            proc.kill()
