"""Reservations and their leases on the receiving side: a pure state machine.

Data flow: the decode worker's engine allocates destination blocks and the receiver
records them here as a `Reservation` (RESERVED). A sender binds it (OPEN), writes
blocks (one-sided: it copies and then reports; two-sided: the receiver itself receives
each frame), renews the lease, and finishes with ready (ARRIVED: the owner gets
`KVArrived` and the blocks belong to its request). A lease that runs out, or an abort,
revokes the reservation. When a one-sided writer may still be writing (or a two-sided
frame is being received) the blocks are *quarantined*: the owner is told to hold them
(`TransferFailed(blocks_held=True)`) until `BlocksFenced`, which comes when the writer
acknowledges the revocation or is known dead. So a late write can never land in blocks
that were given to another request.

No sockets, no threads, no torch: time comes from an injected clock; the receiver
serialises calls with its own lock.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvfabric.errors import ReservationRevoked


class State(Enum):
    RESERVED = "reserved"  # waiting for a sender to bind it
    OPEN = "open"  # bound to one writer
    REVOKED = "revoked"  # quarantined until the writer is fenced


TRACE_MAX_CHARS = 512
"""A W3C traceparent is 55 characters; anything longer is cut, never stored whole."""

@dataclass
class Reservation:
    reservation_id: int
    request_id: str
    block_ids: list[int]
    num_skip_blocks: int
    """Leading blocks the receiver already holds (cached prefix): never written."""
    expires_at: float
    state: State = State.RESERVED
    writer: int | None = None
    one_sided: bool = False
    written: bytearray = field(init=False)
    """One byte per block position: 1 once its data is in place."""
    inflight_frames: int = 0
    opened_at: float | None = None
    trace: str = ""
    """The sender's W3C `traceparent` for this transfer (empty: none), handed on with `KVArrived`."""

    def __post_init__(self) -> None:
        self.written = bytearray(len(self.block_ids))

    def mark_written(self, index: int, num_blocks: int) -> None:
        self.written[index:index + num_blocks] = b"\x01" * num_blocks

    def missing_indices(self) -> list[int]:
        if self.written.find(0, self.num_skip_blocks) == -1:
            return []
        return [i for i in range(self.num_skip_blocks, len(self.block_ids)) if not self.written[i]]


@dataclass(frozen=True)
class KVArrived:
    request_id: str
    reservation_id: int
    first_token_id: int
    num_tokens: int
    opened_at: float
    """Receiver clock when the sender bound the reservation."""
    arrived_at: float
    """Receiver clock when the last byte and `ready` were in: the transfer window ends here."""
    trace: str = ""
    """The sender's W3C `traceparent` from its `open` (empty: none)."""
    choice_token_ids: tuple[int, ...] = ()
    """A request of n choices: the other choices' first tokens."""


@dataclass(frozen=True)
class TransferFailed:
    request_id: str
    reservation_id: int
    reason: str
    blocks_held: bool
    """True: keep the blocks out of use until the matching `BlocksFenced`."""


@dataclass(frozen=True)
class BlocksFenced:
    request_id: str
    reservation_id: int


FabricEvent = KVArrived | TransferFailed | BlocksFenced


class EventOwner(Protocol):
    """What a receiver's owner (a decode worker's hand-off, the KV store, the KV tier) does with
    each event; `settle` applies the quarantine rule once for all of them."""

    def arrived(self, ev: KVArrived) -> None:
        """The blocks hold the KV: they are the request's now."""

    def failed(self, ev: TransferFailed) -> None:
        """No writer can write the blocks any more: they are free now."""

    def quarantined(self, ev: TransferFailed) -> None:
        """A writer may still write the blocks: keep them out of use until `fenced`."""

    def fenced(self, request_id: str) -> None:
        """The writer of a quarantined transfer can write no more: its blocks are free now."""


def settle(events: Sequence[FabricEvent], owner: EventOwner) -> None:
    """Each of a receiver's events to its owner, in order."""
    for ev in events:
        if isinstance(ev, BlocksFenced):
            owner.fenced(ev.request_id)
        elif isinstance(ev, KVArrived):
            owner.arrived(ev)
        elif ev.blocks_held:
            owner.quarantined(ev)
        else:
            owner.failed(ev)


@dataclass(frozen=True)
class Revocation:
    """Tell `writer` to stop writing `reservation_id` (and acknowledge, if one-sided)."""

    writer: int
    reservation_id: int
    reason: str


class ReservationTable:
    def __init__(self, clock: Callable[[], float], lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.clock = clock
        self.lease_s = lease_s
        self._by_id: dict[int, Reservation] = {}
        self._by_request: dict[str, int] = {}
        self._events: list[FabricEvent] = []
        self._revocations: list[Revocation] = []

    # -- owner side ----------------------------------------------------------------------
    def add(self, request_id: str, block_ids: list[int], num_skip_blocks: int) -> Reservation:
        if request_id in self._by_request:
            raise ValueError(f"request {request_id} already has a reservation")
        if not 0 <= num_skip_blocks <= len(block_ids):
            raise ValueError(f"num_skip_blocks {num_skip_blocks} outside [0, {len(block_ids)}]")
        res = Reservation(self._new_id(), request_id, list(block_ids), num_skip_blocks, self.clock() + self.lease_s)
        self._by_id[res.reservation_id] = res
        self._by_request[request_id] = res.reservation_id
        return res

    def _new_id(self) -> int:
        """A random id, unused here: one reservation's id tells nothing of another's (a sender
        that learned one cannot guess the next)."""
        rid = secrets.randbits(62)
        while rid in self._by_id:
            rid = secrets.randbits(62)
        return rid

    def cancel(self, request_id: str, reason: str = "aborted", final: bool = False) -> bool | None:
        """Owner abort. None: nothing active; else whether the blocks must be held until fenced.
        `final`: the abort is the owner's last word on the request: its arrival or failure not
        yet taken is dropped (a `BlocksFenced` still comes), so no event of the ended request
        reaches the owner, nor of it when its id is reserved again."""
        if final:
            self._events = [e for e in self._events if isinstance(e, BlocksFenced) or e.request_id != request_id]
        rid = self._by_request.get(request_id)
        res = None if rid is None else self._by_id[rid]
        if res is None:
            return None
        if res.state is State.REVOKED:
            return True
        return self._revoke(res, reason, notify_owner=False)

    def expire(self) -> None:
        now = self.clock()
        for res in [r for r in self._by_id.values() if r.state is not State.REVOKED and r.expires_at <= now]:
            self._revoke(res, f"lease of {self.lease_s:g} s expired", notify_owner=True)

    def take_events(self) -> list[FabricEvent]:
        events, self._events = self._events, []
        return events

    def take_revocations(self) -> list[Revocation]:
        revs, self._revocations = self._revocations, []
        return revs

    # -- writer side ---------------------------------------------------------------------
    def bind(self, reservation_id: int, writer: int, one_sided: bool, trace: str = "") -> Reservation:
        res = self._by_id.get(reservation_id)
        if res is None or res.state is State.REVOKED:
            raise ReservationRevoked(f"reservation {reservation_id} is unknown, expired or revoked")
        if res.state is State.OPEN and res.writer != writer:
            raise ReservationRevoked(f"reservation {reservation_id} is already bound to another sender")
        if res.state is State.RESERVED:
            res.opened_at = self.clock()
        res.state, res.writer, res.one_sided = State.OPEN, writer, one_sided
        res.trace = trace[:TRACE_MAX_CHARS]
        res.expires_at = self.clock() + self.lease_s
        return res

    def renew(self, reservation_id: int, writer: int) -> bool:
        res = self._open(reservation_id, writer)
        if res is None:
            return False
        res.expires_at = self.clock() + self.lease_s
        return True

    def record_written(self, reservation_id: int, writer: int, runs: list[tuple[int, int]]) -> bool:
        """One-sided writer reports runs (index, num_blocks) are in place."""
        res = self._open(reservation_id, writer)
        if res is None:
            return False
        for index, num_blocks in runs:
            self._check_range(res, index, num_blocks)
        for index, num_blocks in runs:
            res.mark_written(index, num_blocks)
        return True

    def begin_frame(self, reservation_id: int, writer: int, runs: list[tuple[int, int]]) -> list[int] | None:
        """Two-sided: the first destination block of each run (index, num_blocks) of a frame
        about to be received, or None to drop the frame."""
        res = self._open(reservation_id, writer)
        if res is None:
            return None
        firsts = []
        for index, num_blocks in runs:
            self._check_range(res, index, num_blocks)
            first = res.block_ids[index]
            if res.block_ids[index:index + num_blocks] != list(range(first, first + num_blocks)):
                raise ValueError(f"frame blocks at [{index}, {index + num_blocks}) are not adjacent on the receiver")
            firsts.append(first)
        res.inflight_frames += 1
        return firsts

    def end_frame(self, reservation_id: int, runs: list[tuple[int, int]], error: str | None) -> None:
        res = self._by_id.get(reservation_id)
        if res is None:
            return
        res.inflight_frames -= 1
        if res.state is State.REVOKED:
            if res.inflight_frames == 0:
                self._close(res)
                self._events.append(BlocksFenced(res.request_id, res.reservation_id))
        elif error is not None:
            self._revoke(res, error, notify_owner=True)
        else:
            for index, num_blocks in runs:
                res.mark_written(index, num_blocks)

    def ready(self, reservation_id: int, writer: int, first_token_id: int, num_tokens: int,
              choice_token_ids: Sequence[int] = ()) -> str | None:
        """The sender says everything is sent. Returns an error (and fails the transfer) or None."""
        res = self._open(reservation_id, writer)
        if res is None:
            return f"reservation {reservation_id} is unknown, expired or revoked"
        missing = res.missing_indices()
        if missing or res.inflight_frames:
            reason = f"ready with blocks at positions {missing[:8]} never written"
            self._revoke(res, reason, notify_owner=True)
            return reason
        self._close(res)
        assert res.opened_at is not None  # set by bind, the only way to OPEN
        self._events.append(
            KVArrived(res.request_id, reservation_id, first_token_id, num_tokens, res.opened_at, self.clock(),
                      res.trace, tuple(choice_token_ids)))
        return None

    def fail(self, reservation_id: int, writer: int, reason: str) -> None:
        """The writer gave up or sent something invalid: the transfer fails."""
        res = self._open(reservation_id, writer)
        if res is not None:
            self._revoke(res, reason, notify_owner=True)

    def abandon(self, reservation_id: int, writer: int, reason: str) -> None:
        """The writer gave up and will not write again: the transfer fails, blocks free at once."""
        res = self._open(reservation_id, writer)
        if res is not None:  # its frames are received on the writer's own thread: none in flight
            self._close(res)
            self._events.append(TransferFailed(res.request_id, res.reservation_id, reason, blocks_held=False))

    def fence(self, reservation_id: int, writer: int) -> None:
        """The writer acknowledged a revocation: it will not write these blocks again."""
        res = self._by_id.get(reservation_id)
        if res is not None and res.state is State.REVOKED and res.writer == writer and not res.inflight_frames:
            self._close(res)
            self._events.append(BlocksFenced(res.request_id, res.reservation_id))

    def writer_gone(self, writer: int, reason: str) -> None:
        """The writer's connection closed: it is dead or fenced for good."""
        for res in [r for r in self._by_id.values() if r.writer == writer]:
            if res.state is State.REVOKED:
                res.inflight_frames = 0
                self.fence(res.reservation_id, writer)
            else:
                self._close(res)
                self._events.append(TransferFailed(res.request_id, res.reservation_id, reason, blocks_held=False))

    # -- inspection ----------------------------------------------------------------------
    def get(self, reservation_id: int) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def held_block_ids(self) -> list[int]:
        """Blocks this table keeps out of use: every active or quarantined reservation's."""
        return [b for r in self._by_id.values() for b in r.block_ids]

    def __len__(self) -> int:
        return len(self._by_id)

    # -- internals -----------------------------------------------------------------------
    def _open(self, reservation_id: int, writer: int) -> Reservation | None:
        res = self._by_id.get(reservation_id)
        if res is None or res.state is not State.OPEN or res.writer != writer:
            return None
        return res

    @staticmethod
    def _check_range(res: Reservation, index: int, num_blocks: int) -> None:
        if num_blocks <= 0 or index < res.num_skip_blocks or index + num_blocks > len(res.block_ids):
            raise ValueError(
                f"blocks [{index}, {index + num_blocks}) outside the writable range "
                f"[{res.num_skip_blocks}, {len(res.block_ids)}) of reservation {res.reservation_id}"
            )

    def _revoke(self, res: Reservation, reason: str, notify_owner: bool) -> bool:
        held = res.state is State.OPEN and (res.one_sided or res.inflight_frames > 0)
        if res.state is State.OPEN and res.writer is not None:
            self._revocations.append(Revocation(res.writer, res.reservation_id, reason))
        if held:
            res.state = State.REVOKED
        else:
            self._close(res)
        if notify_owner:
            self._events.append(TransferFailed(res.request_id, res.reservation_id, reason, blocks_held=held))
        return held

    def _close(self, res: Reservation) -> None:
        del self._by_id[res.reservation_id]
        self._by_request.pop(res.request_id, None)
