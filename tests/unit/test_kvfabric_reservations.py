"""The receiver's reservation/lease state machine, driven by an injected clock."""
from __future__ import annotations

import pytest

from kvfabric.errors import ReservationRevoked
from kvfabric.reservations import BlocksFenced, KVArrived, ReservationTable, State, TransferFailed, settle
from tests.conftest import FakeClock

LEASE_S = 5.0
SHM, TCP = 1, 2  # writer ids


@pytest.fixture
def table(clock: FakeClock) -> ReservationTable:
    return ReservationTable(clock, LEASE_S)


def test_complete_transfer_emits_arrived_and_forgets_the_reservation(table: ReservationTable, clock: FakeClock) -> None:
    res = table.add("a", [4, 5, 6, 9], num_skip_blocks=1)
    clock.advance(1.0)
    table.bind(res.reservation_id, SHM, one_sided=True)
    clock.advance(0.25)
    assert table.record_written(res.reservation_id, SHM, [(1, 2)])
    assert table.record_written(res.reservation_id, SHM, [(3, 1)])
    assert table.ready(res.reservation_id, SHM, first_token_id=17, num_tokens=15) is None
    assert table.take_events() == [KVArrived("a", res.reservation_id, 17, 15, opened_at=1001.0, arrived_at=1001.25)]
    assert len(table) == 0 and table.held_block_ids() == []


def test_the_senders_trace_context_comes_back_with_the_arrival_and_is_bounded(table: ReservationTable) -> None:
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    for trace, kept in ((traceparent, traceparent), ("x" * 10_000, "x" * 512)):
        res = table.add("t", [1, 2], num_skip_blocks=0)
        table.bind(res.reservation_id, SHM, one_sided=True, trace=trace)
        table.record_written(res.reservation_id, SHM, [(0, 2)])
        assert table.ready(res.reservation_id, SHM, first_token_id=3, num_tokens=20) is None
        (arrived,) = table.take_events()
        assert isinstance(arrived, KVArrived) and arrived.trace == kept


def test_ready_with_a_missing_block_fails_the_transfer(table: ReservationTable) -> None:
    res = table.add("a", [4, 5, 6], num_skip_blocks=0)
    table.bind(res.reservation_id, TCP, one_sided=False)
    table.record_written(res.reservation_id, TCP, [(0, 2)])
    error = table.ready(res.reservation_id, TCP, 1, 12)
    assert error is not None and "[2]" in error
    [failed] = table.take_events()
    assert isinstance(failed, TransferFailed) and not failed.blocks_held
    assert table.take_revocations()[0].writer == TCP


def test_lease_expiry_of_an_unbound_reservation_frees_at_once(table: ReservationTable, clock: FakeClock) -> None:
    res = table.add("a", [1, 2], 0)
    clock.advance(LEASE_S - 0.01)
    table.expire()
    assert table.take_events() == []
    clock.advance(0.01)
    table.expire()
    [failed] = table.take_events()
    assert failed == TransferFailed("a", res.reservation_id, "lease of 5 s expired", blocks_held=False)
    assert table.take_revocations() == []  # nobody to tell
    with pytest.raises(ReservationRevoked):
        table.bind(res.reservation_id, SHM, one_sided=True)  # a late sender is refused before writing


def test_renewal_and_writes_keep_the_lease_alive(table: ReservationTable, clock: FakeClock) -> None:
    res = table.add("a", [1, 2, 3], 0)
    table.bind(res.reservation_id, SHM, one_sided=True)
    for _ in range(4):
        clock.advance(LEASE_S * 0.8)
        assert table.renew(res.reservation_id, SHM)
        table.expire()
    assert table.get(res.reservation_id).state is State.OPEN
    assert not table.renew(res.reservation_id, TCP)  # only the bound writer renews


def test_expired_one_sided_reservation_is_quarantined_until_fenced(table: ReservationTable, clock: FakeClock) -> None:
    res = table.add("a", [7, 8], 0)
    table.bind(res.reservation_id, SHM, one_sided=True)
    clock.advance(LEASE_S)
    table.expire()
    [failed] = table.take_events()
    assert failed.blocks_held
    [rev] = table.take_revocations()
    assert (rev.writer, rev.reservation_id) == (SHM, res.reservation_id)
    assert table.held_block_ids() == [7, 8]
    assert not table.record_written(res.reservation_id, SHM, [(0, 1)])  # too late: not counted
    table.fence(res.reservation_id, TCP)  # another writer cannot fence it
    assert table.take_events() == []
    table.fence(res.reservation_id, SHM)
    assert table.take_events() == [BlocksFenced("a", res.reservation_id)]
    assert table.held_block_ids() == []


def test_a_dead_writer_fences_its_quarantine_and_fails_its_open_transfers(table: ReservationTable, clock: FakeClock) -> None:
    q = table.add("q", [1], 0)
    table.bind(q.reservation_id, SHM, one_sided=True)
    clock.advance(LEASE_S)
    table.expire()
    table.take_events()
    o = table.add("o", [2], 0)
    table.bind(o.reservation_id, SHM, one_sided=True)
    other = table.add("x", [3], 0)
    table.bind(other.reservation_id, TCP, one_sided=False)
    table.writer_gone(SHM, "sender disconnected")
    assert table.take_events() == [
        BlocksFenced("q", q.reservation_id),
        TransferFailed("o", o.reservation_id, "sender disconnected", blocks_held=False),
    ]
    assert table.held_block_ids() == [3]


def test_two_sided_revocation_waits_only_for_a_frame_in_flight(table: ReservationTable, clock: FakeClock) -> None:
    res = table.add("a", [10, 11, 12, 20], 0)
    table.bind(res.reservation_id, TCP, one_sided=False)
    assert table.begin_frame(res.reservation_id, TCP, [(0, 2), (2, 1)]) == [10, 12]
    assert table.cancel("a") is True  # a frame is landing: hold the blocks
    table.end_frame(res.reservation_id, [(0, 2), (2, 1)], error=None)
    assert table.take_events() == [BlocksFenced("a", res.reservation_id)]
    res2 = table.add("b", [1], 0)
    table.bind(res2.reservation_id, TCP, one_sided=False)
    assert table.cancel("b") is False  # nothing in flight: free now
    assert table.begin_frame(res2.reservation_id, TCP, [(0, 1)]) is None  # later frames are dropped


def test_frame_checks_range_and_adjacency(table: ReservationTable) -> None:
    res = table.add("a", [10, 11, 13], num_skip_blocks=1)
    table.bind(res.reservation_id, TCP, one_sided=False)
    with pytest.raises(ValueError, match="outside the writable range"):
        table.begin_frame(res.reservation_id, TCP, [(1, 1), (0, 1)])  # a skipped (cached) block
    assert res.inflight_frames == 0  # a refused frame is not counted
    with pytest.raises(ValueError, match="not adjacent"):
        table.begin_frame(res.reservation_id, TCP, [(1, 2)])
    with pytest.raises(ValueError, match="outside the writable range"):
        table.record_written(res.reservation_id, TCP, [(1, 1), (2, 2)])
    assert not any(res.written)  # all or nothing


def test_checksum_error_fails_the_transfer(table: ReservationTable) -> None:
    res = table.add("a", [5], 0)
    table.bind(res.reservation_id, TCP, one_sided=False)
    table.begin_frame(res.reservation_id, TCP, [(0, 1)])
    table.end_frame(res.reservation_id, [(0, 1)], error="checksum mismatch")
    assert table.take_events() == [TransferFailed("a", res.reservation_id, "checksum mismatch", blocks_held=False)]


def test_cancel_and_rebinding_rules(table: ReservationTable) -> None:
    assert table.cancel("nobody") is None
    res = table.add("a", [1], 0)
    table.bind(res.reservation_id, SHM, one_sided=True)
    table.bind(res.reservation_id, SHM, one_sided=True)  # idempotent for the same writer
    with pytest.raises(ReservationRevoked, match="another sender"):
        table.bind(res.reservation_id, TCP, one_sided=False)
    assert table.cancel("a") is True
    assert table.take_events() == []  # the owner asked: no failure event
    assert table.cancel("a") is True  # still quarantined
    with pytest.raises(ValueError, match="already has a reservation"):
        table.add("a", [2], 0)


def test_a_final_cancel_drops_the_requests_events_not_yet_taken_but_its_fence(table: ReservationTable,
                                                                              clock: FakeClock) -> None:
    """The decode side's abort is its last word: an arrival queued before it, or a failure,
    never reaches it (nor a retry under the same id); a fence still does, and an owner that
    cancels without `final` (the KV tier, which waits for the event) still gets it."""
    cut = table.add("cut", [3], 0)
    table.bind(cut.reservation_id, SHM, one_sided=True)
    clock.advance(LEASE_S)
    table.expire()  # a one-sided writer's lease ran out: failed with its blocks held ...
    table.writer_gone(SHM, "link cut")  # ... then fenced
    done = table.add("done", [1, 2], 0)
    table.bind(done.reservation_id, SHM, one_sided=True)
    table.record_written(done.reservation_id, SHM, [(0, 2)])
    assert table.ready(done.reservation_id, SHM, first_token_id=7, num_tokens=8) is None
    other = table.add("other", [4], 0)
    table.bind(other.reservation_id, TCP, one_sided=False)
    table.fail(other.reservation_id, TCP, "prefill failed")
    assert table.cancel("done", final=True) is None  # it arrived: nothing active, its arrival dropped
    assert table.cancel("cut", final=True) is None
    assert table.take_events() == [BlocksFenced("cut", cut.reservation_id),
                                   TransferFailed("other", other.reservation_id, "prefill failed", blocks_held=False)]
    again = table.add("done", [5], 0)  # the same id reserved again: only its own events come
    table.bind(again.reservation_id, SHM, one_sided=True)
    table.record_written(again.reservation_id, SHM, [(0, 1)])
    table.ready(again.reservation_id, SHM, first_token_id=9, num_tokens=4)
    assert table.cancel("nobody", final=False) is None
    (arrived,) = table.take_events()
    assert isinstance(arrived, KVArrived) and arrived.reservation_id == again.reservation_id
    assert table.cancel("done") is None and len(table) == 0


def test_a_writer_that_abandons_frees_the_blocks_at_once(table: ReservationTable) -> None:
    res = table.add("a", [3, 4], 0)
    table.bind(res.reservation_id, SHM, one_sided=True)
    table.abandon(res.reservation_id, TCP, "not its writer")
    assert table.take_events() == []
    table.abandon(res.reservation_id, SHM, "sender aborted: prefill failed")
    assert table.take_events() == [
        TransferFailed("a", res.reservation_id, "sender aborted: prefill failed", blocks_held=False)]
    assert table.take_revocations() == [] and len(table) == 0  # nothing to tell the writer


def test_reservation_ids_are_random_and_one_tells_nothing_of_the_next() -> None:
    """Ids are drawn at random (62 bits), not counted: a sender that learned one reservation's
    id (its own) cannot name its neighbour's."""
    table = ReservationTable(lambda: 0.0, lease_s=10)
    ids = [table.add(f"r{i}", [i], 0).reservation_id for i in range(200)]
    assert len(set(ids)) == 200 and all(0 <= r < 2**62 for r in ids)
    steps = {b - a for a, b in zip(ids, ids[1:])}
    assert len(steps) > 190  # no common stride
    assert not any(r + 1 in set(ids) for r in ids)


class Owner:
    """Records what `settle` asks of a receiver's owner."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def arrived(self, ev: KVArrived) -> None:
        self.calls.append(("arrived", ev.request_id))

    def failed(self, ev: TransferFailed) -> None:
        self.calls.append(("failed", ev.request_id))

    def quarantined(self, ev: TransferFailed) -> None:
        self.calls.append(("quarantined", ev.request_id))

    def fenced(self, request_id: str) -> None:
        self.calls.append(("fenced", request_id))


def test_settle_frees_a_failed_transfers_blocks_at_once_or_after_its_writer_is_fenced(table: ReservationTable,
                                                                                        clock: FakeClock) -> None:
    """The quarantine rule, once for every owner (decode hand-off, KV store, KV tier): an
    unbound reservation that fails frees its blocks; a bound one-sided writer's are quarantined
    until the fence, and nothing is freed twice."""
    idle, bound, done = table.add("idle", [1], 0), table.add("bound", [2, 3], 0), table.add("done", [4], 0)
    table.bind(bound.reservation_id, SHM, one_sided=True)
    table.bind(done.reservation_id, SHM, one_sided=True)
    assert table.record_written(done.reservation_id, SHM, [(0, 1)])
    assert table.ready(done.reservation_id, SHM, first_token_id=5, num_tokens=4) is None
    clock.advance(LEASE_S + 1)
    table.expire()
    owner = Owner()
    settle(table.take_events(), owner)
    assert sorted(owner.calls) == [("arrived", "done"), ("failed", "idle"), ("quarantined", "bound")]
    table.fence(bound.reservation_id, SHM)
    owner.calls.clear()
    settle(table.take_events(), owner)
    assert owner.calls == [("fenced", "bound")] and table.held_block_ids() == []
