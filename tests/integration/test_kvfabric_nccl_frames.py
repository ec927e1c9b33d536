"""NCCL frames stay in step without a GPU: a link that counts operations stands in for the
communicator, while the real sender and receiver code decide what to post.

NCCL pairs the n-th send with the n-th receive, so a frame the receiver drops (revoked,
expired, unknown) must post exactly the receives the sender's sends expect: one per run,
of the same sizes. A dropped multi-run frame used to post one receive for the whole frame.
"""
from __future__ import annotations

import threading
import time

import pytest

from kvfabric import FabricReceiver, ReceiverConfig, coalesce
from kvfabric.cuda import DeviceRegion
from kvfabric.sender import _Peer
from kvfabric.wire import Message, NcclData, Revoke, RevokeAck
from tests.integration.fabric_peer import LAYOUT

BB = LAYOUT.block_bytes


class CountingLink:
    """The `NcclLink` surface, counting bytes per operation instead of moving them."""

    def __init__(self) -> None:
        self.sends: list[list[int]] = []
        self.recvs: list[list[int]] = []

    def exchange(self, peer: int, sends: list[tuple[int, int]], recvs: list[tuple[int, int]], timeout_s: float,
                 after: object = None) -> None:
        if sends:
            self.sends.append([n for _, n in sends])
        if recvs:
            self.recvs.append([n for _, n in recvs])

    def scratch(self, nbytes: int) -> tuple[int, object]:
        return 1 << 40, bytearray(0)


class SentHeaders:
    def __init__(self) -> None:
        self.headers: list[Message] = []

    def send(self, msg: Message, payload: object = None) -> None:
        self.headers.append(msg)


def sender_frame(link: CountingLink, src_ids: list[int], dst_ids: list[int]) -> NcclData:
    """What the real sender posts for one push over nccl: its header and (on the link) its sends."""
    peer = object.__new__(_Peer)  # the transfer-writing part of a peer, without a connection
    peer.ipc, peer.link, peer.conn = None, link, SentHeaders()
    peer.sender = type("S", (), {"layout": LAYOUT})()
    peer.config = type("C", (), {"io_timeout_s": 5.0})()
    peer._frame_lock = threading.Lock()
    transfer = type("T", (), {"ticket": type("K", (), {"reservation_id": 7})()})()
    runs = coalesce(src_ids, dst_ids)
    peer._write_device(transfer, DeviceRegion(1 << 30, 64, BB, 0), runs, [[r.index, r.num_blocks] for r in runs])
    [header] = peer.conn.headers
    return header


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    rx = FabricReceiver(LAYOUT, DeviceRegion(1 << 32, 64, BB, 0), ReceiverConfig())
    yield rx
    rx.close()


def test_a_dropped_multi_run_frame_posts_exactly_the_receives_the_sender_sent(receiver: FabricReceiver) -> None:
    link = CountingLink()
    header = sender_frame(link, [3, 4, 9, 10, 11, 20], [0, 1, 2, 3, 4, 5])  # three runs on the sender's side
    assert link.sends == [[2 * BB, 3 * BB, 1 * BB]]
    receiver._receive_nccl_frame(1, None, link, header)  # no such reservation here: dropped
    assert link.recvs == link.sends


def test_a_kept_multi_run_frame_receives_run_by_run_into_its_blocks(receiver: FabricReceiver) -> None:
    ticket = receiver.expect("r", [10, 11, 12, 13, 14, 15], 0)
    with receiver._cond:
        receiver.table.bind(ticket.reservation_id, 1, one_sided=False)
    link = CountingLink()
    header = sender_frame(link, [3, 4, 9, 10, 11, 20], [10, 11, 12, 13, 14, 15])
    receiver._receive_nccl_frame(1, None, link, NcclData(ticket.reservation_id, header.runs))
    assert link.recvs == link.sends == [[2 * BB, 3 * BB, 1 * BB]]
    assert receiver.table.get(ticket.reservation_id).missing_indices() == []


class Stream:
    """A CUDA stream's `done` flag, set by the test; counts how often it was asked."""

    def __init__(self) -> None:
        self.finished, self.polls = False, 0

    @property
    def done(self) -> bool:
        self.polls += 1
        return self.finished


def test_after_a_timed_out_gpu_copy_the_revoke_is_acked_only_once_the_copy_ended() -> None:
    from kvfabric.sender import Transfer

    peer = object.__new__(_Peer)
    peer.conn, peer.dead, peer._lock, peer.nixl = SentHeaders(), None, threading.Lock(), None
    transfer = object.__new__(Transfer)
    transfer.lock, transfer.revoked, transfer.in_flight = threading.Lock(), None, Stream()
    transfer.ticket = type("K", (), {"reservation_id": 7, "request_id": "r"})()
    peer.transfers = {7: transfer}
    peer._handle(Revoke(7, "lease expired"))
    assert transfer.revoked == "lease expired"
    deadline = time.monotonic() + 2
    while transfer.in_flight.polls < 5 and time.monotonic() < deadline:  # the fence thread waits on the copy
        time.sleep(0.005)
    assert transfer.in_flight.polls >= 5
    assert peer.conn.headers == []  # the copy may still be writing: the receiver's blocks stay fenced
    transfer.in_flight.finished = True
    deadline = time.monotonic() + 2
    while not peer.conn.headers and time.monotonic() < deadline:
        time.sleep(0.005)
    assert peer.conn.headers == [RevokeAck(7)]
