"""Handshake compatibility and block-run coalescing."""
from __future__ import annotations

import dataclasses

import pytest

from kvfabric.address import FabricAddress, Ticket
from kvfabric.layout import FabricLayout, Run, coalesce, merge_spans

LAYOUT = FabricLayout("llama-tiny", "bfloat16", num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype_bytes=2)


def test_block_bytes_of_a_llama3_8b_block() -> None:
    l8b = FabricLayout("llama3-8b", "bfloat16", 32, 16, 8, 128, 2)
    assert l8b.block_bytes == 2 * 1024 * 1024


@pytest.mark.parametrize(
    "field,value",
    [("model_id", "other"), ("dtype", "float16"), ("num_layers", 3), ("block_size", 32),
     ("num_kv_heads", 4), ("head_dim", 8), ("dtype_bytes", 4), ("layout", "layer_major")],
)
def test_any_difference_changes_the_hash_and_is_named(field: str, value: object) -> None:
    other = dataclasses.replace(LAYOUT, **{field: value})
    assert other.compat_hash != LAYOUT.compat_hash
    assert LAYOUT.first_mismatch(other) == field


def test_identical_layouts_match_and_survive_the_wire() -> None:
    again = FabricLayout.from_wire(LAYOUT.to_wire())
    assert again == LAYOUT and again.compat_hash == LAYOUT.compat_hash
    assert LAYOUT.first_mismatch(again) is None
    with pytest.raises(ValueError, match="unknown layout fields"):
        FabricLayout.from_wire({**LAYOUT.to_wire(), "sliding_window": 4})
    with pytest.raises(ValueError, match="block_size must be positive"):
        dataclasses.replace(LAYOUT, block_size=0)


def test_coalesce_merges_runs_adjacent_on_both_sides() -> None:
    assert coalesce([3, 4, 5, 9, 10, 2], [7, 8, 9, 10, 11, 12], first_index=2) == [
        Run(2, 3, 7, 3),   # 3,4,5 -> 7,8,9
        Run(5, 9, 10, 2),  # 9,10 -> 10,11 (source jumps 5 -> 9)
        Run(7, 2, 12, 1),  # source goes backwards
    ]
    assert coalesce([1, 2, 3], [5, 7, 8]) == [Run(0, 1, 5, 1), Run(1, 2, 7, 2)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="3 source blocks for 2"):
        coalesce([1, 2, 3], [1, 2])


def test_one_sided_writes_are_reported_as_spans_merged_by_position() -> None:
    spans: list[list[int]] = []
    runs = coalesce([9, 3, 4, 17], [30, 22, 23, 35], first_index=2)  # scattered: three runs
    merge_spans(spans, [[r.index, r.num_blocks] for r in runs])
    assert spans == [[2, 4]]
    merge_spans(spans, [[6, 2]])  # the next push continues where the last ended
    merge_spans(spans, [[10, 1]])  # a gap stays a gap
    assert spans == [[2, 6], [10, 1]]


def test_ticket_round_trips_through_msgpack() -> None:
    import msgpack

    addr = FabricAddress("127.0.0.1", 5555, "h/b", "r1", "cpu", ("shm", "tcp"), "splitserve-kv-1-ab", "n" * 32, 4096)
    ticket = Ticket(addr, 2**62 + 5, "req", (4, 5, 9), 1, 10.0)
    assert Ticket.from_wire(msgpack.unpackb(msgpack.packb(ticket.to_wire()))) == ticket


def test_the_cpu_fabric_imports_neither_torch_nor_cupy() -> None:
    import subprocess
    import sys

    code = "import sys, kvfabric, kvfabric.receiver, kvfabric.sender; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_messages_are_typed_both_ways_and_a_bad_field_is_named() -> None:
    import msgpack
    import pytest

    from kvfabric.errors import ProtocolError
    from kvfabric.wire import (Data, Hello, HelloOk, HelloReply, OpenErr, Ready, ReadyAck, ReceiverMessage, Revoke,
                               SenderMessage, decode, encode)

    def parse(msg: dict, kind: object) -> object:
        return decode(msgpack.packb(msg), kind)
    assert parse({"t": "data", "rid": 5, "runs": [[2, 3]], "nbytes": 96}, ReceiverMessage) == Data(5, [(2, 3)], 96)
    assert parse({"t": "ready", "rid": 5, "first_token_id": 7, "num_tokens": 40, "new": 1}, ReceiverMessage) == \
        Ready(5, 7, 40)  # a newer sender's extra field is ignored
    # the receiver's replies: maps of the same form, defaults left out
    assert msgpack.unpackb(encode(ReadyAck(5, None))) == {"t": "ready_ack", "rid": 5, "error": None}
    assert msgpack.unpackb(encode(HelloOk("r", {}))) == {"t": "hello_ok", "receiver_id": "r", "layout": {}}
    assert msgpack.unpackb(encode(Revoke(5, "lease expired"))) == {"t": "revoke", "rid": 5, "reason": "lease expired"}
    assert parse({"t": "open_err", "rid": 5, "error": "expired"}, SenderMessage) == OpenErr(5, "expired")
    assert parse({"t": "hello_ok", "receiver_id": "r", "layout": {"a": 1}}, HelloReply) == HelloOk("r", {"a": 1})
    with pytest.raises(ProtocolError, match="undecodable header"):
        decode(b"\xc1", ReceiverMessage)
    for bad, named in (({"t": "data", "rid": "5", "runs": [], "nbytes": 0}, "$.rid"),
                       ({"t": "ready", "rid": True, "first_token_id": 7, "num_tokens": 40}, "$.rid"),
                       ({"t": "data", "rid": 5, "runs": [[1, 2, 3]], "nbytes": 0}, "$.runs[0]"),
                       ({"t": "renew", "rids": list(range((1 << 16) + 1))}, "$.rids"),
                       ({"t": "open"}, "rid"),
                       ({"t": "hello", "layout": {}, "transport": 4}, "$.transport"),
                       ({"t": "launch", "rid": 1}, "$.t"),
                       ({"t": "ready_ack", "rid": 1, "error": 3}, "$.error")):
        with pytest.raises(ProtocolError, match=named.replace("[", r"\[").replace("$", r"\$")):
            parse(bad, Hello if bad["t"] == "hello" else SenderMessage if bad["t"] == "ready_ack" else ReceiverMessage)
