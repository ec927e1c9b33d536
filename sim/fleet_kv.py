"""The fleet's KV hand-off, as the live path runs it: a decode worker (D) reserves a remote
prefill's blocks under a kvfabric lease (`ReservationTable`: bind, renew, ready, expire) by a
call into its engine loop, the prefill worker (P) computes the prompt, and its last chunk's
blocks land a transfer time after the first token. A part of `Fleet` (sim/fleet.py), which
holds the state named below; split out so each file reads as one thing."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfabric.reservations import KVArrived
from sim.fleet_types import Flight, FleetConfig, Hardware, Worker


class FleetTransfers:
    """Fleet's reservations, pushes, landings and leases (the state it reads is Fleet's)."""

    config: FleetConfig
    hw: Hardware
    now: float
    workers: dict[str, Worker]
    flights: dict[str, Flight]
    pushing: dict[str, Flight]
    waiting_room: list[Flight]
    stats: dict[str, int]
    index: Any
    at: Callable[..., None]
    _wake: Callable[[Worker], None]
    _finish: Callable[[Flight, str], None]
    _fail: Callable[[Flight, str], None]
    _stop_if_drained: Callable[[Worker], None]

    def _reserve(self, f: Flight, d: Worker, p: str) -> bool:
        """D reserves the prompt's blocks under a lease, then P computes it."""
        if f.done:
            return True
        c = self.config
        n = len(f.item.prompt)
        assert f.booking is not None
        request = d.engine.add_remote(f.rid, f.item.prompt, f.item.max_tokens, f.hashes)
        if request is None:  # the load book's view was stale: wait for room as the router does
            f.booking.end()
            f.booking = None
            self.waiting_room.append(f)
            return False
        self.stats["num_remote_prefill"] += 1
        self.index.predict(p, f.hashes)
        assert d.table is not None
        res = d.table.add(f.rid, list(request.block_ids), request.num_cached_tokens // c.block_size)
        d.table.bind(res.reservation_id, writer=_writer(p), one_sided=True)
        f.reservation_id = res.reservation_id
        self.pushing[f.rid] = f
        pw = self.workers[p]
        pw.engine.add(f.rid, f.item.prompt, 1, block_hashes=f.hashes)
        if self.hw.push_token_s:  # the push of every block D lacks shares P's cores with its prefill
            pw.engine.extra_s[f.rid] = self.hw.push_token_s * (n - request.num_cached_tokens)
        self._wake(pw)
        return True

    def _push(self, f: Flight, p: Worker, first_token: int) -> None:
        """The first token is out; the blocks of the last chunk still go to D (the earlier ones
        went while later chunks computed)."""
        assert f.decision is not None
        d = self.workers[f.decision.decode_worker]
        if f.item.max_tokens <= 1:
            p.engine.release_handoff(f.rid)
            self._finish(f, "OK")
            return
        n = len(f.item.prompt)
        last_chunk = min(n - f.outcome.num_cached, self.config.scheduler.max_num_batched_tokens)
        t = self.hw.transfer_s(max(last_chunk, 1), same_node=d.node == p.node)
        self.at(self.now + t, self._landed, f, p, d, first_token)

    def _landed(self, f: Flight, p: Worker, d: Worker, first_token: int) -> None:
        p.engine.release_handoff(f.rid)
        self.pushing.pop(f.rid, None)
        self._stop_if_drained(p)
        if f.done or d.table is None or f.reservation_id is None:
            return
        res = d.table.get(f.reservation_id)
        if res is not None:
            d.table.record_written(res.reservation_id, _writer(p.worker_id),
                                   [(res.num_skip_blocks, len(res.block_ids) - res.num_skip_blocks)])
            d.table.ready(res.reservation_id, _writer(p.worker_id), first_token, len(f.item.prompt))
        for event in d.table.take_events():
            if isinstance(event, KVArrived) and event.request_id == f.rid:
                if d.engine.remote_ready(f.rid, first_token):
                    self._finish(f, "OK")
                self._wake(d)
            elif event.request_id == f.rid:
                self._fail(f, "UNAVAILABLE")

    def _leases(self) -> None:
        """The router's timer: the push lanes renew their leases; a lease that ran out fails its stream."""
        for f in list(self.pushing.values()):
            assert f.decision is not None and f.decision.prefill_worker is not None and f.reservation_id is not None
            table = self.workers[f.decision.decode_worker].table
            assert table is not None
            table.renew(f.reservation_id, _writer(f.decision.prefill_worker))
        for w in self.workers.values():
            if w.table is not None and len(w.table):
                w.table.expire()
                for event in w.table.take_events():  # a lease ran out: the router sees the stream fail
                    if (f := self.flights.get(event.request_id)) is not None and not f.done:
                        self._fail(f, "UNAVAILABLE")


def _writer(worker_id: str) -> int:
    """A prefill worker's writer id in reservation tables (any stable int per worker)."""
    return hash(worker_id) & 0x7FFFFFFF
