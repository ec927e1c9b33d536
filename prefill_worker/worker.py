"""PrefillWorker: a prefill worker's engine, KV pusher and `PrefillWorker` gRPC service.

Data flow: the router calls `Prefill(PrefillRequest{ticket})` -> on the engine thread
(`EngineLoop`) the transfer is queued to open on its push lane and the request added
-> chunked prefill; after each chunk `KVPusher` queues the blocks that became full ->
the first token goes back to the router at once (`FirstToken`) while the lane pushes
the rest and sends `ready` -> `PushDone` comes back through the engine thread, which
releases the blocks, and the call ends with `KVPushed` (or ABORTED when the transfer
failed). A request that ends at its first token (EOS, max_tokens 1) ends the call after
`FirstToken` and its transfer is cancelled. Cancelling the call aborts the request.
Each running request is one `_Prefill` object on the asyncio side. Runs as a Ray actor
(the controller wraps it with `ray.remote`) or in any process with an event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from typing import TYPE_CHECKING

import grpc

from control import tracing
from control.auth import cluster_token, registry_key
from control.heartbeat import ModelFacts
from control.tls import client_context
from control.worker_config import WorkerConfig, on_this_node
from control.worker_host import (HostedWorker, WorkerHost, engine_died, engine_load_reader, latest_load_reader,
                                 next_event, status_for)
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason
from engine.types import InvalidRequestError, RequestId
from kvfabric import SenderConfig
from kvfabric.errors import FabricError
from kvfabric.pools import rank_allocator
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import finish_to_pb, prompt_logprobs_to_pb, sampling_from_pb, ticket_from_pb, top_logprobs_to_pb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from prefill_worker.kv_push import PushDone

logger = logging.getLogger(__name__)


@dataclass
class HandoffTotals:
    """Engine thread: what this worker's finished hand-offs cost, summed (for benchmarks and status)."""

    num_handoffs: int = 0
    num_failed: int = 0
    engine_s: float = 0.0
    """Engine-thread time spent on kvfabric (queueing pushes): what transfers added to steps."""
    fabric_s: float = 0.0
    """Push-lane time in kvfabric calls."""
    tail_s: float = 0.0
    """Push-lane time after the first tokens: the last pushes and `ready` acks."""

    def add(self, done: PushDone) -> None:
        self.num_handoffs += 1
        self.num_failed += done.error is not None
        self.engine_s += done.engine_s
        self.fabric_s += done.fabric_s
        self.tail_s += done.tail_s


@dataclass
class _Prefill:
    """One request on this worker, on the asyncio side: what the engine thread sends it."""

    request_id: str
    events: asyncio.Queue[RequestOutput | PushDone] = field(default_factory=asyncio.Queue)


class PrefillWorker(HostedWorker, pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str, config: WorkerConfig, redis_url: str | None, namespace: str) -> None:
        # torch and the engine load here, in the worker's process: the controller imports this
        # module for the class alone (to create the actor) and runs without them
        import torch

        from engine.engine_loop import EngineLoop, freeze_startup_heap
        from engine.llm_engine import LLMEngine
        from engine.parallel.tp_ranks import TensorRanks
        from kvstore.tier import start_tier
        from prefill_worker.kv_push import KVPusher

        torch.set_num_threads(config.num_threads)
        self.worker_id = worker_id
        self.config = config = on_this_node(config)
        self.ranks = TensorRanks(config.tensor_parallel, rank_allocator(config.device, config.kv_transport)) \
            if config.tensor_parallel > 1 else None
        """The model's other ranks (child processes) when it is split (engine/parallel/tp_ranks.py): each
        pushes its KV heads from its own pool, which this process maps."""
        engine_config = config.engine_config("prefill")
        if self.ranks is not None:
            engine_config = self.ranks.start(engine_config)
        self.engine = LLMEngine(engine_config)
        try:
            self.pusher = KVPusher(self.engine, SenderConfig(
                renew_interval_s=config.kv_lease_s / 4, transport=config.kv_transport,
                token=cluster_token(config.cluster_secret) if config.cluster_secret else None,
                tls=client_context(config.tls)), self._push_ended)
        except BaseException:
            self._stop_ranks()
            raise
        self.engine.handoff = self.pusher
        self.loop = EngineLoop(self.engine, self._on_outputs, self._hook, name=f"engine-{worker_id}",
                               on_death=engine_died(worker_id))
        self.tier = start_tier(self.engine, self.loop.call, config.kv_store, redis_url, namespace,
                               cluster_token(config.cluster_secret) if config.cluster_secret else None, config.tls,
                               config.host,
                               config.advertised_host(redis_url),
                               registry_key(config.cluster_secret) if config.cluster_secret else None,
                               kv_transport=config.kv_transport)
        """This host's shared KV tier (kvstore/tier.py), or None."""
        e = self.engine
        facts = ModelFacts(e.model_id, config.block_size, e.model_config.vocab_size, e.max_model_len,
                           e.connector.memory.num_blocks, e.model_config.kv_window)
        self.host = WorkerHost(worker_id, "prefill", config, facts, engine_load_reader(self.loop), redis_url, namespace,
                               beat_load=latest_load_reader(self.loop))
        if self.host.metrics is not None:
            self.host.metrics.block_bytes = self.pusher.layout.block_bytes
        if self.tier is not None:
            self.host.read_tier = lambda: self.tier.heartbeat() if self.tier else None
            if self.host.metrics is not None:
                self.host.metrics.read_tier = lambda: self.tier.counters if self.tier else None
        self._requests: dict[str, _Prefill] = {}
        """Asyncio side: the running calls."""
        self.totals = HandoffTotals()
        self._aio: asyncio.AbstractEventLoop | None = None
        freeze_startup_heap()

    # -- actor methods ---------------------------------------------------------------------
    def _add_servicer(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def shutdown(self) -> None:
        await self.host.stop()
        self.loop.stop()
        self.pusher.close()
        if self.tier is not None:
            await self.tier.close()
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        """After the engine's thread ended (or never started): its followers are released from here."""
        if self.ranks is not None:
            self.engine.release_followers()
            self.ranks.stop()

    # -- the Prefill stream (on the event loop) ---------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PrefillEvent]:
        rid = request.request_id
        if (refusal := self.host.refusal(rid, self._requests)) is not None:
            await context.abort(*refusal)
        state = self._requests[rid] = _Prefill(rid)
        span = tracing.child("prefill.forward", tracing.extract(context.invocation_metadata()), tracing.SpanKind.SERVER,
                             splitserve__request_id=rid, gen_ai__usage__input_tokens=len(request.prompt_token_ids))
        ended = False
        try:
            try:
                trace = dict(tracing.headers(span)).get("traceparent", "")
                if self.tier is not None:  # the prompt's blocks this host's store holds land in the pool first
                    await self.tier.admit(list(request.prompt_token_ids), request.tenant,
                                          lambda e: self._start(e, request, trace),
                                          request.store if request.HasField("store") else None)
                else:
                    await asyncio.wrap_future(self.loop.call(lambda e: self._start(e, request, trace)))
            except Exception as e:  # noqa: BLE001 - every failure becomes the call's status
                ended = True  # _start cleaned up
                await context.abort(*status_for(e))
            while True:
                item = await next_event(state.events, context, f"request {rid} on {self.worker_id}")
                if isinstance(item, RequestOutput):
                    ended = item.finished and item.finish_reason is not FinishReason.PREFILL_DONE
                    reason = item.finish_reason if ended else None
                    tracing.end(span, splitserve__cached_tokens=item.num_cached_tokens,
                                splitserve__prefill_chunks=item.num_prefill_chunks)
                    yield pb.PrefillEvent(first=pb.FirstToken(
                        token_id=item.new_token_ids[0], logprobs=item.new_logprobs,
                        finish_reason=finish_to_pb(reason), num_cached_tokens=item.num_cached_tokens,
                        top_logprobs=top_logprobs_to_pb(item.new_top_logprobs),
                        prompt_logprobs=prompt_logprobs_to_pb(item.prompt_logprobs),
                        choice_token_ids=[t for t, _ in item.choice_tokens],
                        choice_logprobs=[float(lp) if not isinstance(lp, tuple) else lp[0]
                                         for _, lp in item.choice_tokens if lp is not None]))
                    if ended:
                        return
                else:
                    ended = True
                    self._trace_transfer(span, item)
                    if item.error is not None:
                        await context.abort(*status_for(FabricError(f"request {rid}: {item.error}")))
                    yield pb.PrefillEvent(pushed=pb.KVPushed(push_ms=item.push_s * 1e3, kvfabric_ms=item.fabric_s * 1e3,
                                                             num_pushes=item.num_pushes))
                    return
        finally:
            self._requests.pop(rid, None)
            if span.is_recording():  # ended before its first token
                tracing.end(span, splitserve__error="ended before the first token")
            if not ended:
                self.loop.call(lambda e: self._abort(e, RequestId(rid)))

    def _trace_transfer(self, parent: tracing.Span, done: PushDone) -> None:
        """kvfabric.transfer under prefill.forward, at the push's own times (open to `ready` ack)."""
        if not parent.get_span_context().is_valid:
            return
        now = time.time_ns()
        span = tracing.child("kvfabric.transfer", parent, start_ns=now - int(done.push_s * 1e9),
                             splitserve__transport=done.transport, splitserve__blocks=done.num_blocks,
                             splitserve__bytes=done.num_blocks * self.pusher.layout.block_bytes,
                             splitserve__seconds=done.push_s, splitserve__pushes=done.num_pushes,
                             splitserve__error=done.error)
        tracing.end(span, end_ns=now)

    def _deliver(self, request_id: str, item: RequestOutput | PushDone) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            state.events.put_nowait(item)

    def _send(self, request_id: str, item: RequestOutput | PushDone) -> None:
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self._deliver, request_id, item)

    # -- on the engine thread --------------------------------------------------------------
    def _start(self, engine: LLMEngine, r: pb.PrefillRequest, trace: str = "") -> None:
        ticket = ticket_from_pb(r.ticket)
        if ticket.request_id != r.request_id:
            raise InvalidRequestError(f"the KV ticket is for request {ticket.request_id}, not {r.request_id}")
        params = sampling_from_pb(r.sampling, keep_stop_strings=False)
        self.pusher.attach(ticket, trace)
        try:
            engine.add_request(list(r.prompt_token_ids), params, r.request_id, r.priority, r.tenant,
                               r.tenant_weight or 1.0)
        except BaseException:
            self.pusher.cancel(r.request_id, "refused")  # nothing was computed: no blocks to hold
            raise

    def _abort(self, engine: LLMEngine, request_id: RequestId) -> None:
        """The call ended early: a lane that may still read the blocks keeps them held until its PushDone."""
        self.pusher.cancel(request_id)
        engine.abort(request_id)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and out.finish_reason is not FinishReason.PREFILL_DONE:
                self.pusher.cancel(out.request_id, f"finished at the first token ({out.finish_reason})")
            self._send(out.request_id, out)

    def _push_ended(self, done: PushDone) -> None:
        """Lane thread: the hand-off is over; its blocks are settled on the engine thread."""
        self.loop.call(lambda e: self._settle(e, done))

    def _settle(self, engine: LLMEngine, done: PushDone) -> None:
        self.pusher.settle(done)
        self.totals.add(done)
        if self.host.metrics is not None:
            self.host.metrics.transferred(done.transport, done.num_blocks, done.push_s, failed=done.error is not None)
        self._send(done.request_id, done)

    def _hook(self, wait_s: float) -> bool:
        events = self.engine.take_kv_events()
        if self.tier is not None:  # newly cached blocks offered to this host's store
            self.tier.on_events(self.engine, events)
        self.host.publish_events(events)
        return False

    def _idle_report(self, engine: LLMEngine) -> dict[str, object]:
        usage = engine.check_invariants()
        return {"worker_id": self.worker_id, "usage": asdict(usage), "num_unfinished": engine.scheduler.num_unfinished,
                "num_handed_off": engine.num_handed_off, "num_transfers": self.pusher.num_open,
                "num_streams": len(self._requests), "handoffs": asdict(self.totals)}
