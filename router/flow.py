"""RequestFlow: runs an admitted request on workers, retrying elsewhere when one fails under it.

One try (`_run`): route (KV index overlap + loads -> decode worker D, prefill worker P
or none) -> book it in the `LoadBook` -> open D's `Decode` call -> remote prefill: D
answers `reserved{ticket}`, P's `Prefill` call gets the ticket and answers the first
token, which goes to the client at once; D says `arrived` once the KV and first token
landed (P's call, watched meanwhile, ends when D acked the push) -> D's tokens from the
second on -> the final response. A local prefill skips P: D's first tokens event is
the first token. Whatever ends a try cancels both calls (that is the abort: each
worker frees its blocks) and settles the booking once. A `WorkerFailed` ends only the
try: the next one avoids that worker and continues from the tokens already sent (the
prompt plus those tokens is prefilled again), so the client sees one stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import grpc

from control.heartbeat import ModelFacts, Probes
from engine.core.hashing import BlockHasher
from proto import generate_pb2 as pb
from proto.convert import finish_from_pb, sampling_to_pb
from control import tracing
from router.attempt import Attempt, BlockHashMemo, Deadline, Prepared, Progress, RequestFailed, WorkerFailed
from router.clients import WorkerCall, WorkerClients, WorkerEvent
from router.config import RouterConfig
from router.choices import Choices
from router.kv_index import KVIndex
from router.loads import Booking, LoadBook, book_route
from router.members import Members
from router.policy import RouteDecision, StoreHit, route, store_hit, tells_fetch
from router.reply import Reply, Route

logger = logging.getLogger(__name__)

PEEK_AFTER_TRANSFER_ERROR_S = 1.0
"""After a failed KV transfer, how long to watch the decode call for the decode worker's death."""
KV_RECHECK_S = 0.1
"""A request waiting for KV room routes again at least this often (heartbeats move too)."""


class RequestFlow:
    def __init__(self, config: RouterConfig, members: Members, clients: WorkerClients, index: KVIndex,
                 loads: LoadBook, clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                 stores: KVIndex | None = None) -> None:
        """`stores`: what each host's KV store holds, by store id (None: no tier is priced)."""
        self.config, self.members, self.clients = config, members, clients
        self.index, self.loads, self.clock = index, loads, clock
        self.stores = stores
        self.rng = random.Random(seed)
        self._hashers: dict[tuple[str, int], BlockHasher] = {}
        self._down: dict[str, float] = {}
        """Worker id -> until when (router clock) it gets no new requests."""
        self._turn = 0
        self._probes = Probes()
        """By worker id: when it may next fetch where its measurements price the fetch out."""
        self._room = asyncio.Event()
        """Set (and replaced) whenever a booking ends: KV may be free for a request waiting for it."""
        self.stats = {"num_local_prefill": 0, "num_remote_prefill": 0, "num_retries": 0, "num_busy_waits": 0,
                      "num_kv_waits": 0}

    def down_workers(self) -> list[str]:
        """Workers that failed as dead or unreachable lately, or whose heartbeat expired. A down
        mark outlasts `worker_down_s` while the registry is away: only a heartbeat can clear it."""
        now = self.clock()
        if self.loads.reachable:
            self._down = {w: t for w, t in self._down.items() if t > now}
        known = {*self.members.serving("decode"), *self.members.serving("prefill"), *self._down}
        return sorted(w for w in known if w in self._down or self.loads.gone(w))

    def cached_tokens(self, prep: Prepared) -> int:
        """The longest prefix of the prompt some serving worker holds (the KV index's view)."""
        facts = self.members.facts
        workers = [*self.members.serving("decode"), *self.members.serving("prefill")]
        if facts is None or not workers:
            return 0
        hashes = self._hashes(facts, prep.token_ids, prep.tenant, prep.block_hashes)
        best = max(self.index.overlap(hashes, workers).values())
        return min(best * facts.block_size, max(len(prep.token_ids) - 1, 0))

    async def run(self, prep: Prepared, deadline: Deadline, progress: Progress,
                  out: Choices) -> AsyncIterator[Reply]:
        """The request's responses; when a worker fails under it, tries again on others."""
        avoid: set[str] = set()
        for n in range(self.config.max_attempts):
            try:
                # closed, this try closes at once: its worker calls are cancelled now, not when it is collected
                async with contextlib.aclosing(self._run(prep.attempt(n, progress.token_ids), deadline, progress, out,
                                                         avoid)) as responses:
                    async for response in responses:
                        yield response
                return
            except WorkerFailed as e:
                if prep.params.n > 1 and out.started:  # n choices: what each sent cannot be re-prefilled as one prompt
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{e.message}; a request of {prep.params.n} "
                                        "choices cannot go on elsewhere once it has sent tokens: retry it", 1.0) from None
                avoid.add(e.worker_id)
                if e.down:
                    self._down[e.worker_id] = self.clock() + self.config.worker_down_s
                if n + 1 == self.config.max_attempts:
                    raise
                self.stats["num_retries"] += 1
                progress.span.add_event("retry", {"splitserve.attempt": n + 1, "splitserve.worker": e.worker_id,
                                                  "splitserve.reason": e.message, "splitserve.tokens_sent": progress.num_sent})
                logger.warning("request %s: %s; trying again (%d tokens sent so far)",
                               prep.request_id, e.message, progress.num_sent)

    # -- one try -------------------------------------------------------------------------------
    async def _run(self, attempt: Attempt, deadline: Deadline, progress: Progress, out: Choices,
                   avoid: set[str]) -> AsyncIterator[Reply]:
        await self._await_decode_worker(avoid, deadline)
        route = tracing.child("router.route", progress.span)
        decision, hashes, block_size = await self._route_with_room(attempt, avoid, deadline)
        tracing.end(route, splitserve__decode_worker=decision.decode_worker,
                    splitserve__prefill_worker=decision.prefill_worker or "local",
                    splitserve__decode_cached_blocks=decision.num_decode_cached_blocks,
                    splitserve__prefill_cached_blocks=decision.num_prefill_cached_blocks)
        progress.routed = progress.routed or time.perf_counter()
        progress.route = Route(decision.decode_worker, decision.prefill_worker or "", decision.local_prefill)
        hint = self._store_hint(hashes, decision)  # before the booking predicts the prompt's blocks there
        booking = self._book(attempt, decision, hashes, block_size)
        d, p = booking.decode, booking.prefill
        calls: list[WorkerCall] = []
        try:
            decode = self.clients.call(d, pb.DecodeRequest(
                request_id=attempt.worker_request_id, prompt_token_ids=attempt.token_ids,
                sampling=sampling_to_pb(attempt.params, keep_stop_strings=False), priority=attempt.priority,
                tenant=attempt.tenant, tenant_weight=attempt.tenant_weight, local_prefill=p is None,
                store=hint if p is None else None), deadline, tracing.headers(progress.span))
            calls.append(decode)
            if p is not None:
                prefill = await self._remote_prefill(attempt, p, decode, deadline, calls, tracing.headers(progress.span),
                                                     hint)
                booking.prefilled()
                first_at = time.perf_counter()
                self._first_prefilled(progress, prefill.num_cached_tokens)
                for response in out.tokens(0, [prefill.token_id], list(prefill.logprobs),
                                           finish_from_pb(prefill.finish_reason), prefill.top_logprobs,
                                           prefill.prompt_logprobs if prefill.HasField("prompt_logprobs") else None):
                    yield response
                lps = list(prefill.choice_logprobs)
                for i, token in enumerate(prefill.choice_token_ids, 1):  # n choices: the others' first tokens
                    for response in out.tokens(i, [token], lps[i - 1:i], None):
                        yield response
                if out.finished:
                    return
                await self._arrival(calls[1], decode, progress, first_at)
            async with contextlib.aclosing(self._decode_tokens(progress, out, decode, booking)) as responses:
                async for response in responses:
                    yield response
        except WorkerFailed:
            for w in (d, p) if p is not None else (d,):  # a retry must not be routed on blocks that never landed
                self.index.retract(w, hashes)
            raise
        finally:
            for call in calls:
                call.cancel()
            booking.end()
            self._room.set()
            self._room = asyncio.Event()

    async def _remote_prefill(self, attempt: Attempt, p: str, decode: WorkerCall, deadline: Deadline,
                              calls: list[WorkerCall], trace: tuple[tuple[str, str], ...],
                              hint: pb.StoreHint | None = None) -> pb.FirstToken:
        ev = await self._next(decode, self.config.reserve_timeout_s)
        if ev.WhichOneof("event") != "reserved":  # type: ignore[union-attr]
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"{decode.worker_id}: expected a reservation first")
        prefill = self.clients.call(p, pb.PrefillRequest(
            request_id=attempt.worker_request_id, prompt_token_ids=attempt.token_ids,
            sampling=sampling_to_pb(attempt.params, keep_stop_strings=False), priority=attempt.priority,
            tenant=attempt.tenant, tenant_weight=attempt.tenant_weight,
            ticket=ev.reserved.ticket, store=hint), deadline, trace)  # type: ignore[union-attr]
        calls.append(prefill)
        try:
            ev = await self._next(prefill, self.config.prefill_timeout_s)
        except WorkerFailed as e:
            if not e.down:  # its transfer failed: a dead decode worker fails it too
                await self._raise_if_dead(decode)
            raise
        if ev.WhichOneof("event") != "first":  # type: ignore[union-attr]
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"{p}: expected the first token first")
        return ev.first  # type: ignore[union-attr]

    async def _arrival(self, prefill: WorkerCall, decode: WorkerCall, progress: Progress, first_at: float) -> None:
        """Waits for D's `arrived` while watching P's call: either side's failure ends the try,
        blamed on P (the writer) unless D itself is gone."""
        d_next = asyncio.ensure_future(self._next(decode, self.config.prefill_timeout_s))
        p_end = asyncio.ensure_future(self._next(prefill, self.config.prefill_timeout_s, allow_end=True))
        try:
            while True:
                done, _ = await asyncio.wait({d_next, p_end} if not p_end.done() else {d_next},
                                             return_when=asyncio.FIRST_COMPLETED)
                if d_next in done:
                    break
                try:
                    p_end.result()  # `pushed`: D acked the KV; its `arrived` follows
                except WorkerFailed as e:
                    if not e.down:
                        await self._raise_if_dead(decode)
                    raise
            try:
                ev = d_next.result()
            except WorkerFailed as e:
                if e.down:
                    raise
                raise WorkerFailed(prefill.worker_id, grpc.StatusCode.UNAVAILABLE, e.message, down=False) from None
        finally:
            for task in (d_next, p_end):
                if not task.done():
                    task.cancel()  # the read stays pending on its call; `_run` cancels the calls
                elif not task.cancelled():
                    task.exception()  # retrieved: a failure that lost the race is not logged as lost
        if ev.WhichOneof("event") != "arrived":  # type: ignore[union-attr]
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"{decode.worker_id}: expected the KV's arrival")
        progress.transfer_ms = (time.perf_counter() - first_at) * 1e3
        progress.transfer_window_ms = ev.arrived.transfer_window_ms  # type: ignore[union-attr]

    async def _next(self, call: WorkerCall, cap_s: float, allow_end: bool = False) -> WorkerEvent | None:
        """`call.next(cap_s)`, except that a worker that sends nothing for `cap_s` but still
        heartbeats is busy, not dead: the wait goes on (re-checked each `cap_s`) for up to
        `busy_wait_s` in all, and then the request ends RESOURCE_EXHAUSTED, not retried
        elsewhere as if the worker had died."""
        waited = 0.0
        while True:
            try:
                return await call.next(cap_s, allow_end)
            except WorkerFailed as e:
                if not e.timed_out or not self.loads.alive(call.worker_id):
                    raise
            waited += cap_s
            self.stats["num_busy_waits"] += 1
            if waited >= self.config.busy_wait_s:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{call.worker_id} is alive but sent nothing for this request in {waited:.0f} s: "
                                    "the cluster is overloaded; retry later", self.config.busy_wait_s / 10)
            logger.warning("%s sent nothing for %.0f s but still heartbeats: busy, not dead; waiting on",
                           call.worker_id, waited)

    @staticmethod
    async def _raise_if_dead(decode: WorkerCall) -> None:
        """Raises D's failure if D turns out dead or unreachable within a short peek."""
        failure = await decode.failure_within(PEEK_AFTER_TRANSFER_ERROR_S)
        if isinstance(failure, WorkerFailed) and failure.down:
            raise failure

    async def _decode_tokens(self, progress: Progress, out: Choices, decode: WorkerCall,
                             booking: Booking) -> AsyncIterator[Reply]:
        while True:
            ev = await self._next(decode, self.config.decode_idle_timeout_s)
            if ev.WhichOneof("event") != "tokens":  # type: ignore[union-attr]
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"{decode.worker_id}: expected tokens")
            tokens = ev.tokens  # type: ignore[union-attr]
            if booking.prefilling:  # a local prefill's first token
                booking.prefilled()
                self._first_prefilled(progress, tokens.num_cached_tokens)
            for response in out.tokens(tokens.choice, list(tokens.token_ids), list(tokens.logprobs),
                                       finish_from_pb(tokens.finish_reason), tokens.top_logprobs,
                                       tokens.prompt_logprobs if tokens.HasField("prompt_logprobs") else None):
                yield response
            if out.finished:
                return

    async def _await_decode_worker(self, avoid: set[str], deadline: Deadline) -> None:
        """With no decode worker left to try, waits (bounded) for one to join, e.g. a replacement."""
        if self.config.no_worker_wait_s <= 0:
            return
        until = self.clock() + deadline.remaining(self.config.no_worker_wait_s)
        while not [w for w in self.members.serving("decode") if w not in avoid] and self.clock() < until:
            await asyncio.sleep(0.1)

    # -- routing -----------------------------------------------------------------------------
    async def _route_with_room(self, attempt: Attempt, avoid: set[str],
                               deadline: Deadline) -> tuple[RouteDecision, list[bytes], int]:
        """`_route`; when no decode worker has KV room for the request now, routes again as
        bookings end (or every `KV_RECHECK_S`, for fresher heartbeats), for up to `kv_wait_s`."""
        until = self.clock() + deadline.remaining(self.config.kv_wait_s)
        waited = False
        while True:
            try:
                return self._route(attempt, avoid)
            except RequestFailed as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or (left := until - self.clock()) <= 0:
                    raise
            self.stats["num_kv_waits"] += not waited
            waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), min(left, KV_RECHECK_S))

    def _stored(self, hashes: list[bytes], worker_ids: list[str]) -> dict[str, StoreHit]:
        """Per worker, its best KV store hit: its own host's store, or another host's (a worker
        without a tier fetches from none), whichever saves the most computing."""
        if self.stores is None:
            return {}
        held = self.stores.overlap(hashes, self.members.stores())
        routing = self.config.routing
        block_size = self.members.facts.block_size if self.members.facts is not None else 0
        remote = max(((n, s) for s, n in held.items() if s in self.members.store_addresses), default=(0, ""))
        hits = {}
        for w in worker_ids:
            own = self.members.store_of(w)
            if not own:
                continue
            speed = self.members.tier_speed(w)  # priced by what this worker measured
            best = store_hit(held.get(own, 0), speed.fetch, speed.token_s, block_size, routing.store_fetch_cost, own)
            if remote[1] != own and (far := store_hit(remote[0], speed.far_fetch, speed.token_s, block_size,
                                                      routing.remote_store_fetch_cost, remote[1])).saved > best.saved:
                best = far
            hits[w] = best
        return hits

    def _store_hint(self, hashes: list[bytes], decision: RouteDecision) -> pb.StoreHint | None:
        """Where the worker that prefills finds the prompt's blocks: its own host's store (no
        address), another host's, or nowhere (0 blocks: it need not ask; also where fetching is
        no faster than computing, `tells_fetch`), and what its pool held when it was chosen; None:
        the router has no view of the worker's store."""
        worker_id = decision.prefill_worker or decision.decode_worker
        hit = self._stored(hashes, [worker_id]).get(worker_id)
        if hit is None:
            return None
        far = hit.store_id != self.members.store_of(worker_id)
        pool = decision.num_prefill_cached_blocks if decision.prefill_worker else decision.num_decode_cached_blocks
        told = hit.num_blocks if tells_fetch(hit, pool, lambda: self._probes.due(worker_id, self.clock())) else 0
        return pb.StoreHint(address=self.members.store_addresses.get(hit.store_id, "") if far else "",
                            store_id=hit.store_id, num_blocks=told, pool_blocks=pool)

    def _route(self, attempt: Attempt, avoid: set[str]) -> tuple[RouteDecision, list[bytes], int]:
        """Workers that failed this request are avoided; ones that are down too, unless no decode
        worker is left otherwise (down is a guess; a prefill worker is never needed)."""
        facts = self.members.facts
        decode_ids = [w for w in self.members.serving("decode") if w not in avoid]
        if facts is None or not decode_ids:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                "every decode worker failed this request or is gone; retry later", 1.0)
        hashes = self._hashes(facts, attempt.token_ids, attempt.tenant, attempt.block_hashes)
        down = set(self.down_workers())
        decode_ids = [w for w in decode_ids if w not in down] or decode_ids
        decodes = [self.loads.load(w) for w in decode_ids]
        prefills = [self.loads.load(w) for w in self.members.serving("prefill") if w not in avoid and w not in down]
        self._turn += 1
        decision = route(len(attempt.token_ids), decodes, prefills, lambda ids: self.index.overlap(hashes, ids),
                         self.config.routing, facts.block_size, self._turn, self.rng, facts.kv_window,
                         lambda ids: self._stored(hashes, ids))
        if decision is None:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "no decode worker has free KV blocks for this prompt now; retry after 1.0 s", 1.0)
        return decision, hashes, facts.block_size

    def _hashes(self, facts: ModelFacts, token_ids: list[int], tenant: str, memo: BlockHashMemo) -> list[bytes]:
        """The prompt's block hashes under these model facts, computed once per prompt (`memo`)."""
        key = (facts.model_id, facts.block_size)
        if key not in memo:
            memo[key] = self._hasher(*key).hash_prompt(token_ids, tenant)
        return memo[key]

    def _hasher(self, model_id: str, block_size: int) -> BlockHasher:
        key = (model_id, block_size)
        if key not in self._hashers:
            assert self.config.cluster_secret, "RouterService checks the secret"
            self._hashers[key] = BlockHasher(self.config.cluster_secret, model_id, block_size)
        return self._hashers[key]

    def _book(self, attempt: Attempt, decision: RouteDecision, hashes: list[bytes], block_size: int) -> Booking:
        """Counts the routed attempt in the load book, the index's predictions and the stats."""
        facts = self.members.facts
        booking = book_route(self.loads, self.index, decision, hashes, len(attempt.token_ids), block_size,
                             facts.kv_window if facts else 0)
        self.stats["num_local_prefill" if decision.local_prefill else "num_remote_prefill"] += 1
        return booking

    @staticmethod
    def _first_prefilled(progress: Progress, num_cached_tokens: int) -> None:
        if progress.num_sent == 0:  # a later try's prompt includes tokens already sent
            progress.num_cached_tokens = num_cached_tokens
