"""The settings of kvfabric's two ends (every field documented, units in names, validated)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

TRANSPORTS = ("shm", "tcp", "cuda_ipc", "nccl", "nixl")
"""shm / cuda_ipc: one host (the sender writes into the receiver's pool); tcp / nccl: any two
hosts; nixl: any two hosts, host or device pools (the sender writes into the receiver's
registered pool through NIXL, kvfabric/nixl.py), where the receiver offers it."""


@dataclass(frozen=True)
class SenderConfig:
    io_timeout_s: float = 10.0
    """Bound on connecting and on any single send."""
    ack_timeout_s: float = 5.0
    """Bound on waiting for the receiver to answer open/ready."""
    renew_interval_s: float = 2.0
    """How often open transfers renew their lease (keep well under the lease)."""
    checksum: bool = False
    """tcp: send a CRC32 per frame; the receiver fails the transfer on mismatch."""
    transport: str | None = None
    """Force one of `TRANSPORTS`; None picks the best one the pair supports (`pick_transport`)."""
    token: str | None = field(default=None, repr=False)
    """The cluster's token: the hello proves it for the receiver's challenge (the token itself
    never travels), and the receiver must prove it back (`ReceiverConfig.token`)."""
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    """A client context: tcp connections under TLS (control/tls.py); None: plain."""

    def __post_init__(self) -> None:
        for f in ("io_timeout_s", "ack_timeout_s", "renew_interval_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"SenderConfig.{f} must be positive, got {getattr(self, f)}")
        if self.transport not in (None, *TRANSPORTS):
            raise ValueError(f"SenderConfig.transport must be one of {TRANSPORTS} or None, got {self.transport!r}")


@dataclass(frozen=True)
class ReceiverConfig:
    host: str = "127.0.0.1"
    """Interface to listen on; loopback unless configured otherwise."""
    port: int = 0
    """0 picks a free port."""
    lease_s: float = 10.0
    """A reservation not renewed, written or completed for this long is revoked."""
    io_timeout_s: float = 10.0
    """Bound on any single send, and on a frame that has started arriving."""
    advertise_host: str | None = None
    """Host senders should dial (defaults to `host`)."""
    token: str | None = field(default=None, repr=False)
    """When set, a sender's hello must prove it for this connection's challenge (kvfabric/wire.py
    `prove`), else the handshake is refused before any reservation can be opened or byte written."""
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    """A server context: connections to the tcp listener must speak TLS with a certificate it
    trusts (control/tls.py); None: plain. The same-host Unix socket stays plain."""
    hello_timeout_s: float = 5.0
    """A connection's whole hello must arrive within this of its accept, however it trickles."""
    nixl: bool = False
    """Offer `nixl` too: a NIXL agent with this receiver's pools registered (kvfabric/nixl.py).
    Where NIXL cannot load or start, the receiver offers what it would without, and says so once."""
    max_pending_hellos: int = 64
    """Connections accepted whose hello has not arrived, at most: past it the longest waiting
    one is closed (a flood of silent connections churns through the slots, while a real
    sender, whose hello follows its connect at once, gets through)."""

    def __post_init__(self) -> None:
        if self.max_pending_hellos < 1:
            raise ValueError(f"ReceiverConfig.max_pending_hellos must be at least 1, got {self.max_pending_hellos}")
        for f in ("lease_s", "io_timeout_s", "hello_timeout_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ReceiverConfig.{f} must be positive, got {getattr(self, f)}")
