"""DecodeWorker: a decode worker's engine, KV receiver and `DecodeWorker` gRPC service.

Data flow: the router opens `Decode(DecodeRequest)` -> remote prefill: blocks are
reserved under a kvfabric lease (`RemoteKV.reserve`) and the first event is
`Reserved{ticket}`; local prefill: the request joins the engine at once -> the engine
thread (`EngineLoop`) pumps kvfabric events (`Landed` admits the request with the
first token from the prefill worker: the stream says `Arrived`, and tokens follow from
the second on, since the router already sent the first) and steps the continuous batch
-> each step's outputs go to the request's `_Decode` object on the event loop ->
`Tokens` events to the router. Cancelling the stream (client gone, deadline, router
abort) aborts the request and frees its blocks (or quarantines them until a one-sided
writer is fenced). The KV pool comes from `kvfabric.pools.kv_allocator` (shared memory
on CPU, IPC-exportable device memory on GPU), so same-host prefill workers copy straight
into it; with the cluster's transport nixl, private huge pages on CPU, which NIXL writes.
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
from control.tls import server_context
from control.worker_config import WorkerConfig, on_this_node
from control.worker_host import (HostedWorker, NoRoom, NotHere, WorkerHost, engine_died, engine_load_reader,
                                 latest_load_reader, next_event, status_for)
from decode_worker.kv_receive import Landed, RemoteFailure, RemoteKV
from engine.core.outputs import RequestOutput
from engine.step_profile import profile_decode
from engine.types import RequestId, parent_of
from kvfabric import ReceiverConfig
from kvfabric.errors import FabricError
from kvfabric.pools import kv_allocator, offers_nixl, rank_allocator
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import finish_to_pb, prompt_logprobs_to_pb, sampling_from_pb, ticket_to_pb, top_logprobs_to_pb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

Item = RequestOutput | Landed | RemoteFailure


@dataclass
class _Decode:
    """One request on this worker, on the asyncio side: what the engine thread sends it (its
    n choices' outputs too, engine/core/forks.py)."""

    request_id: str
    n: int = 1
    events: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    done: set[int] = field(default_factory=set)
    """Choices finished."""

    @property
    def finished(self) -> bool:
        return len(self.done) == self.n


class DecodeWorker(HostedWorker, pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str, config: WorkerConfig, redis_url: str | None, namespace: str) -> None:
        # torch and the engine load here, in the worker's process: the controller imports this
        # module for the class alone (to create the actor) and runs without them
        import torch

        from engine.engine_loop import EngineLoop, freeze_startup_heap
        from engine.llm_engine import LLMEngine
        from engine.parallel.tp_ranks import TensorRanks
        from kvstore.tier import start_tier

        torch.set_num_threads(config.num_threads)
        self.worker_id = worker_id
        self.config = config = on_this_node(config)
        self.allocator = kv_allocator(config.device, config.kv_transport)
        self.ranks = TensorRanks(config.tensor_parallel, rank_allocator(config.device, config.kv_transport)) \
            if config.tensor_parallel > 1 else None
        """The model's other ranks (child processes) when it is split (engine/parallel/tp_ranks.py)."""
        engine_config = config.engine_config("decode")
        if self.ranks is not None:
            engine_config = self.ranks.start(engine_config)
        self.engine = LLMEngine(engine_config, allocator=self.allocator)
        profile = profile_decode(self.engine, config.step_profile_s) if config.step_profile_s > 0 else ()
        self.remote = RemoteKV(self.engine, self.allocator, ReceiverConfig(
            host=config.host, advertise_host=config.advertised_host(redis_url), lease_s=config.kv_lease_s,
            token=cluster_token(config.cluster_secret) if config.cluster_secret else None,
            tls=server_context(config.tls), nixl=offers_nixl(config.device, config.kv_transport)))
        self.loop = EngineLoop(self.engine, self._on_outputs, self._hook, name=f"engine-{worker_id}",
                               on_death=engine_died(worker_id))
        self.tier = start_tier(self.engine, self.loop.call, config.kv_store, redis_url, namespace,
                               self.remote.receiver.config.token, config.tls, config.host,
                               config.advertised_host(redis_url),
                               registry_key(config.cluster_secret) if config.cluster_secret else None,
                               kv_transport=config.kv_transport)
        """This host's shared KV tier (kvstore/tier.py), or None."""
        e = self.engine
        facts = ModelFacts(e.model_id, config.block_size, e.model_config.vocab_size, e.max_model_len,
                           e.connector.memory.num_blocks, e.model_config.kv_window)
        self.host = WorkerHost(worker_id, "decode", config, facts, engine_load_reader(self.loop), redis_url, namespace,
                               beat_load=latest_load_reader(self.loop))
        self.host.read_step_model = lambda: self.engine.step_model.latest  # a tuple swapped whole: read from here
        self.host.step_profile = profile
        if self.tier is not None:
            self.host.read_tier = lambda: self.tier.heartbeat() if self.tier else None
            if self.host.metrics is not None:
                self.host.metrics.read_tier = lambda: self.tier.counters if self.tier else None
        if self.host.metrics is not None:
            self.host.metrics.read_reservations = self.remote.receiver.num_reservations
        self._requests: dict[str, _Decode] = {}
        """Asyncio side: the running calls."""
        self._aio: asyncio.AbstractEventLoop | None = None
        freeze_startup_heap()

    # -- actor methods ---------------------------------------------------------------------
    def _add_servicer(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def shutdown(self) -> None:
        await self.host.stop()
        self.loop.stop()
        if self.ranks is not None:  # the engine's thread has ended: its followers are released from here
            self.engine.release_followers()
            self.ranks.stop()
        if self.tier is not None:
            await self.tier.close()
        self.remote.close()
        self.allocator.close()

    # -- the Decode stream (on the event loop) ---------------------------------------------
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        if (refusal := self.host.refusal(rid, self._requests)) is not None:
            await context.abort(*refusal)
        if self.remote.refusal is not None and not request.local_prefill:
            await context.abort(*status_for(NotHere(f"{self.worker_id} takes no pushed KV: {self.remote.refusal}")))
        state = self._requests[rid] = _Decode(rid, max(request.sampling.n, 1))
        parent = tracing.extract(context.invocation_metadata())
        span = tracing.child("decode.stream", parent, tracing.SpanKind.SERVER, splitserve__request_id=rid) \
            if request.local_prefill else tracing.NO_SPAN  # remote: it starts when the KV and first token land
        out: RequestOutput | None = None
        num_out = 0
        try:
            reserved = await self._admit(request, context)
            if reserved is not None:
                yield pb.DecodeEvent(reserved=reserved)
            while not state.finished:
                item = await self._next(state, context)
                if isinstance(item, Landed):
                    self._trace_arrival(rid, item)
                    span = tracing.child("decode.stream", parent, tracing.SpanKind.SERVER, splitserve__request_id=rid,
                                         splitserve__transfer_window_ms=item.transfer_window_s * 1e3)
                out = item.output if isinstance(item, Landed) else item
                num_out += len(out.new_token_ids)
                for event in self._events(rid, item):
                    yield event
        finally:
            self._requests.pop(rid, None)
            tracing.end(span, gen_ai__usage__output_tokens=num_out,
                        splitserve__preemptions=out.num_preemptions if out else None,
                        gen_ai__response__finish_reasons=[out.finish_reason.value] if out and out.finish_reason else None)
            if not state.finished:
                self.loop.call(lambda e: self._abort(rid))

    @staticmethod
    def _trace_arrival(rid: str, landed: Landed) -> None:
        """kvfabric.receive: the transfer window on this side, under the sender's span (the
        trace context came in the kvfabric `open`, not in this call's metadata)."""
        if not landed.trace:
            return
        now = time.time_ns()
        span = tracing.child("kvfabric.receive", tracing.extract([("traceparent", landed.trace)]),
                             tracing.SpanKind.CONSUMER, start_ns=now - int(landed.transfer_window_s * 1e9),
                             splitserve__request_id=rid, splitserve__seconds=landed.transfer_window_s)
        tracing.end(span, end_ns=now)

    async def _next(self, state: _Decode, context: grpc.aio.ServicerContext) -> Item:
        item = await next_event(state.events, context, f"request {state.request_id} on {self.worker_id}")
        if isinstance(item, RemoteFailure):
            state.done = set(range(state.n))  # the engine already ended it
            await context.abort(*status_for(FabricError(f"request {state.request_id}: {item.reason}")))
        out = item.output if isinstance(item, Landed) else item
        if out.finished:
            state.done.add(out.choice_index)
        return item

    @staticmethod
    def _events(rid: str, item: Item) -> list[pb.DecodeEvent]:
        if isinstance(item, Landed):  # the first tokens came from the prefill worker: not sent again
            out = item.output
            events = [pb.DecodeEvent(arrived=pb.Arrived(transfer_window_ms=item.transfer_window_s * 1e3))] \
                if out.choice_index == 0 else []
            if out.finished:
                events.append(pb.DecodeEvent(tokens=pb.Tokens(finish_reason=finish_to_pb(out.finish_reason),
                                                              choice=out.choice_index)))
            return events
        assert isinstance(item, RequestOutput)
        return [pb.DecodeEvent(tokens=pb.Tokens(
            token_ids=item.new_token_ids, logprobs=item.new_logprobs, finish_reason=finish_to_pb(item.finish_reason),
            num_cached_tokens=item.num_cached_tokens, top_logprobs=top_logprobs_to_pb(item.new_top_logprobs),
            prompt_logprobs=prompt_logprobs_to_pb(item.prompt_logprobs), choice=item.choice_index))]

    async def _admit(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.Reserved | None:
        rid = request.request_id
        try:
            params = sampling_from_pb(request.sampling, keep_stop_strings=False)
            prompt = list(request.prompt_token_ids)
            weight = request.tenant_weight or 1.0
            if request.local_prefill:
                def add(e: LLMEngine) -> object:
                    return e.add_request(prompt, params, rid, request.priority, request.tenant, weight)
                if self.tier is not None:  # the prompt's blocks this host's store holds land in the pool first
                    await self.tier.admit(prompt, request.tenant, add,
                                          request.store if request.HasField("store") else None)
                else:
                    await asyncio.wrap_future(self.loop.call(add))
                return None
            ticket = await asyncio.wrap_future(self.loop.call(
                lambda e: self.remote.reserve(prompt, params, rid, request.priority, request.tenant, weight)))
        except Exception as e:  # noqa: BLE001 - every failure becomes the call's status
            await context.abort(*status_for(e))
        if ticket is None:
            await context.abort(*status_for(NoRoom(f"{self.worker_id} has no free KV blocks for a {len(prompt)}-token "
                                                   "prompt now")))
        return pb.Reserved(ticket=ticket_to_pb(ticket),
                           num_cached_tokens=ticket.num_skip_blocks * self.config.block_size)

    def _deliver(self, items: list[Item]) -> None:
        for item in items:
            rid = item.output.request_id if isinstance(item, Landed) else item.request_id
            state = self._requests.get(rid) or self._requests.get(parent_of(rid)[0])
            if state is not None:
                state.events.put_nowait(item)

    # -- on the engine thread --------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._send(list(outputs))
        self._kv_events()

    def _hook(self, wait_s: float) -> bool:
        items = self.remote.pump(wait_s)
        if items:
            self._send(items)
        self._kv_events()
        return bool(items)

    def _kv_events(self) -> None:
        """The pool's changes to the routers' index, and its newly cached blocks to the tier."""
        events = self.engine.take_kv_events()
        if self.tier is not None:
            self.tier.on_events(self.engine, events)
        self.host.publish_events(events)

    def _send(self, items: list[Item]) -> None:
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self._deliver, items)

    def _abort(self, request_id: str) -> None:
        self.remote.abort(RequestId(request_id))

    def _idle_report(self, engine: LLMEngine) -> dict[str, object]:
        usage = engine.check_invariants()
        return {"worker_id": self.worker_id, "usage": asdict(usage), "num_unfinished": engine.scheduler.num_unfinished,
                "num_handed_off": engine.num_handed_off, "held_blocks": len(self.remote.receiver.held_block_ids()),
                "num_reservations": len(self.remote.receiver.table), "num_streams": len(self._requests),
                "num_preemptions": engine.scheduler.num_preemptions}
