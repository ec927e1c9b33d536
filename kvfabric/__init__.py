"""kvfabric: moves KV blocks from prefill to decode workers. Knows nothing of models.

Receiver (decode side) -> `Ticket` -> sender (prefill side) -> `Transfer.push` per
chunk -> `Transfer.finish` -> receiver event `KVArrived`. See receiver.py / sender.py.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "kvfabric.address": ("FabricAddress", "Ticket"),
    "kvfabric.config": ("ReceiverConfig", "SenderConfig"),
    "kvfabric.errors": ("FabricError", "HandshakeError", "PeerUnavailable", "ProtocolError", "ReservationRevoked"),
    "kvfabric.layout": ("FabricLayout", "Run", "coalesce"),
    "kvfabric.receiver": ("FabricReceiver",),
    "kvfabric.region": ("BlockRegion", "ShmKVAllocator", "ShmSegment"),
    "kvfabric.reservations": ("BlocksFenced", "EventOwner", "FabricEvent", "KVArrived", "TransferFailed", "settle"),
    "kvfabric.sender": ("FabricSender", "Transfer"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """Each name is imported from its module on first use: a process that needs only the
    address or the config (the CLI, the controller: control/worker_config.py) does not load
    the receiver and sender (NumPy, the native copy)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
