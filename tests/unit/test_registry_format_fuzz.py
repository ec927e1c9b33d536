"""Property-based fuzzing of the registry's byte formats (what routers read from a shared
Redis): any bytes, and any msgpack structure, parse to a valid entry or raise `BadEntry`,
never anything else, so one malformed entry costs that entry and never the reader."""
from __future__ import annotations

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control.heartbeat import BadEntry, Heartbeat, ModelFacts
from control.kv_events import event_from_bytes, event_to_bytes
from control.router_stats import (ControllerStatus, RouterStats, controller_status_from_wire, router_stats_from_wire,
                                  to_wire)
from engine.core.block_pool import KVEvent
from engine.types import BlockHash, EngineLoad

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
leaves = st.none() | st.booleans() | MSGPACK_INTS | \
    st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=40)
structures = st.recursive(leaves, lambda inner: st.lists(inner, max_size=6) |
                          st.dictionaries(st.text(max_size=12) | MSGPACK_INTS, inner, max_size=8), max_leaves=30)
KEYS = ["id", "kind", "hashes", "parent", "worker_id", "role", "state", "address", "facts", "load", "sent_at",
        "num_total_blocks", "step_profile"]
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
    assert ev.kind in ("stored", "removed") and ev.event_id >= 0
    assert all(isinstance(h, bytes) and h for h in ev.block_hashes)


@FUZZ
@given(st.binary(max_size=300) | structures.map(msgpack.packb) | near_valid.map(msgpack.packb))
def test_any_bytes_are_a_heartbeat_or_a_bad_entry(data: bytes) -> None:
    try:
        hb = Heartbeat.from_wire(data)
    except BadEntry:
        return
    assert hb.role in ("prefill", "decode") and isinstance(hb.worker_id, str)
    assert all(isinstance(getattr(hb.load, n), int) for n in ("num_total_blocks", "num_free_blocks", "num_running"))
    assert isinstance(hb.facts.block_size, int) and isinstance(hb.load.spec_accepted_per_pos, tuple)


@FUZZ
@given(st.integers(0, 2**62), st.sampled_from(["stored", "removed"]),
       st.lists(st.binary(min_size=1, max_size=32), max_size=20), st.none() | st.binary(min_size=1, max_size=32))
def test_valid_events_round_trip(event_id: int, kind: str, hashes: list[bytes], parent: bytes | None) -> None:
    ev = KVEvent(event_id, kind, [BlockHash(h) for h in hashes], BlockHash(parent) if parent else None)  # type: ignore[arg-type]
    assert event_from_bytes(event_to_bytes(ev)) == ev


def test_a_heartbeat_round_trips_and_unknown_fields_are_ignored() -> None:
    hb = Heartbeat("d0", "decode", "10.0.0.2:5000", "serving", "abc", ModelFacts("m", 16, 1000, 512, 64),
                   EngineLoad(64, 60, 2, 1, 0, 0, 10, 5, num_preemptions=3, spec_accepted_per_pos=(4, 1)),
                   metrics_address="10.0.0.2:5001", sent_at=1.5)
    assert Heartbeat.from_wire(hb.to_wire()) == hb
    wire = msgpack.unpackb(hb.to_wire())
    assert Heartbeat.from_wire(msgpack.packb({**wire, "new_field": [1]})) == hb
    assert Heartbeat.from_wire(msgpack.packb({**wire, "load": {**wire["load"], "new_count": 2}})) == hb


def test_a_heartbeat_with_a_wrong_type_anywhere_is_a_bad_entry_naming_it() -> None:
    wire = msgpack.unpackb(Heartbeat("d0", "decode", load=EngineLoad(64, 60, 2, 1, 0, 0, 10, 5)).to_wire())
    for bad, where in (({**wire, "load": {**wire["load"], "num_free_blocks": True}}, "$.load.num_free_blocks"),
                       ({**wire, "role": "router"}, "$.role"),
                       ({**wire, "facts": {"block_size": "16"}}, "$.facts.block_size"),
                       ({**wire, "step_profile": [0.5, 10, 0.001]}, "step_profile")):
        try:
            Heartbeat.from_wire(msgpack.packb(bad))
        except BadEntry as e:
            assert where in str(e), e
        else:
            raise AssertionError(f"accepted {bad}")


def test_a_store_entry_is_read_through_its_one_typed_definition() -> None:
    """kvstore/host.py writes its entry as JSON with counters beside the two fields readers
    need; routers (control/reader.py) and workers (kvstore/host.py find_store) read it through
    `store_entry` alone: the counters ignored, a missing, empty or mistyped field refused."""
    import json

    from control.heartbeat import StoreEntry, store_entry

    full = {"address": "10.0.0.5:4010", "store_id": "kvstore-ab12", "host_id": "h", "num_blocks": 3,
            "num_offered": 9}
    assert store_entry(json.dumps(full)) == StoreEntry("10.0.0.5:4010", "kvstore-ab12")
    for bad in ({"store_id": "s"}, {"address": "", "store_id": "s"}, {"address": 4, "store_id": "s"}, [1], "x"):
        with pytest.raises(ValueError, match="address and store_id"):
            store_entry(json.dumps(bad))
    with pytest.raises(ValueError, match="address and store_id"):
        store_entry(b"{not json")


@FUZZ
@given(st.binary(max_size=300) | structures.map(msgpack.packb) | near_valid.map(msgpack.packb))
def test_any_bytes_are_router_stats_or_a_controller_status_or_a_bad_entry(data: bytes) -> None:
    for parse in (router_stats_from_wire, controller_status_from_wire):
        parses_or_bad(parse, data)


def test_router_stats_and_the_controller_status_are_typed_on_the_wire() -> None:
    """A router's stats round-trip; a field of the wrong type is a BadEntry naming it (it was
    a loose map read with float() and .get()); a newer version's fields are ignored."""
    stats = RouterStats(router_id="router-0", address="10.0.0.1:50051", num_requests=3, inflight_tokens=450,
                        budget_tokens=1000, serving={"decode": ["decode-0"]}, itl_p50_ms=21.5)
    assert router_stats_from_wire(to_wire(stats)) == stats
    with pytest.raises(BadEntry, match=r"a router's stats: Expected `float \| null`, got `str` - at `\$.itl_p50_ms`"):
        router_stats_from_wire(msgpack.packb({"router_id": "r", "address": "a", "itl_p50_ms": "fast"}))
    with pytest.raises(BadEntry, match="missing required field `router_id`"):
        router_stats_from_wire(msgpack.packb({"itl_p50_ms": 1e6}))
    newer = msgpack.packb({**msgspec.to_builtins(stats), "num_something_new": 7})
    assert router_stats_from_wire(newer) == stats
    status = ControllerStatus(targets={"prefill": 1, "decode": 2}, workers={"decode-0": "serving"},
                              drains=[{"worker_id": "decode-1", "requests": 2}], pid=7)
    assert controller_status_from_wire(to_wire(status)) == status
    with pytest.raises(BadEntry, match="the controller's status"):
        controller_status_from_wire(msgpack.packb({"targets": {"decode": "two"}, "workers": {}}))
