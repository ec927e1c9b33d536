"""Bad bytes on a kvfabric connection: truncated, corrupt and malformed frames are errors,
never silent data; frames for revoked reservations are dropped. Driven by a raw socket
client speaking the wire format by hand (not our sender), against a real receiver.
"""
from __future__ import annotations

import socket
import struct
import time
import zlib
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from kvfabric import BlockRegion, FabricReceiver, ReceiverConfig, TransferFailed
from kvfabric.wire import prove
from tests.integration.fabric_peer import LAYOUT

BB = LAYOUT.block_bytes


@pytest.fixture
def receiver() -> Iterator[FabricReceiver]:
    region = BlockRegion(np.zeros((8, BB), np.uint8))
    r = FabricReceiver(LAYOUT, region, ReceiverConfig(lease_s=5, io_timeout_s=1))
    yield r
    r.close()


def frame(msg: dict) -> bytes:
    body = msgpack.packb(msg)
    return struct.pack(">I", len(body)) + body


def read(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))


def connect(receiver: FabricReceiver) -> socket.socket:
    sock = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
    assert read(sock)["t"] == "challenge"
    sock.sendall(frame({"t": "hello", "layout": LAYOUT.to_wire(), "transport": "tcp", "host_id": "x"}))
    assert read(sock)["t"] == "hello_ok"
    return sock


def open_reservation(receiver: FabricReceiver, sock: socket.socket, rid: str, block_ids: list[int]) -> int:
    ticket = receiver.expect(rid, block_ids, 0)
    sock.sendall(frame({"t": "open", "rid": ticket.reservation_id}))
    assert read(sock) == {"t": "open_ok", "rid": ticket.reservation_id}
    return ticket.reservation_id


def failures(receiver: FabricReceiver) -> list[TransferFailed]:
    events = receiver.poll(timeout_s=3)
    assert all(isinstance(e, TransferFailed) for e in events)
    return events  # type: ignore[return-value]


def test_truncated_payload_fails_the_transfer(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    rid = open_reservation(receiver, sock, "t", [2, 3])
    sock.sendall(frame({"t": "data", "rid": rid, "runs": [[0, 2]], "nbytes": 2 * BB}) + b"\x01" * 100)
    sock.close()
    [ev] = failures(receiver)
    assert ev.request_id == "t" and not ev.blocks_held
    assert "truncated frame" in ev.reason and f"100 of {2 * BB} payload bytes" in ev.reason
    assert len(receiver.table) == 0


def test_checksum_mismatch_fails_the_transfer_and_ready_is_refused(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    rid = open_reservation(receiver, sock, "c", [4])
    payload = np.full(BB, 7, np.uint8).tobytes()
    sock.sendall(frame({"t": "data", "rid": rid, "runs": [[0, 1]], "nbytes": BB, "crc32": zlib.crc32(payload) ^ 1}) + payload)
    [ev] = failures(receiver)
    assert ev.reason == "checksum mismatch in a frame of 1 runs starting at block position 0"
    assert read(sock) == {"t": "revoke", "rid": rid, "reason": ev.reason}  # the sender is told to stop
    sock.sendall(frame({"t": "ready", "rid": rid, "first_token_id": 1, "num_tokens": 4}))
    assert read(sock)["error"] == f"reservation {rid} is unknown, expired or revoked"
    sock.close()


def test_garbage_header_closes_the_connection_and_fails_its_transfers(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    open_reservation(receiver, sock, "g", [1])
    sock.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    [ev] = failures(receiver)
    assert ev.request_id == "g" and "undecodable header" in ev.reason
    assert sock.recv(1) == b""  # closed by the receiver


def test_oversized_header_and_wrong_payload_size_are_protocol_errors(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    open_reservation(receiver, sock, "o", [1])
    sock.sendall(struct.pack(">I", 1 << 30))
    [ev] = failures(receiver)
    assert "header length" in ev.reason
    sock = connect(receiver)
    rid = open_reservation(receiver, sock, "w", [1])
    sock.sendall(frame({"t": "data", "rid": rid, "runs": [[0, 1]], "nbytes": BB - 1}))
    [ev] = failures(receiver)
    assert f"carries {BB - 1} bytes" in ev.reason


def test_frames_for_a_revoked_reservation_are_dropped(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    rid = open_reservation(receiver, sock, "r", [5])
    assert receiver.cancel("r") is False  # two-sided, nothing in flight: blocks free at once
    assert read(sock) == {"t": "revoke", "rid": rid, "reason": "aborted"}
    payload = np.full(BB, 9, np.uint8).tobytes()
    sock.sendall(frame({"t": "data", "rid": rid, "runs": [[0, 1]], "nbytes": BB}) + payload)
    rid2 = open_reservation(receiver, sock, "r2", [6])  # the connection is still in step
    sock.sendall(frame({"t": "data", "rid": rid2, "runs": [[0, 1]], "nbytes": BB}) + payload)
    sock.sendall(frame({"t": "ready", "rid": rid2, "first_token_id": 3, "num_tokens": 4}))
    assert read(sock)["error"] is None
    assert not receiver.region.array[5].any()  # dropped
    assert (receiver.region.array[6] == 9).all()
    sock.close()


def test_a_sender_that_stalls_mid_frame_is_cut_off_after_the_io_timeout(receiver: FabricReceiver) -> None:
    sock = connect(receiver)
    open_reservation(receiver, sock, "s", [1])
    rid = receiver.table._by_request["s"]
    sock.sendall(frame({"t": "data", "rid": rid, "runs": [[0, 1]], "nbytes": BB}) + b"\x00" * 10)
    t0 = time.monotonic()
    [ev] = failures(receiver)
    assert "stalled mid-frame" in ev.reason and time.monotonic() - t0 < 2.5
    sock.close()


def test_a_late_open_after_expiry_is_refused_before_any_byte_moves() -> None:
    region = BlockRegion(np.zeros((4, BB), np.uint8))
    receiver = FabricReceiver(LAYOUT, region, ReceiverConfig(lease_s=0.1, io_timeout_s=1))
    try:
        sock = connect(receiver)
        ticket = receiver.expect("late", [0], 0)
        [ev] = receiver.poll(timeout_s=1)
        assert isinstance(ev, TransferFailed)
        sock.sendall(frame({"t": "open", "rid": ticket.reservation_id}))
        reply = read(sock)
        assert reply["t"] == "open_err" and "expired or revoked" in reply["error"]
        sock.close()
    finally:
        receiver.close()


def test_a_receiver_with_a_token_refuses_a_sender_that_does_not_prove_it_on_this_connection() -> None:
    """The hello answers the connection's own challenge (an HMAC keyed by the token, which never
    travels): no proof, the token itself, a wrong key's proof, and a hello recorded from an
    earlier connection (a replay) are each refused before a reservation can be opened; the
    right proof is let in, and the receiver proves the token back for the sender's nonce."""
    region = BlockRegion(np.zeros((4, BB), np.uint8))
    receiver = FabricReceiver(LAYOUT, region, ReceiverConfig(lease_s=5, io_timeout_s=1, token="t0ken"))

    def dial() -> tuple[socket.socket, str]:
        sock = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
        challenge = read(sock)
        assert challenge["t"] == "challenge" and len(challenge["nonce"]) == 64
        return sock, challenge["nonce"]

    try:
        hello = {"t": "hello", "layout": LAYOUT.to_wire(), "transport": "tcp", "host_id": "x", "nonce": "n" * 64}
        sock, first_nonce = dial()
        recorded = {**hello, "proof": prove("t0ken", "sender", first_nonce, "n" * 64)}
        sock.close()  # a connection an eavesdropper watched
        for shown in ({}, {"proof": "t0ken"}, {"token": "t0ken"},
                      {"proof": prove("wrong", "sender", "?", "n" * 64)}, recorded):
            sock, nonce = dial()
            assert nonce != first_nonce
            sock.sendall(frame({**hello, **shown}))
            reply = read(sock)
            assert reply["t"] == "hello_err" and reply["field"] == "token", shown
            assert reply["error"] == "the sender did not prove the cluster secret"
            assert sock.recv(1) == b""  # closed: no reservation can be opened, no byte written
            sock.close()
        ticket = receiver.expect("ok", [1], 0)
        sock, nonce = dial()
        sock.sendall(frame({**hello, "proof": prove("t0ken", "sender", nonce, "n" * 64)}))
        ok = read(sock)
        assert ok["t"] == "hello_ok" and ok["proof"] == prove("t0ken", "receiver", nonce, "n" * 64)
        sock.sendall(frame({"t": "open", "rid": ticket.reservation_id}))
        assert read(sock) == {"t": "open_ok", "rid": ticket.reservation_id}
        sock.close()
        assert not region.array.any()
    finally:
        receiver.close()
