"""kvfabric across two real processes, for shm, tcp and nixl: bytes, chunking, concurrency,
no write after free, killed peers, and no leaked block on either side.

The receiver runs in the test process over a shared-memory pool whose blocks are
allocated from the engine's `BlockPool`; senders run in spawned child processes
(tests/integration/fabric_peer.py) with deterministic random source blocks.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from engine.core.block_pool import BlockPool
from kvfabric import (
    BlockRegion, BlocksFenced, FabricEvent, FabricReceiver, FabricSender, HandshakeError, KVArrived,
    PeerUnavailable, ReceiverConfig, SenderConfig, ShmSegment, Ticket, TransferFailed,
)
from kvfabric.address import ONE_SIDED
from kvfabric.region import sweep_dead_segments
from tests.conftest import skip_without_nixl
from tests.integration.cluster_checks import wait_threads
from tests.integration.fabric_peer import LAYOUT, Peer, receiver_main, sender_main, source_blocks

NUM_DST = 64
NUM_SRC = 96
BB = LAYOUT.block_bytes


class Rx:
    """The receiving side as a decode worker holds it: pool bookkeeping + shm pool + receiver.
    Its leases run on a clock the test moves (`advance`): a lease expires when the test says,
    however slow the machine is."""

    def __init__(self, num_blocks: int, lease_s: float, nixl: bool = False) -> None:
        self.seg = ShmSegment.create(num_blocks * BB)
        self.region = BlockRegion(self.seg.data.reshape(num_blocks, BB))
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.now = 0.0
        self.receiver = FabricReceiver(LAYOUT, self.region, ReceiverConfig(lease_s=lease_s, io_timeout_s=5, nixl=nixl),
                                       lambda: self.now, shm=self.seg)
        self.tables: dict[str, list[int]] = {}
        self.held: dict[str, list[int]] = {}

    def reserve(self, rid: str, num_blocks: int, num_skip: int = 0) -> Ticket | None:
        block_ids = self.pool.allocate(num_blocks)
        if block_ids is None:
            return None
        self.tables[rid] = list(block_ids)
        return self.receiver.expect(rid, list(block_ids), num_skip)

    def pump(self, until: int = 1, timeout_s: float = 10) -> list[FabricEvent]:
        """Apply events as a decode worker would until `until` of them arrived."""
        got: list[FabricEvent] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < until and time.monotonic() < deadline:
            for ev in self.receiver.poll(timeout_s=0.05):
                got.append(ev)
                if isinstance(ev, TransferFailed) and ev.blocks_held:
                    self.held[ev.request_id] = self.tables.pop(ev.request_id)
                elif isinstance(ev, TransferFailed):
                    self.pool.free(self.tables.pop(ev.request_id))
                elif isinstance(ev, BlocksFenced):
                    self.pool.free(self.held.pop(ev.request_id))
        return got

    def finish(self, rid: str) -> None:
        self.pool.free(self.tables.pop(rid))

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def received(self, ticket: Ticket, num_blocks: int, timeout_s: float = 10.0) -> None:
        """Waits until the first `num_blocks` of `ticket` are in place and no frame is in flight."""
        res = self.receiver.table.get(ticket.reservation_id)
        assert res is not None
        deadline = time.monotonic() + timeout_s
        while res.inflight_frames or res.written[:num_blocks] != b"\x01" * num_blocks:
            assert time.monotonic() < deadline, "the frame never landed"
            time.sleep(0.005)

    def renewed(self, ticket: Ticket, timeout_s: float = 10.0) -> None:
        """Waits until the sender renews `ticket`'s lease (its expiry moves past where it is now)."""
        res = self.receiver.table.get(ticket.reservation_id)
        assert res is not None
        expires, deadline = res.expires_at, time.monotonic() + timeout_s
        while res.expires_at <= expires:
            assert time.monotonic() < deadline, "no renewal"
            time.sleep(0.01)

    def check_no_leak(self) -> None:
        usage = self.pool.check_holders([*self.tables.values(), *self.held.values()])
        assert usage.num_in_use == sum(map(len, self.tables.values())) + sum(map(len, self.held.values()))

    def close(self) -> None:
        self.receiver.close()
        self.region = None  # type: ignore[assignment]
        self.seg.close()


@pytest.fixture(params=["shm", "tcp", "nixl"])
def transport(request: pytest.FixtureRequest) -> str:
    skip_without_nixl(request.param)
    return request.param


@pytest.fixture
def rx(transport: str) -> Iterator[Rx]:
    r = Rx(NUM_DST, lease_s=1.0, nixl=transport == "nixl")
    yield r
    r.close()


def start_sender(transport: str, seed: int = 1, **config: object) -> Peer:
    return Peer(sender_main, LAYOUT.to_wire(), NUM_SRC, seed, {"transport": transport, "checksum": True, **config})


def test_random_block_sets_arrive_byte_identical_in_chunks_and_concurrently(rx: Rx, transport: str) -> None:
    rng = random.Random(7)
    src = source_blocks(NUM_SRC, BB, seed=1)
    senders = [start_sender(transport, seed=1), start_sender(transport, seed=1)]
    try:
        plans = {}
        for i in range(12):
            n = rng.randint(1, 6)
            skip = rng.randint(0, n - 1)
            ticket = rx.reserve(f"r{i}", n, skip)
            assert ticket is not None
            sender = senders[i % 2]
            assert sender.call("open", ticket.to_wire()) == transport
            src_ids = rng.sample(range(NUM_SRC), n - skip) if i % 3 else list(range(10 * i, 10 * i + n - skip))
            plans[f"r{i}"] = (sender, ticket, src_ids)
        # round-robin chunk pushes across all open transfers: many requests in flight at once
        cursors = {rid: plan[1].num_skip_blocks for rid, plan in plans.items()}
        while any(c < len(p[1].block_ids) for c, p in zip(cursors.values(), plans.values())):
            for rid, (sender, ticket, src_ids) in plans.items():
                start = cursors[rid]
                if start == len(ticket.block_ids):
                    continue
                end = min(len(ticket.block_ids), start + rng.randint(1, 3))
                sender.call("push", rid, src_ids[start - ticket.num_skip_blocks:end - ticket.num_skip_blocks], start, 0.0)
                cursors[rid] = end
        for rid, (sender, ticket, _) in plans.items():
            sender.call("finish", rid, 100 + int(rid[1:]), len(ticket.block_ids) * LAYOUT.block_size)
        events = {e.request_id: e for e in rx.pump(until=len(plans))}
        assert sorted(events) == sorted(plans)
        for rid, (_, ticket, _) in plans.items():
            ev = events[rid]
            assert isinstance(ev, KVArrived) and ev.reservation_id == ticket.reservation_id
            assert (ev.first_token_id, ev.num_tokens) == (100 + int(rid[1:]), len(ticket.block_ids) * LAYOUT.block_size)
            assert ev.opened_at <= ev.arrived_at
        written = set()
        for rid, (_, ticket, src_ids) in plans.items():
            dst = list(ticket.block_ids[ticket.num_skip_blocks:])
            assert np.array_equal(rx.region.array[dst], src[src_ids]), rid
            written.update(dst)
        untouched = [b for b in range(NUM_DST) if b not in written]
        assert not rx.region.array[untouched].any()  # skipped and unreserved blocks: not a byte changed
        for rid in plans:
            rx.finish(rid)
        rx.check_no_leak()
        assert rx.pool.usage().num_in_use == 0 and len(rx.receiver.table) == 0
    finally:
        for s in senders:
            s.stop()


def test_lease_is_renewed_during_a_long_prefill(transport: str) -> None:
    rx = Rx(8, lease_s=0.6, nixl=transport == "nixl")
    sender = start_sender(transport, renew_interval_s=0.1)
    try:
        ticket = rx.reserve("long", 2)
        sender.call("open", ticket.to_wire())
        sender.call("push", "long", [5], 0, 0.0)
        for _ in range(5):  # 2.5 leases pass: renewals keep it alive
            rx.advance(0.3)
            rx.renewed(ticket)
            assert rx.pump(until=1, timeout_s=0) == []
        sender.call("push", "long", [6], 1, 0.0)
        sender.call("finish", "long", 9, 8)
        [ev] = rx.pump()
        assert isinstance(ev, KVArrived)
    finally:
        sender.stop()
        rx.close()


def test_no_write_after_free_a_stalled_sender_cannot_touch_reassigned_blocks(transport: str) -> None:
    """A's lease expires while its sender sleeps; A's blocks go to B; the late push changes nothing."""
    rx = Rx(4, lease_s=0.3, nixl=transport == "nixl")
    sender = start_sender(transport, renew_interval_s=60)  # no renewals: the stall is real
    try:
        a = rx.reserve("A", 4)
        sender.call("open", a.to_wire())
        sender.call("push", "A", [0, 1], 0, 0.0)
        if transport == "tcp":  # two-sided: that frame is received by the receiver's own thread
            rx.received(a, 2)
        sender.send("push", "A", [2, 3], 2, 1.5)  # the child sleeps 1.5 s, then tries to write
        rx.advance(0.3)  # meanwhile A's lease runs out
        events = rx.pump(until=2 if transport in ONE_SIDED else 1, timeout_s=5)
        assert isinstance(events[0], TransferFailed) and events[0].reason == "lease of 0.3 s expired"
        if transport in ONE_SIDED:  # quarantined until the sender acknowledged the revocation
            assert events[0].blocks_held and events[1] == BlocksFenced("A", a.reservation_id)
        b = rx.reserve("B", 4)
        assert b is not None and sorted(b.block_ids) == sorted(a.block_ids)  # the very same blocks
        pattern = np.full((4, BB), 0xAB, dtype=np.uint8)
        rx.region.array[list(b.block_ids)] = pattern  # B's data, written by its new owner
        kind, message = sender.reply(timeout_s=5)[1:]  # its late push was tried, and refused
        assert kind == "ReservationRevoked" and "lease of 0.3 s expired" in message
        assert np.array_equal(rx.region.array[list(b.block_ids)], pattern)  # not a single byte changed
        rx.receiver.cancel("B")
        rx.finish("B")
        rx.check_no_leak()
        assert rx.pool.usage().num_in_use == 0
    finally:
        sender.stop()
        rx.close()


def test_a_frozen_shm_sender_keeps_its_blocks_quarantined_until_it_acknowledges() -> None:
    rx = Rx(6, lease_s=0.3)
    sender = start_sender("shm", renew_interval_s=60)
    try:
        a = rx.reserve("A", 4)
        sender.call("open", a.to_wire())
        os.kill(sender.process.pid, signal.SIGSTOP)  # frozen: cannot acknowledge a revocation
        # a stop signal reaches a process's threads one by one: every one stopped
        wait_threads(sender.process.pid, {"T", "t"}, "stopped")
        rx.advance(0.3)
        [failed] = rx.pump(until=1, timeout_s=3)
        assert isinstance(failed, TransferFailed) and failed.blocks_held
        assert rx.pump(until=1, timeout_s=0.5) == []  # still no fence
        assert rx.reserve("B", 4) is None  # only 2 free blocks: A's are not handed out
        os.kill(sender.process.pid, signal.SIGCONT)
        assert rx.pump(until=1, timeout_s=3) == [BlocksFenced("A", a.reservation_id)]
        assert rx.reserve("B", 4) is not None
        rx.receiver.cancel("B")
        rx.finish("B")
        rx.check_no_leak()
        assert rx.pool.usage().num_in_use == 0
    finally:
        os.kill(sender.process.pid, signal.SIGCONT)
        sender.stop()
        rx.close()


def test_a_killed_sender_fails_its_transfers_and_frees_the_blocks(rx: Rx, transport: str) -> None:
    sender = start_sender(transport)
    try:
        tickets = [rx.reserve(f"k{i}", 3) for i in range(3)]
        for t in tickets:
            sender.call("open", t.to_wire())
        sender.call("push", "k0", [1, 2], 0, 0.0)
        sender.kill()
        events = rx.pump(until=3, timeout_s=5)  # the lease clock stands still: the closed connection tells
        assert sorted(e.request_id for e in events) == ["k0", "k1", "k2"]
        assert all(isinstance(e, TransferFailed) and not e.blocks_held and "sender" in e.reason for e in events)
        rx.check_no_leak()
        assert rx.pool.usage().num_in_use == 0 and len(rx.receiver.table) == 0
    finally:
        sender.stop()


def test_a_sender_that_dies_before_connecting_is_cleaned_up_by_the_lease() -> None:
    rx = Rx(NUM_DST, lease_s=1.0)
    try:
        rx.reserve("ghost", 2)
        rx.advance(0.9)
        assert rx.pump(until=1, timeout_s=0.1) == []
        rx.advance(0.1)
        [ev] = rx.pump(until=1, timeout_s=2)
        assert isinstance(ev, TransferFailed) and ev.reason == "lease of 1 s expired" and not ev.blocks_held
        assert rx.pool.usage().num_in_use == 0
    finally:
        rx.close()


def test_a_killed_receiver_gives_the_sender_peer_unavailable_quickly(transport: str) -> None:
    receiver = Peer(receiver_main, LAYOUT.to_wire(), 16, {"lease_s": 5.0, "nixl": transport == "nixl"})
    src = BlockRegion(source_blocks(8, BB, seed=3))
    sender = FabricSender(LAYOUT, src, SenderConfig(transport=transport, ack_timeout_s=2))
    try:
        ticket = Ticket.from_wire(receiver.call("expect", "x", [1, 2, 3], 0))
        transfer = sender.open(ticket)
        # same host: one-sided transports talk over the receiver's Unix socket, tcp over TCP
        assert transfer.peer.conn.sock.family == (socket.AF_UNIX if transport in ONE_SIDED else socket.AF_INET)
        transfer.push([4], 0)
        receiver.kill()
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable):
            for _ in range(100):  # the first push may still land in a socket buffer
                transfer.push([5], 1)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(PeerUnavailable) as refused:
            sender.open(ticket)
        if transport == "tcp":  # the handshake's failure names both ends
            a = ticket.address
            assert f"at {a.host}:{a.port} from 127.0.0.1 ({socket.gethostname()})" in str(refused.value)
        # the dead receiver could not unlink its pool; the next segment created sweeps it (here:
        # this one alone, not the machine's other dead segments)
        assert sweep_dead_segments({ticket.address.shm_name}) == [ticket.address.shm_name]
    finally:
        sender.close()
        receiver.kill()


def test_handshake_refuses_a_mismatched_layout_naming_the_field(rx: Rx, transport: str) -> None:
    import dataclasses

    other = dataclasses.replace(LAYOUT, block_size=8, num_layers=1)  # same block bytes, other meaning
    assert other.block_bytes == LAYOUT.block_bytes
    sender = FabricSender(other, BlockRegion(np.zeros((2, BB), np.uint8)), SenderConfig(transport=transport))
    ticket = rx.reserve("h", 1)
    try:
        with pytest.raises(HandshakeError, match="num_layers differs: sender 1, receiver 2") as e:
            sender.open(ticket)
        assert e.value.field == "num_layers"
        assert not rx.region.array.any()
    finally:
        sender.close()


def test_a_sender_that_aborts_fails_the_transfer_and_frees_the_blocks(rx: Rx, transport: str) -> None:
    sender = start_sender(transport)
    try:
        ticket = rx.reserve("ab", 3)
        sender.call("open", ticket.to_wire())
        sender.call("push", "ab", [4], 0, 0.0)
        sender.call("abort", "ab")
        [ev] = rx.pump(until=1, timeout_s=3)
        assert ev == TransferFailed("ab", ticket.reservation_id, "sender aborted: aborted by sender", blocks_held=False)
        rx.check_no_leak()
        assert rx.pool.usage().num_in_use == 0 and len(rx.receiver.table) == 0
    finally:
        sender.stop()


def test_a_segment_name_that_is_a_link_is_refused() -> None:
    """A sender maps the segment a receiver names; a link planted under a segment's name (to
    another file) once was followed. Now only the file itself opens."""
    seg = ShmSegment.create(4096)
    link = f"splitserve-kv-link-{os.getpid()}"
    os.symlink(f"/dev/shm/{seg.name}", f"/dev/shm/{link}")
    try:
        with pytest.raises(OSError):
            ShmSegment.open(link, seg.nonce, 4096)
        ShmSegment.open(seg.name, seg.nonce, 4096).close()  # the segment itself opens
    finally:
        os.unlink(f"/dev/shm/{link}")
        seg.close()


class StepEvent:
    """As cupy's CUDA event of the step that writes a push's blocks: `done` once that step
    ended (here: a thread writes the blocks, then sets it), never when `delay_s` is None."""

    def __init__(self, blocks: np.ndarray, delay_s: float | None) -> None:
        self._ended = False
        if delay_s is not None:
            def step() -> None:
                time.sleep(delay_s)
                blocks[:] = np.arange(blocks.size, dtype=np.uint64).reshape(blocks.shape).astype(np.uint8)
                self._ended = True
            threading.Thread(target=step, daemon=True).start()

    @property
    def done(self) -> bool:
        return self._ended


@pytest.mark.parametrize("transport", ["nixl"])
def test_a_nixl_post_from_a_device_pool_waits_for_the_steps_event(transport: str) -> None:
    """NIXL reads a write's source as soon as the write is posted, so `NixlLink.post` of blocks
    a GPU step is still writing first waits for that step's CUDA event. On CPU the event is
    injected: the write is posted only once the step has ended, and the bytes that land are
    the step's; an event that never completes fails the post within its timeout, nothing posted."""
    skip_without_nixl(transport)
    from kvfabric.layout import HeadMap, Run
    from kvfabric.nixl import Agent, NixlLink, Posted, pools_of

    src, dst = np.zeros((4, BB), np.uint8), np.zeros((4, BB), np.uint8)
    receiver, sender = Agent("receiver", [BlockRegion(dst)]), Agent("sender", [BlockRegion(src)])
    receiver.pacer.attach()  # as FabricReceiver does at a nixl hello: its agent takes part in the wire-up
    link = NixlLink(sender, receiver.metadata(), pools_of([BlockRegion(dst)]), HeadMap.between(LAYOUT, LAYOUT))
    try:
        posted, began = Posted(), time.monotonic()
        link.post(posted, [Run(0, 0, 1, 3)], StepEvent(src, delay_s=0.3), timeout_s=10.0)
        assert time.monotonic() - began >= 0.3  # posted after the step, not beside it
        link.settle(posted, timeout_s=10.0)
        assert src[0].any() and (dst[1:4] == src[0:3]).all() and not dst[0].any()
        never, began = Posted(), time.monotonic()
        with pytest.raises(PeerUnavailable, match="CUDA event did not complete within 0.3 s"):
            link.post(never, [Run(0, 3, 0, 1)], StepEvent(src, delay_s=None), timeout_s=0.3)
        assert 0.3 <= time.monotonic() - began < 5 and never.handles == [] and not dst[0].any()
    finally:
        link.close()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["nixl"])
def test_an_idle_nixl_agent_takes_no_core(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's own progress thread (which the Python agent runs with no delay) spins on a core
    for the agent's whole life; kvfabric's agents run without it and progress their worker
    from a `Pacer`: a second of an idle agent, with no peer and then with one attached past
    its wire-up, costs this process well under a tenth of a core (the spinning thread: all of one)."""
    skip_without_nixl(transport)
    from kvfabric import nixl
    from kvfabric.nixl import Agent

    monkeypatch.setattr(nixl, "WARM_S", 0.1)
    agent = Agent("idle", [BlockRegion(np.zeros((4, BB), np.uint8))])
    try:
        for attached in (False, True):
            if attached:
                agent.pacer.attach()
                time.sleep(0.2)
            began = time.process_time()
            time.sleep(1.0)
            assert time.process_time() - began < 0.1, f"attached={attached}"
    finally:
        agent.close()


@pytest.mark.parametrize("transport", ["nixl"])
def test_a_ranks_poster_answers_only_its_token_and_writes_only_from_its_pool(transport: str) -> None:
    """A further tensor-parallel rank's `RankPoster` (its pool private, held by its own agent)
    posts writes for rank 0 alone: a caller without the token it exported is cut off, and a
    write whose source lies outside the rank's pool, or a check of a write it never posted,
    is refused with the reason; NIXL's own refusals come back as text."""
    skip_without_nixl(transport)
    import torch

    from kvfabric.nixl_ranks import RankClient, RankPool

    pool = RankPool()
    pool.allocate((4, 4096), torch.uint8, "cpu")
    export = pool.export()
    wrong = RankClient(export["nixl_post"], "0" * 64, timeout_s=2)
    client = RankClient(export["nixl_post"], export["nixl_token"], timeout_s=5)
    try:
        assert set(export) == {"nixl", "nixl_pool", "nixl_post", "nixl_token"}
        assert export["nixl_pool"][1] == 4 * 4096
        with pytest.raises(PeerUnavailable, match="poster connection closed|Connection reset"):  # cut off, unanswered
            wrong.add_remote(b"anything")
        base, nbytes, _ = export["nixl_pool"]
        for src in ([[base + nbytes - 64, 128, 0]], [[base - 1, 64, 0]], [[base, 64, 3]]):
            with pytest.raises(PeerUnavailable, match="source descriptors outside this rank's pool"):
                client.write("someone", np.array(src, np.int64), np.array([[0, 64, 0]], np.int64))
        with pytest.raises(PeerUnavailable, match="no write 7 in flight"):
            client.check(7)
        with pytest.raises(PeerUnavailable, match="tensor-parallel rank's poster"):
            client.add_remote(b"not an agent's metadata")
        client.release([7])  # nothing of it: nothing to do
    finally:
        wrong.close()
        client.close()
        pool.close()
