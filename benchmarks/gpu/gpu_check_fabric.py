"""gpu_check's kvfabric phase: cuda_ipc between two processes on one GPU, and nccl to itself.

The receiver runs in a spawned child with its pool in a dedicated cudaMalloc (as a decode
worker's); this process sends from a torch tensor (as a prefill worker's pool). For each
block shape (the tiny test model's, 4 KiB, and Llama-3-8B's, 2 MiB) and count (1, 64, 256
contiguous blocks): push time (the push returns once its copy stream is done), best of 5,
against a device-to-device copy of the same bytes in this process, timed with CUDA events;
and the 1-block push latency (median of 50 pushes of one block). nccl: a one-rank
communicator sending to itself the same bytes.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvfabric import FabricLayout, FabricReceiver, FabricSender, KVArrived, ReceiverConfig, SenderConfig, Ticket
from kvfabric.cuda import CudaIpcKVAllocator, DeviceRegion, NcclLink, nccl_unique_id

SHAPES = {
    "tiny": FabricLayout("gpu-check", "bfloat16", num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype_bytes=2),
    "llama3-8b": FabricLayout("gpu-check", "bfloat16", num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                              dtype_bytes=2),
}
COUNTS = (1, 64, 256)
LATENCY_PUSHES = 50
POOL_BLOCKS = max(COUNTS) + LATENCY_PUSHES


def receiver_child(pipe: Connection, layout_wire: dict[str, Any]) -> None:
    layout = FabricLayout.from_wire(layout_wire)
    allocator = CudaIpcKVAllocator()
    pool = allocator.allocate((POOL_BLOCKS, layout.block_bytes), torch.uint8, "cuda:0")
    receiver = FabricReceiver(layout, DeviceRegion.from_tensor(pool), ReceiverConfig(lease_s=60),
                              cuda_ipc_handle=allocator.ipc_handle)
    pipe.send(receiver.address.to_wire())
    n = 0
    while True:
        cmd = pipe.recv()
        if cmd[0] == "expect":
            n += 1
            pipe.send(receiver.expect(f"r{n}", cmd[1], 0).to_wire())
        elif cmd[0] == "poll":
            got = []
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                got = [e for e in receiver.poll(timeout_s=1) if isinstance(e, KVArrived)]
            pipe.send(len(got))
        else:
            receiver.close()
            return


def copy_s(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


class Pair:
    """A sender here and a receiver in a child process, one block shape."""

    def __init__(self, layout: FabricLayout) -> None:
        self.layout = layout
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_child, args=(child, layout.to_wire()), daemon=True)
        self.proc.start()
        if not self.pipe.poll(120):
            raise TimeoutError("the receiver process did not start within 120 s")
        self.pipe.recv()
        self.src = torch.randint(0, 256, (POOL_BLOCKS, layout.block_bytes), dtype=torch.uint8, device="cuda:0")
        self.sender = FabricSender(layout, DeviceRegion.from_tensor(self.src), SenderConfig(transport="cuda_ipc"))

    def transfer(self, n: int) -> Any:
        self.pipe.send(("expect", list(range(n))))
        return self.sender.open(Ticket.from_wire(self.pipe.recv()))

    def push_s(self, n: int) -> float:
        transfer = self.transfer(n)
        torch.cuda.synchronize()
        began = time.perf_counter()
        transfer.push(list(range(n)), 0)
        took = time.perf_counter() - began
        transfer.finish(3, n * self.layout.block_size)
        self.pipe.send(("poll",))
        if self.pipe.recv() != 1:
            raise RuntimeError(f"a {n}-block transfer did not arrive")
        return took

    def latency_s(self) -> list[float]:
        transfer = self.transfer(LATENCY_PUSHES)
        times = []
        for i in range(LATENCY_PUSHES):
            began = time.perf_counter()
            transfer.push([max(COUNTS) + i], i)
            times.append(time.perf_counter() - began)
        transfer.finish(3, LATENCY_PUSHES * self.layout.block_size)
        self.pipe.send(("poll",))
        self.pipe.recv()
        return times

    def close(self) -> None:
        self.sender.close()
        self.pipe.send(("exit",))
        self.proc.join(10)
        self.proc.kill()


def fabric(check: Any) -> None:
    for shape, layout in SHAPES.items():
        pair = Pair(layout)
        try:
            bb = layout.block_bytes
            for n in COUNTS:
                push = min(pair.push_s(n) for _ in range(5))
                dst = torch.empty((n, bb), dtype=torch.uint8, device="cuda:0")
                limit = copy_s(pair.src[:n], dst)
                check.emit("fabric", transport="cuda_ipc", shape=shape, block_bytes=bb, blocks=n,
                           push_us=round(push * 1e6, 1), copy_us=round(limit * 1e6, 1),
                           push_gb_per_s=round(n * bb / push / 1e9, 2), of_copy=round(limit / push, 3))
            lat = pair.latency_s()
            check.emit("fabric_latency", transport="cuda_ipc", shape=shape, block_bytes=bb,
                       push_us_p50=round(statistics.median(lat) * 1e6, 1), push_us_min=round(min(lat) * 1e6, 1))
        finally:
            pair.close()
        nccl_self(check, shape, layout)


def nccl_self(check: Any, shape: str, layout: FabricLayout) -> None:
    uid, uid_is_bytes = nccl_unique_id()
    link = NcclLink(uid, uid_is_bytes, 1, 0, 0, 30.0)
    try:
        bb = layout.block_bytes
        for n in COUNTS:
            src = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device="cuda:0")
            dst = torch.zeros_like(src)
            torch.cuda.synchronize()
            times = []
            for _ in range(6):
                began = time.perf_counter()
                link.exchange(0, [(src.data_ptr(), n * bb)], [(dst.data_ptr(), n * bb)], timeout_s=30)
                times.append(time.perf_counter() - began)
            if not torch.equal(src, dst):
                raise RuntimeError("nccl to itself delivered other bytes")
            limit = copy_s(src, dst)
            took = min(times[1:])
            check.emit("fabric", transport="nccl_self", shape=shape, block_bytes=bb, blocks=n,
                       push_us=round(took * 1e6, 1), copy_us=round(limit * 1e6, 1),
                       push_gb_per_s=round(n * bb / took / 1e9, 2), of_copy=round(limit / took, 3))
    finally:
        link.close()
