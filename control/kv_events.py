"""The KV event wire format: one msgpack map per engine `KVEvent` in a worker's Redis stream."""
from __future__ import annotations

from engine.block_pool import KVEvent
from engine.types import BlockHash

STREAM_MAXLEN = 100_000
"""Approximate cap of a worker's KV event stream; a router that falls behind it sees a gap and resyncs."""


def event_to_wire(ev: KVEvent) -> dict[str, object]:
    d: dict[str, object] = {"id": ev.event_id, "kind": ev.kind, "hashes": list(ev.block_hashes)}
    if ev.parent_block_hash is not None:
        d["parent"] = ev.parent_block_hash
    return d


def event_from_wire(d: dict[str, object]) -> KVEvent:
    kind = d["kind"]
    if kind not in ("stored", "removed", "cleared"):
        raise ValueError(f"unknown KV event kind {kind!r}")
    parent = d.get("parent")
    return KVEvent(int(d["id"]), kind, [BlockHash(bytes(h)) for h in d.get("hashes", ())],  # type: ignore[arg-type, union-attr]
                   BlockHash(bytes(parent)) if parent is not None else None)  # type: ignore[arg-type]
