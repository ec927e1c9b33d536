"""The descriptors that travel between workers.

`FabricAddress` says how to reach a receiver and what it offers; a `Ticket` is one
reservation on it: the destination block ids, the leading blocks already cached there
(not sent), and the lease. The router carries a Ticket from the decode worker to the
prefill worker as the protobuf `KVTicket` (proto/convert.py checks it field by field);
`to_wire` / `from_wire` are plain dicts for pipes between processes of our own.
"""
from __future__ import annotations

import functools
import socket
from dataclasses import asdict, dataclass
from pathlib import Path


@functools.cache
def local_host_id() -> str:
    """Equal for two processes on the same machine (same boot), different otherwise."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


ONE_SIDED = frozenset({"shm", "cuda_ipc", "nixl"})
"""Transports where the sender writes straight into the receiver's pool."""


@dataclass(frozen=True)
class FabricAddress:
    host: str
    port: int
    host_id: str
    receiver_id: str
    device: str
    """"cpu" or "cuda": where the receiver's pool lives."""
    transports: tuple[str, ...]
    shm_name: str | None = None
    shm_nonce: str | None = None
    shm_bytes: int = 0
    cuda_ipc_handle: bytes | None = None
    """The decode pool's CUDA IPC handle (device pools on this host)."""
    gpu: str | None = None
    """A device pool's GPU (`gpu_identity`: its PCI address), so a sender on the same GPU never picks nccl."""
    pool_blocks: int = 0
    local_name: str | None = None
    """Abstract Unix socket name for same-host senders of one-sided transports."""
    shm_ranks: tuple[tuple[str, str, int], ...] = ()
    """A tensor-parallel receiver's other ranks' pools in shared memory (name, nonce, bytes),
    rank 1 first (rank 0's is `shm_name`)."""

    def to_wire(self) -> dict[str, object]:
        d = asdict(self)
        d["transports"] = list(self.transports)
        d["shm_ranks"] = [list(r) for r in self.shm_ranks]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> FabricAddress:
        d = dict(d)
        d["transports"] = tuple(d["transports"])  # type: ignore[arg-type]
        d["shm_ranks"] = tuple(tuple(r) for r in d.get("shm_ranks", ()))  # type: ignore[union-attr]
        return cls(**d)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Ticket:
    address: FabricAddress
    reservation_id: int
    request_id: str
    block_ids: tuple[int, ...]
    num_skip_blocks: int
    lease_s: float

    def to_wire(self) -> dict[str, object]:
        d = asdict(self)
        d["address"] = self.address.to_wire()
        d["block_ids"] = list(self.block_ids)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> Ticket:
        d = dict(d)
        d["address"] = FabricAddress.from_wire(d["address"])  # type: ignore[arg-type]
        d["block_ids"] = tuple(d["block_ids"])  # type: ignore[arg-type]
        return cls(**d)  # type: ignore[arg-type]


def route_address(toward: str, unreachable: str = "127.0.0.1") -> str:
    """This machine's address on its route to `toward` (a connected UDP socket: no packet is
    sent); `unreachable` when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            return str(s.getsockname()[0])
    except OSError:
        return unreachable
