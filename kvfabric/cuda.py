"""GPU transports over CuPy (optional `gpu` extra; nothing on the CPU path imports this).

- `cuda_ipc` (same host): the decode pool is one dedicated cudaMalloc allocation
  (`CudaIpcKVAllocator`), exported as a CUDA IPC handle in the receiver's address. The
  sender opens the handle once and copies device to device on its own stream; it waits
  for the stream (bounded) before reporting `written`, so the data precedes the report.
- `nccl` (any host): a two-rank communicator per sender/receiver pair (sender rank 0),
  created lazily at the handshake from a unique id the sender sends in `hello`. Each
  frame's header travels on the control connection; the payload follows as grouped
  NCCL send/recv, one per run of adjacent blocks.
Every wait on a stream is bounded: past the timeout the communicator is aborted and the
peer reported unavailable.
"""
from __future__ import annotations

import time
from typing import Any

from kvfabric.errors import FabricError, PeerUnavailable


def cupy() -> Any:
    try:
        import cupy as cp
    except ImportError as e:
        raise FabricError("GPU transports need CuPy: pip install 'splitserve[gpu]'") from e
    return cp


class DeviceRegion:
    """A device pool as raw memory: [num_blocks, block_bytes] from a base pointer."""

    def __init__(self, ptr: int, num_blocks: int, block_bytes: int, device: int) -> None:
        self.ptr, self.num_blocks, self.block_bytes, self.device = ptr, num_blocks, block_bytes, device

    @classmethod
    def from_tensor(cls, tensor: Any) -> DeviceRegion:
        if tensor.device.type != "cuda" or not tensor.is_contiguous():
            raise ValueError("DeviceRegion.from_tensor needs a contiguous CUDA tensor")
        n = tensor.shape[0]
        return cls(tensor.data_ptr(), n, tensor.numel() * tensor.element_size() // n, tensor.device.index)

    def block_ptr(self, block: int, num_blocks: int = 1) -> int:
        if block < 0 or num_blocks <= 0 or block + num_blocks > self.num_blocks:
            raise ValueError(f"blocks [{block}, {block + num_blocks}) outside the pool of {self.num_blocks}")
        return self.ptr + block * self.block_bytes


class CudaIpcKVAllocator:
    """Engine `KVAllocator`: the pool in its own cudaMalloc, so one IPC handle covers exactly it."""

    def __init__(self) -> None:
        self.memory: Any = None
        self.ipc_handle: bytes | None = None

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: str) -> Any:
        import torch

        cp = cupy()
        index = torch.device(device).index or 0
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        with cp.cuda.Device(index):
            self.memory = cp.cuda.Memory(nbytes)  # not from CuPy's pool: a dedicated allocation
            flat = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(self.memory, 0))
            flat.fill(0)
            self.ipc_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.memory.ptr))
        return torch.from_dlpack(flat).view(dtype).view(shape)

    def close(self) -> None:
        self.memory = None  # freed once the pool tensor that views it is gone


def wait_stream(stream: Any, timeout_s: float, on_timeout: Any = None) -> None:
    """Wait for a stream without an unbounded block."""
    deadline = time.monotonic() + timeout_s
    while not stream.done:
        if time.monotonic() > deadline:
            if on_timeout is not None:
                on_timeout()
            raise PeerUnavailable(f"GPU transfer did not complete within {timeout_s:g} s")
        time.sleep(20e-6)


class IpcMapping:
    """Sender side of cuda_ipc: the receiver's pool opened in this process."""

    def __init__(self, handle: bytes, num_blocks: int, block_bytes: int, device: int) -> None:
        cp = cupy()
        self.device = device
        with cp.cuda.Device(device):
            ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            self.stream = cp.cuda.Stream(non_blocking=True)
        self.dst = DeviceRegion(ptr, num_blocks, block_bytes, device)

    def copy_runs(self, src: DeviceRegion, runs: list[Any], timeout_s: float) -> None:
        cp = cupy()
        rt = cp.cuda.runtime
        with cp.cuda.Device(self.device):
            for r in runs:
                rt.memcpyAsync(self.dst.block_ptr(r.dst_block, r.num_blocks), src.block_ptr(r.src_block, r.num_blocks),
                               r.num_blocks * src.block_bytes, rt.memcpyDefault, self.stream.ptr)
            wait_stream(self.stream, timeout_s)

    def close(self) -> None:
        cp = cupy()
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.ipcCloseMemHandle(self.dst.ptr)


def nccl_unique_id() -> list[int]:
    uid = cupy().cuda.nccl.get_unique_id()
    return list(uid)  # a tuple of ints (older CuPy) or bytes: msgpack-able either way as ints


class NcclLink:
    """One communicator between a sender (rank 0) and a receiver (rank 1), or to itself (1 rank)."""

    def __init__(self, uid: list[int], nranks: int, rank: int, device: int) -> None:
        cp = cupy()
        self.device, self.rank = device, rank
        uid_arg: Any = bytes(uid) if isinstance(cp.cuda.nccl.get_unique_id(), bytes) else tuple(uid)
        with cp.cuda.Device(device):
            self.comm = cp.cuda.nccl.NcclCommunicator(nranks, uid_arg, rank)
            self.stream = cp.cuda.Stream(non_blocking=True)

    def exchange(self, peer: int, sends: list[tuple[int, int]], recvs: list[tuple[int, int]], timeout_s: float) -> None:
        """Grouped point-to-point: (pointer, bytes) sends to and recvs from `peer`."""
        cp = cupy()
        nccl = cp.cuda.nccl
        with cp.cuda.Device(self.device):
            nccl.groupStart()
            for ptr, n in sends:
                self.comm.send(ptr, n, nccl.NCCL_UINT8, peer, self.stream.ptr)
            for ptr, n in recvs:
                self.comm.recv(ptr, n, nccl.NCCL_UINT8, peer, self.stream.ptr)
            nccl.groupEnd()
            wait_stream(self.stream, timeout_s, on_timeout=self.comm.abort)

    def close(self) -> None:
        self.comm.destroy()
