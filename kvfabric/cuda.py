"""GPU transports over CuPy (optional `gpu` extra; nothing on the CPU path imports this).

- `cuda_ipc` (same host): the decode pool is one dedicated cudaMalloc allocation
  (`CudaIpcKVAllocator`), exported as a CUDA IPC handle in the receiver's address. The
  sender opens the handle once and copies device to device on its own stream; it waits
  for the stream (bounded) before reporting `written`, so the data precedes the report.
- `nccl` (any host): a two-rank communicator per sender/receiver pair (sender rank 0),
  created lazily at the handshake from a unique id the sender sends in `hello`. Each
  frame's header travels on the control connection; the payload follows as grouped
  NCCL send/recv, one per run of adjacent blocks. Never between two processes on one
  GPU (NCCL refuses a communicator whose ranks share a GPU): `gpu_identity` tells them.
  A process issues one NCCL operation at a time (`_NCCL_ORDER`): kernels of two
  communicators are not guaranteed to run side by side, so two threads posting to two
  peers in orders the peers do not share could wait on each other for good.
Every wait on a stream is bounded: past the timeout the communicator is aborted and the
peer reported unavailable; so are a communicator's setup and the posting of a group
(`ncclGroupEnd` may wait for a peer that has not joined). CUDA and NCCL errors from CuPy
become `FabricError`s (`_fabric_errors`): the transfer fails, the worker lives.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvfabric.errors import FabricError, PeerUnavailable

T = TypeVar("T")


@contextlib.contextmanager
def _fabric_errors(what: str) -> Iterator[None]:
    """CuPy's CUDA runtime and NCCL errors (any non-fabric error) as a FabricError."""
    try:
        yield
    except FabricError:
        raise
    except Exception as e:
        raise FabricError(f"{what} failed: {type(e).__name__}: {e}") from e


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Runs a call that has no timeout of its own (NCCL's communicator setup waits for every
    rank) on a helper thread; past `timeout_s` the peer counts as unavailable (the helper is
    left to NCCL's own bootstrap timeout)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    helper = threading.Thread(target=run, name="kvfabric-bounded", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        raise PeerUnavailable(f"{what} did not complete within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def cupy() -> Any:
    try:
        import cupy as cp
    except ImportError as e:
        raise FabricError("GPU transports need CuPy: pip install 'splitserve[gpu]'") from e
    return cp


def nccl() -> Any:
    """CuPy's NCCL bindings. `import cupy` does not load them (`cupy.cuda.nccl` is then a
    missing attribute): they are imported here, once, with one clear error if absent."""
    cupy()
    try:
        import cupy.cuda.nccl as module
    except Exception as e:  # ImportError, or the library failing to load
        raise FabricError(f"the nccl transport needs CuPy's NCCL bindings (cupy.cuda.nccl): {e}") from e
    if not getattr(module, "available", True):
        raise FabricError("the nccl transport needs NCCL, which this CuPy cannot load (cupy.cuda.nccl.available "
                          "is False): install the nvidia-nccl wheel for its CUDA version")
    return module


_NCCL_ORDER = threading.Lock()
"""One NCCL operation (a group posted and waited for) at a time in this process."""


def gpu_identity(device: int) -> str:
    """The GPU's PCI address ("0000:3b:00.0"): two processes on one host see the same one
    for the same GPU whatever their CUDA_VISIBLE_DEVICES numbering."""
    cp = cupy()
    with _fabric_errors("reading the GPU's PCI address"):
        p = cp.cuda.runtime.getDeviceProperties(device)
    return f"{p['pciDomainID']:04x}:{p['pciBusID']:02x}:{p['pciDeviceID']:02x}.0"


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


class CopyInFlight(PeerUnavailable):
    """A stream wait timed out: the copy may still be writing the receiver's blocks. Its
    transfer keeps them fenced until `stream` is done (see `when_done`)."""

    def __init__(self, message: str, stream: Any) -> None:
        super().__init__(message)
        self.stream = stream


SPIN_S = 200e-6
"""How long `wait_stream` polls the stream without sleeping: a one-block copy takes about
14 us on an H100, and a sleep of 20 us lasts 60 us or more on Linux (timer slack), which
set the floor of a small push (99 us p50 in the first GPU run)."""


def wait_stream(stream: Any, timeout_s: float, on_timeout: Any = None) -> None:
    """Wait for a stream without an unbounded block; raises CopyInFlight past the timeout.
    Polls without sleeping for `SPIN_S`, then sleeps between polls, doubling up to 1 ms."""
    began = time.monotonic()
    deadline, spin_until, pause = began + timeout_s, began + SPIN_S, 20e-6
    while not stream.done:
        now = time.monotonic()
        if now > deadline:
            if on_timeout is not None:
                on_timeout()
            raise CopyInFlight(f"GPU transfer did not complete within {timeout_s:g} s", stream)
        if now > spin_until:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def when_done(stream: Any, fn: Callable[[], None], poll_s: float = 1e-3) -> None:
    """Calls `fn` on a helper thread once `stream` has finished (now, if it has)."""
    if stream.done:
        fn()
        return

    def wait() -> None:
        while not stream.done:
            time.sleep(poll_s)
        fn()

    threading.Thread(target=wait, name="kvfabric-fence", daemon=True).start()


def record_event(stream_ptr: int, device: int) -> Any:
    """A CUDA event on the stream that wrote the KV (torch's): a copy or NCCL stream waits
    on it before reading the blocks, so a push never reads KV the GPU has not written."""
    cp = cupy()
    with _fabric_errors("recording the step's CUDA event"), cp.cuda.Device(device):
        event = cp.cuda.Event(disable_timing=True)
        event.record(cp.cuda.ExternalStream(stream_ptr))
    return event


class IpcMapping:
    """Sender side of cuda_ipc: the receiver's pool opened in this process."""

    def __init__(self, handle: bytes, num_blocks: int, block_bytes: int, device: int) -> None:
        cp = cupy()
        self.device = device
        with _fabric_errors("opening the receiver's CUDA IPC handle"), cp.cuda.Device(device):
            ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            self.stream = cp.cuda.Stream(non_blocking=True)
        self.dst = DeviceRegion(ptr, num_blocks, block_bytes, device)

    def copy_runs(self, src: DeviceRegion, runs: list[Any], timeout_s: float, after: Any = None) -> None:
        """Copies on this mapping's stream once `after` (the step's event) has happened."""
        cp = cupy()
        rt = cp.cuda.runtime
        with _fabric_errors("a cuda_ipc copy"), cp.cuda.Device(self.device):
            if after is not None:
                self.stream.wait_event(after)
            for r in runs:
                rt.memcpyAsync(self.dst.block_ptr(r.dst_block, r.num_blocks), src.block_ptr(r.src_block, r.num_blocks),
                               r.num_blocks * src.block_bytes, rt.memcpyDefault, self.stream.ptr)
            wait_stream(self.stream, timeout_s)

    def close(self) -> None:
        cp = cupy()
        with _fabric_errors("closing a CUDA IPC mapping"), cp.cuda.Device(self.device):
            cp.cuda.runtime.ipcCloseMemHandle(self.dst.ptr)


def nccl_unique_id() -> tuple[list[int], bool]:
    """A new NCCL unique id as msgpack-able ints, and whether this CuPy gives it as bytes
    (newer) or a tuple of ints (older): the receiver rebuilds it in the same form."""
    with _fabric_errors("creating an NCCL unique id"):
        uid = nccl().get_unique_id()
    return list(uid), isinstance(uid, bytes)


def nccl_payload(ptrs: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """A frame's NCCL operations: one per run, (pointer, bytes). Sender, receiver and a
    dropped frame's scratch receive all post exactly this list, so they stay in step."""
    return list(zip(ptrs, sizes, strict=True))


class NcclLink:
    """One communicator between a sender (rank 0) and a receiver (rank 1), or to itself (1 rank)."""

    def __init__(self, uid: list[int], uid_is_bytes: bool, nranks: int, rank: int, device: int,
                 timeout_s: float) -> None:
        cp, module = cupy(), nccl()
        self.device, self.rank = device, rank
        uid_arg: Any = bytes(b & 0xFF for b in uid) if uid_is_bytes else tuple(uid)

        def setup() -> Any:
            with cp.cuda.Device(device):
                return module.NcclCommunicator(nranks, uid_arg, rank)

        with _fabric_errors("NCCL communicator setup"):
            self.comm = bounded(setup, timeout_s, "NCCL communicator setup")
            with cp.cuda.Device(device):
                self.stream = cp.cuda.Stream(non_blocking=True)
        self._poster = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfabric-nccl")
        """Posts each group (groupStart to groupEnd on one thread, as NCCL's groups are per
        thread), so a groupEnd that waits for the peer is bounded by the caller."""

    def scratch(self, nbytes: int) -> tuple[int, Any]:
        """Device memory to receive a dropped frame into: (pointer, the owner to keep alive)."""
        cp = cupy()
        with _fabric_errors("allocating a scratch buffer"), cp.cuda.Device(self.device):
            buf = cp.empty(nbytes, dtype="uint8")
        return int(buf.data.ptr), buf

    def exchange(self, peer: int, sends: list[tuple[int, int]], recvs: list[tuple[int, int]], timeout_s: float,
                 after: Any = None) -> None:
        """Grouped point-to-point: (pointer, bytes) sends to and recvs from `peer`, once `after`
        (the step's event, for sends) has happened. Posting and completion are each bounded
        by `timeout_s`; past it the communicator is aborted and the peer is unavailable."""
        cp, module = cupy(), nccl()

        def post() -> None:
            with cp.cuda.Device(self.device):
                if after is not None:
                    self.stream.wait_event(after)
                module.groupStart()
                try:
                    for ptr, n in sends:
                        self.comm.send(ptr, n, module.NCCL_UINT8, peer, self.stream.ptr)
                    for ptr, n in recvs:
                        self.comm.recv(ptr, n, module.NCCL_UINT8, peer, self.stream.ptr)
                finally:
                    module.groupEnd()

        with _NCCL_ORDER, _fabric_errors("an NCCL transfer"):
            try:
                self._poster.submit(post).result(timeout_s)
            except concurrent.futures.TimeoutError:
                self.comm.abort()
                raise PeerUnavailable(f"posting an NCCL group did not complete within {timeout_s:g} s") from None
            with cp.cuda.Device(self.device):
                wait_stream(self.stream, timeout_s, on_timeout=self.comm.abort)

    def close(self) -> None:
        self._poster.shutdown(wait=False)
        with _fabric_errors("closing an NCCL communicator"):
            self.comm.destroy()
