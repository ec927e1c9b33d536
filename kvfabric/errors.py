"""kvfabric's error hierarchy: every failure a caller can act on has its own type."""
from __future__ import annotations


class FabricError(Exception):
    """Base of every kvfabric error."""


class HandshakeError(FabricError):
    """The two sides cannot exchange blocks; `field` names the first incompatibility."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PeerUnavailable(FabricError):
    """The other side is gone or did not answer in time."""


class ReservationRevoked(FabricError):
    """The receiver revoked (lease expired, aborted) or never knew the reservation."""


class ProtocolError(FabricError):
    """A malformed, truncated or corrupt frame; the connection is closed."""
