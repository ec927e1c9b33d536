"""DecodeWorker: the Ray actor body of a decode worker, serving the internal DecodeWorker gRPC stream.

Data flow: the router opens `Decode(DecodeRequest)` -> remote prefill: blocks are
reserved under a kvfabric lease (`RemoteKV.reserve`) and the first event is
`Reserved{ticket}`; local prefill: the request joins the engine at once -> the engine
thread (`EngineLoop`) pumps kvfabric events (`KVArrived` admits the request with the
first token from the prefill worker) and steps the continuous batch -> each step's
outputs go to the request's asyncio queue on the actor's event loop -> `Tokens` events
to the router. Cancelling the stream (client gone, deadline, router abort) aborts the
request and frees its blocks (or quarantines them until a one-sided writer is fenced).
The KV pool is a shared-memory segment (`ShmKVAllocator`) so same-host prefill
workers copy straight into it; others use tcp.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
import msgpack
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.config import WorkerConfig
from cluster.registry import Heartbeat, Publisher, engine_heartbeat
from decode_worker.kv_receive import RemoteFailure, RemoteKV
from engine.engine_loop import EngineLoop, freeze_startup_heap
from engine.llm_engine import LLMEngine, RequestOutput
from engine.types import EngineError, InvalidRequestError
from kvfabric import ReceiverConfig, ShmKVAllocator
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import finish_to_pb, sampling_from_pb

logger = logging.getLogger(__name__)

STREAM_IDLE_TIMEOUT_S = 120.0
"""Longest a Decode stream waits for its next tokens (the KV lease bounds the wait for arrival)."""


class DecodeWorker(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str, config: WorkerConfig, redis_url: str | None, namespace: str) -> None:
        torch.set_num_threads(config.num_threads)
        self.worker_id = worker_id
        self.config = config
        self.allocator = ShmKVAllocator()
        self.engine = LLMEngine(config.engine_config("decode"), allocator=self.allocator)
        self.remote = RemoteKV(self.engine, self.allocator, ReceiverConfig(host=config.host, lease_s=config.kv_lease_s))
        self.loop = EngineLoop(self.engine, self._on_outputs, self._hook, name=f"engine-{worker_id}")
        self.publisher = Publisher(redis_url, namespace, worker_id, self._heartbeat,
                                   config.heartbeat_interval_s, config.heartbeat_ttl_s) if redis_url else None
        self._streams: dict[str, asyncio.Queue[RequestOutput | RemoteFailure]] = {}
        self._transfer_s: dict[str, float] = {}
        self._aio: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self.address = ""
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._seen: set[str] = set()
        """Engine thread: requests whose first output was counted in the prefix-hit statistics."""
        freeze_startup_heap()

    # -- actor methods ---------------------------------------------------------------------
    async def start(self) -> dict[str, object]:
        """Starts the gRPC server and the engine thread; returns this worker's info."""
        self._aio = asyncio.get_running_loop()
        self._server = grpc.aio.server()
        pb_grpc.add_DecodeWorkerServicer_to_server(self, self._server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        port = self._server.add_insecure_port(f"{self.config.host}:0")
        await self._server.start()
        await health_servicer.set("splitserve.v1.DecodeWorker", health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{self.config.host}:{port}"
        self.loop.start()
        if self.publisher:
            self.publisher.start()
        return self.info()

    def info(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "role": "decode", "address": self.address,
                "model_id": self.engine.model_id, "num_blocks": self.engine.kv_pool.num_blocks,
                "block_size": self.config.block_size}

    async def check_idle(self) -> dict[str, object]:
        return await asyncio.wrap_future(self.loop.call(self._idle_report))

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.publisher:
            self.publisher.stop()
        self.loop.stop()
        self.remote.close()
        if self.allocator.segment is not None:
            self.allocator.segment.close()

    # -- the Decode stream (on the actor's event loop) -------------------------------------
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        if not rid or rid in self._streams:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or already running here")
        queue: asyncio.Queue[RequestOutput | RemoteFailure] = asyncio.Queue()
        self._streams[rid] = queue
        finished = False
        try:
            reserved = await self._admit(request, context)
            if reserved is not None:
                yield pb.DecodeEvent(reserved=reserved)
            while not finished:
                try:
                    item = await asyncio.wait_for(queue.get(), STREAM_IDLE_TIMEOUT_S)
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"request {rid}: no tokens for {STREAM_IDLE_TIMEOUT_S:.0f} s on {self.worker_id}")
                if isinstance(item, RemoteFailure):
                    finished = True  # the engine already ended it
                    await context.abort(grpc.StatusCode.ABORTED, f"request {rid}: KV transfer failed: {item.reason}")
                finished = item.finished
                yield pb.DecodeEvent(tokens=pb.Tokens(
                    token_ids=item.new_token_ids, logprobs=item.new_logprobs,
                    finish_reason=finish_to_pb(item.finish_reason), num_cached_tokens=item.num_cached_tokens,
                    transfer_ms=self._transfer_s.pop(rid, 0.0) * 1e3))
        finally:
            self._streams.pop(rid, None)
            self._transfer_s.pop(rid, None)
            if not finished:
                self.loop.call(lambda e: self._abort(rid))

    async def _admit(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.Reserved | None:
        rid = request.request_id
        try:
            params = sampling_from_pb(request.sampling, keep_stop_strings=False)
            prompt = list(request.prompt_token_ids)
            if request.local_prefill:
                await asyncio.wrap_future(self.loop.call(
                    lambda e: e.add_request(prompt, params, rid, request.priority, request.tenant)))
                return None
            ticket = await asyncio.wrap_future(self.loop.call(
                lambda e: self.remote.reserve(prompt, params, rid, request.priority, request.tenant)))
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"{self.worker_id}: {e}")
        if ticket is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.worker_id} has no free KV blocks for a {len(prompt)}-token prompt now")
        return pb.Reserved(ticket=msgpack.packb(ticket.to_wire()), num_cached_tokens=ticket.num_skip_blocks * self.config.block_size)

    def _deliver(self, items: list[RequestOutput | RemoteFailure], transfer_s: dict[str, float]) -> None:
        self._transfer_s.update(transfer_s)
        for item in items:
            q = self._streams.get(item.request_id)
            if q is not None:
                q.put_nowait(item)

    # -- on the engine thread --------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._send(list(outputs))
        if self.publisher:
            self.publisher.publish_events(self.engine.take_kv_events())

    def _hook(self, wait_s: float) -> bool:
        items = self.remote.pump(wait_s)
        if items:
            self._send(items)
        if self.publisher:
            self.publisher.publish_events(self.engine.take_kv_events())
        return bool(items)

    def _send(self, items: list[RequestOutput | RemoteFailure]) -> None:
        transfer_s = {}
        for item in items:
            if isinstance(item, RequestOutput):
                rid = item.request_id
                t = self.remote.transfer_s.pop(rid, None)
                if t is not None:
                    transfer_s[rid] = t
                if rid not in self._seen:
                    self._seen.add(rid)
                    self._num_prompt_tokens += item.num_prompt_tokens
                    self._num_cached_tokens += item.num_cached_tokens
                if item.finished:
                    self._seen.discard(rid)
            else:
                self._seen.discard(item.request_id)
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self._deliver, items, transfer_s)

    def _abort(self, request_id: str) -> None:
        self.remote.abort(request_id)
        self._seen.discard(request_id)

    def _heartbeat(self) -> Heartbeat | None:
        return engine_heartbeat(self.loop, self.worker_id, "decode", self.address,
                                lambda: (self._num_prompt_tokens, self._num_cached_tokens))

    def _idle_report(self, engine: LLMEngine) -> dict[str, object]:
        usage = engine.check_invariants()
        return {"worker_id": self.worker_id, "usage": asdict(usage), "num_unfinished": engine.scheduler.num_unfinished,
                "num_handed_off": engine.num_handed_off, "held_blocks": len(self.remote.receiver.held_block_ids()),
                "num_streams": len(self._streams)}
