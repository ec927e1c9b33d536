"""The fleet's KV hand-off, as the live path runs it: a decode worker (D) reserves a remote
prefill's blocks under a kvfabric lease (`ReservationTable`: bind, renew, ready, expire) by a
call into its engine loop, the prefill worker (P) computes the prompt, and its last chunk's
blocks land a transfer time after the first token. Fleet (sim/fleet.py) holds one; it owns
the transfers in flight, and reads the workers, the requests and the clock through the fleet
it serves."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvfabric.reservations import KVArrived
from sim.fleet_types import Flight, Worker

if TYPE_CHECKING:
    from sim.fleet import Fleet


class FleetTransfers:
    """The fleet's reservations, pushes, landings and leases."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pushing: dict[str, Flight] = {}
        """Remote prefills whose KV has not landed: their prefill worker renews the lease."""

    def reserve(self, f: Flight, d: Worker, p: str) -> bool:
        """D reserves the prompt's blocks under a lease, then P computes it."""
        if f.done:
            return True
        fleet = self.fleet
        n = len(f.item.prompt)
        assert f.booking is not None
        request = d.engine.connector.reserve(f.rid, f.item.prompt, f.item.max_tokens, f.hashes)
        if request is None:  # the load book's view was stale: wait for room as the router does
            f.booking.end()
            f.booking = None
            fleet.waiting_room.append(f)
            return False
        fleet.stats["num_remote_prefill"] += 1
        fleet.index.predict(p, f.hashes)
        assert d.table is not None
        res = d.table.add(f.rid, list(request.block_ids), request.num_skip_blocks)
        d.table.bind(res.reservation_id, writer=_writer(p), one_sided=True)
        f.reservation_id = res.reservation_id
        self.pushing[f.rid] = f
        pw = fleet.workers[p]
        if fleet.tier is not None:
            fleet.tier.before_add(pw, f.rid, f.hashes, n)
        pw.engine.add(f.rid, f.item.prompt, 1, block_hashes=f.hashes)
        if fleet.hw.push_token_s:  # the push of every block D lacks shares P's cores with its prefill
            pw.engine.extra_s[f.rid] = fleet.hw.push_token_s * (n - request.num_cached_tokens)
        fleet.wake(pw)
        return True

    def push(self, f: Flight, p: Worker, first_token: int) -> None:
        """The first token is out; the blocks of the last chunk still go to D (the earlier ones
        went while later chunks computed)."""
        fleet = self.fleet
        assert f.decision is not None
        d = fleet.workers[f.decision.decode_worker]
        if f.item.max_tokens <= 1:
            p.engine.connector.give_back(f.rid)
            fleet.finish(f, "OK")
            return
        n = len(f.item.prompt)
        last_chunk = min(n - f.outcome.num_cached, p.engine.scheduler.config.max_num_batched_tokens)
        t = fleet.hw.transfer_s(max(last_chunk, 1), same_node=d.node == p.node)
        fleet.at(fleet.now + t, self._landed, f, p, d, first_token)

    def _landed(self, f: Flight, p: Worker, d: Worker, first_token: int) -> None:
        fleet = self.fleet
        p.engine.connector.give_back(f.rid)
        self.pushing.pop(f.rid, None)
        fleet.pools.stop_if_drained(p)
        if f.done or d.table is None or f.reservation_id is None:
            return
        res = d.table.get(f.reservation_id)
        if res is not None:
            d.table.record_written(res.reservation_id, _writer(p.worker_id),
                                   [(res.num_skip_blocks, len(res.block_ids) - res.num_skip_blocks)])
            d.table.ready(res.reservation_id, _writer(p.worker_id), first_token, len(f.item.prompt))
        for event in d.table.take_events():
            if isinstance(event, KVArrived) and event.request_id == f.rid:
                if d.engine.connector.landed(f.rid, first_token):
                    fleet.finish(f, "OK")
                fleet.wake(d)
            elif event.request_id == f.rid:
                fleet.fail(f, "UNAVAILABLE")

    def leases(self) -> None:
        """The router's timer: the push lanes renew their leases; a lease that ran out fails its stream."""
        fleet = self.fleet
        for f in list(self.pushing.values()):
            assert f.decision is not None and f.decision.prefill_worker is not None and f.reservation_id is not None
            table = fleet.workers[f.decision.decode_worker].table
            assert table is not None
            table.renew(f.reservation_id, _writer(f.decision.prefill_worker))
        for w in fleet.workers.values():
            if w.table is not None and len(w.table):
                w.table.expire()
                for event in w.table.take_events():  # a lease ran out: the router sees the stream fail
                    if (f := fleet.flights.get(event.request_id)) is not None and not f.done:
                        fleet.fail(f, "UNAVAILABLE")


def _writer(worker_id: str) -> int:
    """A prefill worker's writer id in reservation tables (any stable int per worker)."""
    return hash(worker_id) & 0x7FFFFFFF
