"""The KV event wire format: one msgpack map per engine `KVEvent` in a worker's Redis stream.

Entries are read back by routers from a shared Redis: `event_from_bytes` checks every
field and raises `BadEntry` for anything else, so a malformed entry costs that entry,
never the reader.
"""
from __future__ import annotations

import msgpack

from control.heartbeat import BadEntry
from engine.block_pool import KVEvent
from engine.types import BlockHash

STREAM_MAXLEN = 100_000
"""Approximate cap of a worker's KV event stream; a router that falls behind it sees a gap and resyncs."""
MAX_HASHES_PER_EVENT = 1 << 16
MAX_HASH_BYTES = 64
KINDS = ("stored", "removed", "cleared")


def event_to_wire(ev: KVEvent) -> dict[str, object]:
    d: dict[str, object] = {"id": ev.event_id, "kind": ev.kind, "hashes": list(ev.block_hashes)}
    if ev.parent_block_hash is not None:
        d["parent"] = ev.parent_block_hash
    return d


def event_from_bytes(data: object) -> KVEvent:
    """One stream entry's payload back into a `KVEvent`; raises BadEntry when malformed."""
    if not isinstance(data, bytes):
        raise BadEntry(f"a KV event is msgpack bytes, got {type(data).__name__}")
    try:
        d = msgpack.unpackb(data, raw=False, max_bin_len=MAX_HASHES_PER_EVENT * MAX_HASH_BYTES)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise BadEntry(f"undecodable KV event: {e}") from None
    return event_from_wire(d)


def event_from_wire(d: object) -> KVEvent:
    if not isinstance(d, dict):
        raise BadEntry(f"a KV event is a map, got {type(d).__name__}")
    event_id, kind, hashes, parent = d.get("id"), d.get("kind"), d.get("hashes", []), d.get("parent")
    if not isinstance(event_id, int) or isinstance(event_id, bool) or event_id < 0:
        raise BadEntry(f"KV event id must be a non-negative integer, got {event_id!r:.40}")
    if kind not in KINDS:
        raise BadEntry(f"unknown KV event kind {kind!r:.40}")
    if not isinstance(hashes, list) or len(hashes) > MAX_HASHES_PER_EVENT or not all(_is_hash(h) for h in hashes):
        raise BadEntry(f"KV event hashes must be a list of at most {MAX_HASHES_PER_EVENT} byte strings "
                       f"of 1..{MAX_HASH_BYTES} bytes")
    if parent is not None and not _is_hash(parent):
        raise BadEntry("KV event parent must be a byte string")
    return KVEvent(event_id, kind, [BlockHash(h) for h in hashes], BlockHash(parent) if parent is not None else None)


def _is_hash(h: object) -> bool:
    return isinstance(h, bytes) and 0 < len(h) <= MAX_HASH_BYTES
