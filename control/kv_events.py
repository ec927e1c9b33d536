"""The KV event wire format: one msgpack map per engine `KVEvent` in a worker's Redis stream.

Entries are read back by routers from a shared Redis: `event_from_bytes` decodes the one
typed definition (`WireEvent`), checking every field, and raises `BadEntry` for anything
else, so a malformed entry costs that entry, never the reader.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from control.heartbeat import BadEntry
from engine.core.block_pool import KVEvent
from engine.types import BlockHash

STREAM_MAXLEN = 100_000
"""Approximate cap of a worker's KV event stream; a router that falls behind it sees a gap and resyncs."""
MAX_HASHES_PER_EVENT = 1 << 16
MAX_HASH_BYTES = 64


Hash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]


class WireEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """One entry's payload, typed: msgspec decodes and checks it in one step."""

    id: Annotated[int, msgspec.Meta(ge=0)]
    kind: Literal["stored", "removed"]
    hashes: Annotated[list[Hash], msgspec.Meta(max_length=MAX_HASHES_PER_EVENT)] = msgspec.field(default_factory=list)
    parent: Hash | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WireEvent)


def event_to_bytes(ev: KVEvent) -> bytes:
    return _ENCODER.encode(WireEvent(ev.event_id, ev.kind, list(ev.block_hashes), ev.parent_block_hash))


def event_from_bytes(data: object) -> KVEvent:
    """One stream entry's payload back into a `KVEvent`; raises BadEntry when malformed."""
    if not isinstance(data, bytes):
        raise BadEntry(f"a KV event is msgpack bytes, got {type(data).__name__}")
    try:
        w = _DECODER.decode(data)
    except msgspec.DecodeError as e:  # ValidationError too: a wrong type, a bound, an unknown kind
        raise BadEntry(f"KV event: {e}") from None
    return KVEvent(w.id, w.kind, [BlockHash(h) for h in w.hashes], BlockHash(w.parent) if w.parent is not None else None)
