"""A kvfabric receiver against connections that are not senders: a thousand that never say
hello, a hello trickled a byte at a time, a connection whose thread cannot start. Each time
the receiver goes on accepting real peers, and every thread it started returns."""
from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvfabric import BlockRegion, FabricReceiver, ReceiverConfig
from tests.integration.fabric_peer import LAYOUT
from tests.integration.test_kvfabric_wire import connect, frame, read

HELLO_TIMEOUT_S = 1.0


@pytest.fixture
def receiver() -> Iterator[FabricReceiver]:
    region = BlockRegion(np.zeros((8, LAYOUT.block_bytes), np.uint8))
    r = FabricReceiver(LAYOUT, region, ReceiverConfig(lease_s=5, io_timeout_s=1, hello_timeout_s=HELLO_TIMEOUT_S,
                                                      max_pending_hellos=32))
    yield r
    r.close()


def receiver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvfabric-recv-")]


def wait_for(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the receiver closes `sock` within `timeout_s` (its challenge read on the way)."""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
        return False
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_thousand_silent_connections_leave_room_for_a_real_sender(receiver: FabricReceiver) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 4096) < 2500:
        pytest.skip(f"needs 2,500 file descriptors, the limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    address = (receiver.address.host, receiver.address.port)
    silent, most = [], 0
    try:
        for i in range(1000):
            silent.append(socket.create_connection(address, timeout=5))
            if i % 50 == 0:
                most = max(most, len(receiver_threads()))
        real = connect(receiver)  # its hello follows its connect: it gets through the flood's slots
        real.close()
        # the pending ones, and evicted ones on their way out (on a loaded machine, beside a serving
        # cluster and the rest of the suite, 88 were seen): bounded, whatever the flood's size
        assert most <= 4 * 32
        t0 = time.monotonic()
        for s in silent:  # each one closed by the receiver: evicted, or at its hello deadline
            assert closed_by_peer(s, HELLO_TIMEOUT_S + 2)
        assert time.monotonic() - t0 < HELLO_TIMEOUT_S + 10
        wait_for(lambda: receiver_threads() == [])
        assert receiver.num_hellos_failed == 1000 and receiver.num_hellos_evicted > 0
    finally:
        for s in silent:
            s.close()
    connect(receiver).close()


def test_a_hello_trickled_a_byte_at_a_time_is_cut_at_its_deadline(receiver: FabricReceiver) -> None:
    sock = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
    hello = frame({"t": "hello", "layout": LAYOUT.to_wire(), "transport": "tcp", "host_id": "x"})
    t0, sent = time.monotonic(), 0
    try:
        for byte in hello:  # one byte every 0.3 s: each read is within the 1 s i/o timeout
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < len(hello) and time.monotonic() - t0 < HELLO_TIMEOUT_S + 1.5
    sock.close()
    wait_for(lambda: receiver_threads() == [])
    connect(receiver).close()


def test_the_accept_loop_survives_a_thread_that_cannot_start(receiver: FabricReceiver,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    start, failed = threading.Thread.start, []

    def start_once_failing(self: threading.Thread) -> None:
        if self.name.startswith("kvfabric-recv-") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    doomed = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
    assert closed_by_peer(doomed, 5.0) and receiver.num_accept_errors == 1
    connect(receiver).close()  # the next connection is served
    wait_for(lambda: receiver_threads() == [])


def test_a_hello_larger_than_a_hello_is_refused_before_it_is_read(receiver: FabricReceiver) -> None:
    """Before its hello proves the cluster secret, a sender gets at most MAX_HELLO_BYTES read
    and decoded (a header may be 1 MiB once it has): a valid hello padded to 1 MiB, answered
    once, is now closed on its length, unanswered."""
    sock = socket.create_connection((receiver.address.host, receiver.address.port), timeout=5)
    failed = receiver.num_hellos_failed
    assert read(sock)["t"] == "challenge"
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed on the length, mid-send
        sock.sendall(frame({"t": "hello", "layout": LAYOUT.to_wire(), "transport": "tcp", "host_id": "x",
                            "pad": "y" * ((1 << 20) - 4096)}))
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            got += chunk
    sock.close()
    assert got == b""  # no hello_ok, no hello_err: nothing read past its length
    wait_for(lambda: receiver.num_hellos_failed == failed + 1)
    connect(receiver).close()  # a real hello still gets through
