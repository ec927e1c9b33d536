"""kvfabric: moves KV blocks from prefill to decode workers. Knows nothing of models.

Receiver (decode side) -> `Ticket` -> sender (prefill side) -> `Transfer.push` per
chunk -> `Transfer.finish` -> receiver event `KVArrived`. See receiver.py / sender.py.
"""
from kvfabric.address import FabricAddress, Ticket
from kvfabric.config import ReceiverConfig, SenderConfig
from kvfabric.errors import FabricError, HandshakeError, PeerUnavailable, ProtocolError, ReservationRevoked
from kvfabric.layout import FabricLayout, Run, coalesce
from kvfabric.receiver import FabricReceiver
from kvfabric.region import BlockRegion, ShmKVAllocator, ShmSegment
from kvfabric.reservations import BlocksFenced, EventOwner, FabricEvent, KVArrived, TransferFailed, settle
from kvfabric.sender import FabricSender, Transfer

__all__ = [
    "BlockRegion", "BlocksFenced", "EventOwner", "FabricAddress", "FabricError", "FabricEvent", "FabricLayout",
    "FabricReceiver", "FabricSender", "HandshakeError", "KVArrived", "PeerUnavailable", "ProtocolError",
    "ReceiverConfig", "ReservationRevoked", "Run", "SenderConfig", "ShmKVAllocator", "ShmSegment",
    "Ticket", "Transfer", "TransferFailed", "coalesce", "settle",
]
