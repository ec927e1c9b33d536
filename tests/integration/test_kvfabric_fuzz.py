"""Property-based fuzzing of a real kvfabric receiver's connection parser.

Each example opens a connection, completes the handshake, opens a real reservation and
then sends a generated sequence of frames: well-formed, malformed (wrong types, missing
fields, unknown types, absurd sizes and block runs) and raw garbage. Whatever arrives,
only that connection may end: the receiver keeps serving (a clean transfer on a new
connection succeeds afterwards), no byte outside the reserved blocks changes, and no
reservation is left behind. The long coverage-guided run is `benchmarks/hostile/fuzz_parsers.py`.
"""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric import BlockRegion, FabricReceiver, ReceiverConfig
from tests.integration.fabric_peer import LAYOUT

BB = LAYOUT.block_bytes
NUM_BLOCKS = 8
RESERVED = [2, 3]
SENTINEL = 0x5A

ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, 2, -1, NUM_BLOCKS, 2**31, BB])
values = st.none() | st.booleans() | ints | st.floats() | st.text(max_size=8) | st.binary(max_size=8) | \
    st.lists(st.lists(ints, max_size=3), max_size=4)
TYPES = ["open", "renew", "ready", "revoke_ack", "abort", "data", "nccl_data", "hello", "bogus"]
FIELDS = ["rid", "rids", "runs", "nbytes", "crc32", "first_token_id", "num_tokens", "reason", "t"]


OURS = object()
"""Stands for the example's reservation id, known only once the example runs."""


@st.composite
def messages(draw: st.DrawFn) -> tuple[object, bytes]:
    """One frame: a header (near the format, a data frame aimed at the example's reservation
    with block runs in or out of its range, any msgpack value, or garbage bytes) and maybe a
    payload after it. The header is encoded by `encode`, once the reservation id is known."""
    kind = draw(st.sampled_from(["near", "ours", "ours", "ours", "raw", "garbage"]))
    fill = bytes([draw(st.integers(0, 255))])  # payloads are one byte repeated: block-sized random ones overflow
    payload = fill * draw(st.sampled_from([0, 0, 1, BB - 1, BB, 2 * BB]))  # hypothesis's data budget
    if kind == "garbage":
        return draw(st.binary(max_size=64)), b""
    if kind == "raw":
        return draw(values), payload
    if kind == "ours":
        first, n = draw(st.integers(-1, len(RESERVED))), draw(st.integers(0, len(RESERVED)))
        payload = fill * (n * BB)
        return {"t": "data", "rid": OURS, "runs": [[first, n]], "nbytes": n * BB}, payload
    header = {"t": draw(st.sampled_from(TYPES))}
    header.update(draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)))
    if draw(st.booleans()):
        header["rid"] = OURS
    return header, payload


def encode(message: tuple[object, bytes], rid: int) -> bytes:
    header, payload = message
    if isinstance(header, bytes):  # garbage: sent as it is
        return header
    if isinstance(header, dict):
        header = {k: rid if v is OURS else v for k, v in header.items()}
    body = msgpack.packb(header)
    return struct.pack(">I", len(body)) + body + payload


CRASHES: list[str] = []
"""Exceptions that escaped a receiver thread (a parser bug: every bad frame must be a clean error)."""


@pytest.fixture(scope="module")
def receiver() -> Iterator[FabricReceiver]:
    hook = threading.excepthook
    threading.excepthook = lambda args: CRASHES.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    region = BlockRegion(np.full((NUM_BLOCKS, BB), SENTINEL, np.uint8))
    r = FabricReceiver(LAYOUT, region, ReceiverConfig(lease_s=5, io_timeout_s=0.2))
    yield r
    r.close()
    threading.excepthook = hook


def frame(msg: dict) -> bytes:
    body = msgpack.packb(msg)
    return struct.pack(">I", len(body)) + body


def connect(receiver: FabricReceiver) -> socket.socket:
    sock = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
    for expected in ("challenge", "hello_ok"):
        if expected == "hello_ok":
            sock.sendall(frame({"t": "hello", "layout": LAYOUT.to_wire(), "transport": "tcp", "host_id": "x"}))
        (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        assert msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))["t"] == expected
    return sock


def until_acked_or_closed(sock: socket.socket) -> None:
    """Reads replies until the `ready_ack` or the receiver closing the connection (2 s at most)."""
    sock.settimeout(2.0)
    while True:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return
        (n,) = struct.unpack(">I", head)
        if msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL)).get("t") == "ready_ack":
            return


def settle(receiver: FabricReceiver, request_id: str) -> None:
    """Ends the example's reservation (whatever state the fuzz left it in) and drains events."""
    receiver.cancel(request_id)
    for _ in range(50):
        receiver.poll(timeout_s=0.02)
        if len(receiver.table) == 0:
            return
    raise AssertionError(f"a reservation was left behind: {len(receiver.table)}")


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(messages(), min_size=1, max_size=6))
def test_malformed_frames_end_only_their_connection(receiver: FabricReceiver,
                                                    frames: list[tuple[object, bytes]]) -> None:
    region = receiver.region.array
    region[RESERVED] = SENTINEL
    sock = connect(receiver)
    ticket = receiver.expect("fuzz", RESERVED, 0)
    try:
        sock.sendall(frame({"t": "open", "rid": ticket.reservation_id}))
        for f in frames:
            sock.sendall(encode(f, ticket.reservation_id))
        sock.sendall(frame({"t": "ready", "rid": ticket.reservation_id, "first_token_id": 1, "num_tokens": 4}))
        until_acked_or_closed(sock)  # the receiver has handled every frame before the reservation ends
    except TimeoutError:  # an OSError too: not the receiver closing, but hanging the connection
        raise AssertionError("the receiver neither acknowledged `ready` nor closed the connection in 2 s") from None
    except OSError:
        pass  # the receiver closed the connection: allowed
    finally:
        sock.close()
    settle(receiver, "fuzz")
    assert not CRASHES, CRASHES
    others = [b for b in range(NUM_BLOCKS) if b not in RESERVED]
    assert (region[others] == SENTINEL).all(), "a write landed outside the reserved blocks"
    # the receiver still serves: a clean transfer on a new connection lands exactly
    sock = connect(receiver)
    ticket = receiver.expect("clean", [5], 0)
    payload = np.full(BB, 7, np.uint8).tobytes()
    sock.sendall(frame({"t": "open", "rid": ticket.reservation_id}))
    sock.sendall(frame({"t": "data", "rid": ticket.reservation_id, "runs": [[0, 1]], "nbytes": BB}) + payload)
    sock.sendall(frame({"t": "ready", "rid": ticket.reservation_id, "first_token_id": 1, "num_tokens": 4}))
    replies = []
    while not replies or replies[-1]["t"] != "ready_ack":
        (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        replies.append(msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL)))
    assert replies[-1]["error"] is None and (region[5] == 7).all()
    sock.close()
    region[5] = SENTINEL
    settle(receiver, "clean")
