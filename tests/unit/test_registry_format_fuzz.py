"""Property-based fuzzing of the registry's byte formats (what routers read from a shared
Redis): any bytes, and any msgpack structure, parse to a valid entry or raise `BadEntry`,
never anything else, so one malformed entry costs that entry and never the reader."""
from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control.heartbeat import BadEntry, Heartbeat
from control.kv_events import event_from_bytes, event_to_wire
from engine.block_pool import KVEvent
from engine.types import BlockHash

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
leaves = st.none() | st.booleans() | MSGPACK_INTS | \
    st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=40)
structures = st.recursive(leaves, lambda inner: st.lists(inner, max_size=6) |
                          st.dictionaries(st.text(max_size=12) | MSGPACK_INTS, inner, max_size=8), max_leaves=30)
KEYS = ["id", "kind", "hashes", "parent", "worker_id", "role", "state", "address", "num_total_blocks", "sent_at"]
near_valid = st.dictionaries(st.sampled_from(KEYS), structures | st.sampled_from(
    ["stored", "removed", "cleared", "prefill", "decode", "serving"]), max_size=10)


def parses_or_bad(parse, data) -> None:  # type: ignore[no-untyped-def]
    try:
        parse(data)
    except BadEntry:
        pass


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_are_a_kv_event_or_a_bad_entry(data: bytes) -> None:
    parses_or_bad(event_from_bytes, data)


@FUZZ
@given(structures | near_valid)
def test_any_msgpack_is_a_kv_event_or_a_bad_entry(value: object) -> None:
    try:
        ev = event_from_bytes(msgpack.packb(value))
    except BadEntry:
        return
    assert ev.kind in ("stored", "removed", "cleared") and ev.event_id >= 0
    assert all(isinstance(h, bytes) and h for h in ev.block_hashes)


@FUZZ
@given(st.binary(max_size=300) | structures.map(msgpack.packb) | near_valid.map(msgpack.packb))
def test_any_bytes_are_a_heartbeat_or_a_bad_entry(data: bytes) -> None:
    try:
        hb = Heartbeat.from_wire(data)
    except BadEntry:
        return
    assert hb.role in ("prefill", "decode") and isinstance(hb.worker_id, str)
    assert all(isinstance(getattr(hb, n), int) for n in ("num_total_blocks", "num_free_blocks", "block_size"))


@FUZZ
@given(st.integers(0, 2**62), st.sampled_from(["stored", "removed", "cleared"]),
       st.lists(st.binary(min_size=1, max_size=32), max_size=20), st.none() | st.binary(min_size=1, max_size=32))
def test_valid_events_round_trip(event_id: int, kind: str, hashes: list[bytes], parent: bytes | None) -> None:
    ev = KVEvent(event_id, kind, [BlockHash(h) for h in hashes], BlockHash(parent) if parent else None)  # type: ignore[arg-type]
    assert event_from_bytes(msgpack.packb(event_to_wire(ev))) == ev


def test_a_heartbeat_round_trips_and_unknown_fields_are_ignored() -> None:
    hb = Heartbeat("d0", "decode", "10.0.0.2:5000", "serving", "abc", "m", 16, 1000, 512, 64, 60, 2, 1, 0, 0, 10, 5,
                   num_preemptions=3, metrics_address="10.0.0.2:5001", sent_at=1.5)
    assert Heartbeat.from_wire(hb.to_wire()) == hb
    assert Heartbeat.from_wire(msgpack.packb({**msgpack.unpackb(hb.to_wire()), "new_field": [1]})) == hb
