"""Fleet: a splitserve cluster on a virtual clock, run by its own decision code.

    arrivals --> router: AdmissionQueue (admission, its wait forecast, revision), KVIndex +
                 LoadBook + choose_route / choose_round_robin (router/) --> a worker:
    SimEngine (the real Scheduler, KVCacheManager, BlockPool; sim/engine_sim.py) per worker
    P/D: the decode worker reserves blocks (remote-KV admission, a call
         into its engine loop, run between two of its steps) under a kvfabric lease
         (kvfabric/reservations.py ReservationTable: bind, renew, ready, expire); the prefill
         worker's first token ends its part; the KV lands a transfer time later
    autoscaler: PoolGauge (control/pool_gauge.py) -> decide
         (control/autoscaler.py) -> the controller's launch (a worker serves `startup_s`
         later) or drain (the cheapest one by `removal_cost`, stopped once its requests are done)

What is not splitserve's code is the world around it: time (an event heap), the forward pass
(a cost model prices each step's real composition), the wire (a transfer time), and the
client (an `Outcome` per request, bench's own, so a run is summarised as `splitserve bench`
summarises one). The sim's simplifications, each stated where it is made: one router; KV
events reach the index when the step that made them ends (a real router sees them a few
ms later); heartbeats every `heartbeat_s`, as configured for real workers; the KV push
overlaps the prefill's chunks, so at the first token only the last chunk's blocks are left
to move; no worker fails.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

from loadgen.report import SloVerdict
from loadgen.runner import Outcome, Run
from loadgen.workload import WorkloadRequest
from control.autoscaler import AutoscaleState, decide, started
from control.heartbeat import Heartbeat, ModelFacts
from control.pool_gauge import PoolGauge, removal_cost
from control.router_stats import RouterStats
from engine.core.hashing import BlockHasher
from engine.core.kv_cache_manager import window_tokens
from engine.core.step_model import StepShape
from engine.step_profile import LONG_CONTEXT, batch_sizes
from engine.types import BlockHash
from kvfabric.reservations import KVArrived, ReservationTable
from router.admission import AdmissionQueue, Refused, admission_cost
from router.frontend import ItlWindow
from router.kv_index import KVIndex
from router.loads import LoadBook, book_route
from router.policy import RouteDecision, route
from sim.engine_sim import SimEngine, StepResult
from sim.fleet_tier import SimStores
from sim.fleet_types import Flight, FleetConfig, FleetResult, Hardware, Role, Worker

__all__ = ["Fleet", "FleetConfig", "FleetResult", "Hardware"]
TICK_S = 0.1
"""The router's timer (admission revision and expiry, lease renewal), as the real one."""
AUTOSCALE_TICK_S = 1.0
"""The controller's autoscaler tick."""
VOCAB = 128256
"""The vocabulary the workers' heartbeats report."""
PROGRESS_EVERY = 20000
"""Events between two calls of `Fleet.on_progress`."""
PROMPT_MEMO = 8192
"""Prompts whose hashes a process keeps (a replayed trace's distinct prompts: 3,993 in the synthetic one)."""
_PROMPT_HASHES: dict[tuple[int, int], tuple[list[int], list[BlockHash]]] = {}
"""(block size, the prompt object's id) -> (the prompt, its hashes): shared by every fleet of the
process, as a plan's runs of one trace at many rates send the same prompt objects."""


class Fleet:
    def __init__(self, config: FleetConfig, hardware: Hardware, items: list[WorkloadRequest],
                 prefill_hardware: Hardware | None = None, verdict: SloVerdict | None = None) -> None:
        """`prefill_hardware`: what a prefill worker's steps cost where its tensor-parallel
        degree differs from a decode worker's (`FleetConfig.prefill_gpus_per_worker`).
        `verdict`: the run stops as soon as it is decided (`FleetResult.decided`), its outcomes
        those of the requests so far."""
        self.config, self.hw = config, hardware
        self.prefill_hw = prefill_hardware or hardware
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        clock = self.clock
        self.queue = AdmissionQueue(config.admission, clock)
        self.index = KVIndex(clock)
        self.loads = LoadBook({})
        self.rng = random.Random(config.seed)
        self.jitter = random.Random(config.seed + 1)
        self.hops = random.Random(config.seed + 2)
        self.hasher = BlockHasher(b"sim", "sim", config.block_size)
        """The workers' key too (SimEngine's defaults), so a prompt's hashes are the same list everywhere."""
        self.verdict = verdict
        self.itl = ItlWindow()
        self.targets = {"prefill": config.num_prefill, "decode": config.num_decode}
        self.workers: dict[str, Worker] = {}
        self._ids = {"prefill": itertools.count(), "decode": itertools.count()}
        self._next_gpu = 0
        """The first GPU of the next worker launched: workers fill nodes in order."""
        self.flights: dict[str, Flight] = {}
        self.waiting_room: list[Flight] = []
        """Routed requests no decode worker had KV room for (retried as bookings end)."""
        self.pushing: dict[str, Flight] = {}
        """Remote prefills whose KV has not landed: their prefill worker renews the lease."""
        self.gauge = PoolGauge(clock)
        self.scale_state = AutoscaleState()
        self.actions: list[tuple[float, str]] = []
        """(time, the autoscaler's reason) for each decision that changed a target."""
        self.pool_sizes: list[tuple[float, int, int]] = []
        """(time, prefill workers, decode workers) serving or draining, at each change."""
        self.tier = SimStores(config.kv_store_blocks, config.block_size, hardware, config.routing.store_fetch_cost,
                              clock, config.kv_store_disk_blocks) if config.kv_store_blocks else None
        """Each node's shared KV store (None: no tier)."""
        self.stats = {"num_local_prefill": 0, "num_remote_prefill": 0, "num_kv_waits": 0, "num_steps": 0,
                      "num_preemptions": 0}
        self._turn = 0
        long = min(LONG_CONTEXT, config.max_model_len // 2)
        self.step_shape = StepShape(profile=tuple(
            (float(n), float(n * (ctx + 1)), hardware.step_s([(1, ctx)] * n, n))
            for n in batch_sizes(config.scheduler.max_num_seqs) for ctx in (8, long)))
        """What each decode worker's start-up profile (engine/step_profile.py) reports, priced."""
        self._timers = {self._tick, self._heartbeats, self._autoscale}
        self._num_work = 0
        """Events other than timers in the heap: none left, and no request can move."""
        self._items = items
        self.on_progress: Callable[[Fleet], None] | None = None
        self.num_left = len(items)
        """Requests not yet finished."""
        for role in _interleaved(config.num_prefill, config.num_decode):
            self.launch(role, ready_at=0.0)
        self._record_sizes()

    def clock(self) -> float:
        return self.now

    # -- the loop ------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))
        self._num_work += fn not in self._timers

    def run(self) -> FleetResult:
        hops, per_token = self.hw.hops_s, self.hw.hop_token_s
        for i, item in enumerate(self._items):
            hop = (self.hops.choice(hops) if hops else self.hw.rpc_s) + per_token * len(item.prompt)
            self.at((item.at_s or 0.0) + hop, self._arrive, i, item)
        self.at(TICK_S, self._tick)
        self.at(0.0, self._heartbeats)
        if self.config.autoscale is not None:
            self.at(AUTOSCALE_TICK_S, self._autoscale)
        for n in itertools.count():
            if not (self._events and self.num_left) or (self.verdict is not None and self.verdict.decided is not None):
                break
            if self.on_progress is not None and not n % PROGRESS_EVERY:
                self.on_progress(self)
            self.now, _, fn, args = heapq.heappop(self._events)
            self._num_work -= fn not in self._timers
            fn(*args)
            if self.num_left and not self._num_work and not self.queue.num_queued and not self.waiting_room:
                stuck = [f.rid for f in self.flights.values() if not f.done]
                raise RuntimeError(f"simulation stuck at {self.now:.1f} s: nothing can move {stuck[:5]}")
        end = self.now
        gpu_s = sum(((w.stopped_at if w.stopped_at is not None else end) - w.created_at) * self.config.gpus(w.role)
                    for w in self.workers.values())
        outcomes = [f.outcome for f in self.flights.values()]
        if self.tier is not None:
            self.stats["num_store_fetched_blocks"] = self.tier.num_fetched_blocks
            self.stats["num_store_evicted_blocks"] = self.tier.num_evicted_blocks
            self.stats["num_store_spilled_blocks"] = self.tier.num_spilled_blocks
            self.stats["num_store_unspilled_blocks"] = self.tier.num_unspilled_blocks
        return FleetResult(Run(outcomes, end - min((o.sent_s for o in outcomes), default=0.0)), gpu_s,
                           self.actions, self.pool_sizes, self.config, dict(self.stats),
                           self.verdict.decided if self.verdict is not None else None)

    # -- workers -------------------------------------------------------------------------
    def launch(self, role: Role, ready_at: float) -> Worker:
        c = self.config
        wid = f"{role}-{next(self._ids[role])}"
        node = self._next_gpu // c.gpus_per_node
        self._next_gpu += c.gpus(role)
        hw = self.prefill_hw if role == "prefill" else self.hw
        engine = SimEngine(hw.for_worker(), c.blocks(role), c.block_size, VOCAB, c.scheduler, model_id="sim",
                           max_model_len=c.max_model_len, role=role, kv_window=c.kv_window,
                           speculative=c.speculative, spec_acceptance=c.spec_acceptance)
        w = self.workers[wid] = Worker(wid, role, engine, node, self.now)
        if role == "decode":
            w.table = ReservationTable(self.clock, c.kv_lease_s)
        self.loads.num_blocks[wid] = c.blocks(role)
        self.at(ready_at, self._ready, w)
        return w

    def _ready(self, w: Worker) -> None:
        if w.state == "starting":
            w.state = "serving"
            if self.now > w.created_at:  # a launch, not the fleet's first workers: as the controller measures it
                self.scale_state = started(self.scale_state, self.now - w.created_at)
            self._record_sizes()
            self._retry_room()

    def serving(self, role: Role) -> list[str]:
        return [w.worker_id for w in self.workers.values() if w.role == role and w.state == "serving"]

    def wake(self, w: Worker) -> None:
        if w.busy or w.stopped_at is not None or not w.engine.has_work:
            return
        result = w.engine.step(self.now)
        self.stats["num_steps"] += 1
        if result.duration_s > 0:
            w.busy = True
            self.at(self.now + result.duration_s, self._step_done, w, result)

    def _step_done(self, w: Worker, result: StepResult) -> None:
        w.busy = False
        self.stats["num_preemptions"] += result.num_preempted
        events = w.engine.pool.take_events()
        if events:
            for e in events:
                self.index.apply(w.worker_id, e)
                if self.tier is not None and e.kind == "stored":
                    self.tier.offer(w.node, e.block_hashes)
            self.index.expire_predictions()  # as the router's feed, after each batch of events
        for rid, num_tokens in result.tokens.items():
            f = self.flights.get(rid)
            if f is not None and not f.done:
                self._token(f, w, num_tokens, result.first.get(rid))
        if w.role == "decode":
            for rid in result.finished:
                f = self.flights.get(rid)
                if f is not None and not f.done:
                    self.finish(f, "OK")
        calls, w.calls = w.calls, []
        for fn, *args in calls:
            fn(*args)
        self.wake(w)
        self._stop_if_drained(w)

    # -- requests ------------------------------------------------------------------------
    def _arrive(self, i: int, item: WorkloadRequest) -> None:
        c = self.config
        rid = f"r{i}"
        outcome = Outcome(sent_s=item.at_s or 0.0, num_prompt=len(item.prompt))
        n = len(item.prompt)
        f = self.flights[rid] = Flight(rid, item, outcome, [], 0)
        if n + 1 > c.max_model_len:
            self.fail(f, "INVALID_ARGUMENT")
            return
        f.hashes = self._hash_prompt(item.prompt)
        workers = [*self.serving("decode"), *self.serving("prefill")]
        overlap = self.index.overlap(f.hashes, workers) if workers else {}
        best = max(overlap.values(), default=0)
        # charged the worst case, a request declares its length as max_tokens (the router knows
        # it); charged the expected, it is a chat without max_tokens whose length the router learns
        limit = min(item.max_tokens, c.max_model_len - n)
        if self.queue.config.charge_output == "expected":
            limit = c.max_model_len - n
        new_tokens = self.queue.expected_output("", "generate", limit)
        f.cost_tokens = admission_cost(n, new_tokens, min(best * c.block_size, n - 1),
                                       window_tokens(c.block_size, c.kv_window) if c.kv_window else None)
        offered = self.queue.offer(rid, 0, f.cost_tokens, None, "", new_tokens, limit)
        if isinstance(offered, Refused):
            self.fail(f, "RESOURCE_EXHAUSTED")
        elif offered:  # routed now, over the index as it is: the same overlap
            self._admitted(f, overlap)

    def _hash_prompt(self, prompt: list[int]) -> list[BlockHash]:
        """The router's hashes of a prompt; a trace replayed end to end sends the same prompt
        objects again, and their hashes are the same (the last `PROMPT_MEMO` used kept)."""
        key = (self.config.block_size, id(prompt))
        memo = _PROMPT_HASHES.pop(key, None)
        if memo is None or memo[0] is not prompt:
            memo = (prompt, self.hasher.hash_prompt(prompt, ""))
            if len(_PROMPT_HASHES) >= PROMPT_MEMO:
                del _PROMPT_HASHES[next(iter(_PROMPT_HASHES))]
        _PROMPT_HASHES[key] = memo  # the newest last: the oldest used goes first
        return memo[1]

    def _admitted(self, f: Flight, overlap: dict[str, int] | None = None) -> None:
        f.admitted_at = self.now
        f.room_until = self.now + self.config.kv_wait_s
        self._dispatch(f, overlap)

    def _dispatch(self, f: Flight, overlap: dict[str, int] | None = None) -> bool:
        """Routes and starts the request; False (it waits for room) when no decode worker has any.
        `overlap`: the KV index's for the serving workers, when it was read in this same event."""
        c = self.config
        decision = self._route(f, overlap)
        if decision is None:
            if f not in self.waiting_room:
                self.stats["num_kv_waits"] += 1
                self.waiting_room.append(f)
            return False
        d, p = self.workers[decision.decode_worker], decision.prefill_worker
        f.booking = book_route(self.loads, self.index, decision, f.hashes, len(f.item.prompt), c.block_size,
                               c.kv_window)
        f.decision = decision
        if p is None:
            self.stats["num_local_prefill"] += 1
            if self.tier is not None:
                self.tier.before_add(d, f.rid, f.hashes, len(f.item.prompt))
            d.engine.add(f.rid, f.item.prompt, f.item.max_tokens, block_hashes=f.hashes)
            self.wake(d)
            return True
        if d.busy:  # the reservation is a call into D's engine loop, which runs calls between steps
            d.calls.append((self._reserve, f, d, p))
            return True
        return self._reserve(f, d, p)

    def _route(self, f: Flight, overlap: dict[str, int] | None = None) -> RouteDecision | None:
        c = self.config
        decodes = [self.loads.load(w) for w in self.serving("decode")]
        prefills = [self.loads.load(w) for w in self.serving("prefill")]
        self._turn += 1
        tier = self.tier
        return route(len(f.item.prompt), decodes, prefills,
                     lambda ids: overlap if overlap is not None else self.index.overlap(f.hashes, ids),
                     c.routing, c.block_size, self._turn, self.rng, c.kv_window,
                     (lambda ids: tier.stored(f.hashes, self.workers, ids))
                     if tier is not None else None)

    def _token(self, f: Flight, w: Worker, num_tokens: int, first: tuple[int, int] | None) -> None:
        o = f.outcome
        seen = self.now  # the first token's delivery is in the hops
        if o.ttft_s is not None and self.hw.delivery_s:
            if not f.delivery:  # a pattern, from a phase of its own: a short stream's gaps are any of its gaps
                cycle = self.jitter.choice(self.hw.delivery_s)
                phase = self.jitter.randrange(len(cycle))
                f.delivery = [x - cycle[phase] for x in (*cycle[phase:], *cycle[:phase])]
            seen += f.delivery[len(o.itls_s) % len(f.delivery)]
        seen = max(seen, f.last_seen)  # a stream delivers in order: a token early on the pattern comes with the last
        if o.ttft_s is None and first is not None:  # from P (then the KV moves to D) or from D itself
            o.ttft_s = seen - o.sent_s
            o.num_cached = first[1]
            if self.verdict is not None:
                self.verdict.first_token(o)
            assert f.booking is not None and f.admitted_at is not None
            f.booking.prefilled()
            for rid in self.queue.observe_ttft(self.now - f.admitted_at, f.cost_tokens):
                self._admitted(self.flights[rid])
            if w.role == "prefill":
                self._push(f, w, first[0])
        elif o.ttft_s is not None:
            gap = seen - f.last_seen
            o.itls_s.append(gap)
            self.itl.observe(gap, 1)
        o.num_out = num_tokens
        f.last_seen = seen
        self.queue.progress(f.rid, num_tokens)

    def finish(self, f: Flight, code: str) -> None:
        f.done = True
        f.outcome.code = code
        f.outcome.end_s = max(self.now, f.last_seen)
        self.num_left -= 1
        if self.verdict is not None:
            self.verdict.ended(f.outcome)
        if f.booking is not None:
            f.booking.end()
        if code == "OK":
            self.queue.lengths.observe("", "generate", f.outcome.num_out)
        admitted = self.queue.release(f.rid)
        self.pushing.pop(f.rid, None)
        if f.decision is not None:
            d = self.workers[f.decision.decode_worker]
            if d.table is not None:
                d.table.cancel(f.rid)
            d.engine.connector.end(f.rid)  # (the fleet's writers stop with the flight: no fence to wait for)
            self._stop_if_drained(d)
            if f.decision.prefill_worker is not None:
                self.workers[f.decision.prefill_worker].engine.abort(f.rid)
        for rid in admitted:
            self._admitted(self.flights[rid])
        self._retry_room()

    def fail(self, f: Flight, code: str) -> None:
        f.outcome.details = code
        self.finish(f, code)

    def _retry_room(self) -> None:
        room, self.waiting_room = self.waiting_room, []
        for i, f in enumerate(room):
            if not f.done and not self._dispatch(f):
                self.waiting_room += [g for g in room[i + 1:] if g not in self.waiting_room]
                return

    # -- timers --------------------------------------------------------------------------
    def _tick(self) -> None:
        decodes = self.serving("decode")  # as the router's timer: the budget follows the decode pool
        c = self.config
        for rid in self.queue.set_capacity(len(decodes) * c.num_blocks * c.block_size,
                                           window_tokens(c.block_size, c.kv_window) if c.kv_window else None):
            self._admitted(self.flights[rid])
        self.queue.forecast.set_step_model(self.step_shape, len(decodes))
        for rid, refusal in self.queue.revise():
            self.fail(self.flights[rid], "RESOURCE_EXHAUSTED")
        for rid in self.queue.expire():
            self.fail(self.flights[rid], "RESOURCE_EXHAUSTED")
        expired = [f for f in self.waiting_room if f.room_until <= self.now]
        self.waiting_room = [f for f in self.waiting_room if f.room_until > self.now]
        for f in expired:  # no decode worker had room within kv_wait_s
            if not f.done:
                self.fail(f, "RESOURCE_EXHAUSTED")
        self._leases()
        if self.num_left:
            self.at(self.now + TICK_S, self._tick)

    # -- P/D: the decode worker reserves, the prefill worker computes and pushes ----------------
    def _reserve(self, f: Flight, d: Worker, p: str) -> bool:
        """D reserves the prompt's blocks under a lease, then P computes it."""
        if f.done:
            return True
        assert f.booking is not None
        if self.workers[p].stopped_at is not None:  # drained and stopped since the route (D was busy):
            f.booking.end()  # its RPC fails and the router routes again
            f.booking = f.decision = None
            return self._dispatch(f)
        n = len(f.item.prompt)
        request = d.engine.connector.reserve(f.rid, f.item.prompt, f.item.max_tokens, f.hashes)
        if request is None:  # the load book's view was stale: wait for room as the router does
            f.booking.end()
            f.booking = None
            self.waiting_room.append(f)
            return False
        self.stats["num_remote_prefill"] += 1
        self.index.predict(p, f.hashes)
        assert d.table is not None
        res = d.table.add(f.rid, list(request.block_ids), request.num_skip_blocks)
        d.table.bind(res.reservation_id, writer=_writer(p), one_sided=True)
        f.reservation_id = res.reservation_id
        self.pushing[f.rid] = f
        pw = self.workers[p]
        if self.tier is not None:
            self.tier.before_add(pw, f.rid, f.hashes, n)
        pw.engine.add(f.rid, f.item.prompt, 1, block_hashes=f.hashes)
        if self.hw.push_token_s:  # the push of every block D lacks shares P's cores with its prefill
            pw.engine.extra_s[f.rid] = self.hw.push_token_s * (n - request.num_cached_tokens)
        self.wake(pw)
        return True

    def _push(self, f: Flight, p: Worker, first_token: int) -> None:
        """The first token is out; the blocks of the last chunk still go to D (the earlier ones
        went while later chunks computed)."""
        assert f.decision is not None
        d = self.workers[f.decision.decode_worker]
        if f.item.max_tokens <= 1:
            p.engine.connector.give_back(f.rid)
            self.finish(f, "OK")
            return
        n = len(f.item.prompt)
        last_chunk = min(n - f.outcome.num_cached, p.engine.scheduler.config.max_num_batched_tokens)
        t = self.hw.transfer_s(max(last_chunk, 1), same_node=d.node == p.node)
        self.at(self.now + t, self._landed, f, p, d, first_token)

    def _landed(self, f: Flight, p: Worker, d: Worker, first_token: int) -> None:
        p.engine.connector.give_back(f.rid)
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
                if d.engine.connector.landed(f.rid, first_token):
                    self.finish(f, "OK")
                self.wake(d)
            elif event.request_id == f.rid:
                self.fail(f, "UNAVAILABLE")

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
                        self.fail(f, "UNAVAILABLE")

    # -- the control plane: heartbeats, the autoscaler, drains ---------------------------------
    def _heartbeats(self) -> None:
        self.loads.set_heartbeats({w.worker_id: self._beat(w) for w in self.workers.values() if w.stopped_at is None})
        if self.num_left:
            self.at(self.now + self.config.heartbeat_s, self._heartbeats)

    def _beat(self, w: Worker) -> Heartbeat:
        load = w.engine.load()
        if w.beat is not None and w.beat[0] == (load, w.state):
            return w.beat[1]  # type: ignore[no-any-return]
        c = self.config
        facts = ModelFacts("sim", c.block_size, VOCAB, c.max_model_len, load.num_total_blocks, c.kv_window)
        beat = Heartbeat(w.worker_id, w.role, state=w.state, facts=facts, load=load)  # type: ignore[arg-type]
        w.beat = ((load, w.state), beat)
        return beat

    def _autoscale(self) -> None:
        c = self.config
        assert c.autoscale is not None
        members = [(w.worker_id, w.role, w.state) for w in self.workers.values() if w.stopped_at is None]
        beats = {w: self.loads.heartbeats[w] for w, _, _ in members if w in self.loads.heartbeats}
        snapshot = self.gauge.snapshot(members, beats, {"sim": RouterStats(
            router_id="sim", address="", itl_p50_ms=self.itl.p50_ms(), num_queued=self.queue.num_queued,
            inflight_tokens=self.queue.inflight_tokens, budget_tokens=self.queue.budget_tokens)})
        decision = decide(snapshot, self.scale_state, self.now, c.autoscale)
        self.scale_state = decision.state
        if "->" in decision.reason:
            self.actions.append((self.now, decision.reason))
        for role in ("prefill", "decode"):
            self._reconcile(role, decision.target(role))  # type: ignore[arg-type]
        self.itl.samples.clear()  # the next tick measures its own window
        if self.num_left:
            self.at(self.now + AUTOSCALE_TICK_S, self._autoscale)

    def _reconcile(self, role: Role, target: int) -> None:
        """As the controller: launch up to the target; over it, drain the cheapest serving worker."""
        live = [w for w in self.workers.values() if w.role == role and w.state in ("starting", "serving")]
        for _ in range(target - len(live)):
            self.launch(role, ready_at=self.now + self.config.startup_s)
        draining = any(w.role == role and w.state == "draining" for w in self.workers.values())
        serving = [w for w in live if w.state == "serving"]
        if len(live) > target and not draining and serving:
            w = min(serving, key=lambda w: removal_cost(w.worker_id, self.loads.heartbeats.get(w.worker_id)))
            w.state = "draining"
            self._stop_if_drained(w)
        self._record_sizes()

    def _stop_if_drained(self, w: Worker) -> None:
        if w.state == "draining" and not w.busy and not w.engine.has_work and not w.engine.connector.num_lent \
                and not w.engine.scheduler.requests:
            w.state, w.stopped_at = "stopped", self.now
            self.loads.num_blocks.pop(w.worker_id, None)
            self.index.forget_worker(w.worker_id)
            self._record_sizes()

    def _record_sizes(self) -> None:
        workers = self.workers.values()
        sizes = tuple(sum(w.role == r and w.state in ("serving", "draining") for w in workers)
                      for r in ("prefill", "decode"))
        if not self.pool_sizes or self.pool_sizes[-1][1:] != sizes:
            self.pool_sizes.append((self.now, *sizes))


def _interleaved(num_prefill: int, num_decode: int) -> list[Role]:
    """Launch order spreading each role evenly over the nodes (so most P/D pairs share one)."""
    order = sorted([((i + 0.5) / num_prefill, "prefill") for i in range(num_prefill)]
                   + [((i + 0.5) / num_decode, "decode") for i in range(num_decode)])
    return [role for _, role in order]  # type: ignore[misc]


def _writer(worker_id: str) -> int:
    """A prefill worker's writer id in reservation tables (any stable int per worker)."""
    return hash(worker_id) & 0x7FFFFFFF
