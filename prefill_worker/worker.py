"""PrefillWorker: the Ray actor body of a prefill worker (the controller wraps it with `ray.remote`).

Data flow: the router calls `prefill(request)` with the decode worker's kvfabric
ticket -> on the engine thread (`EngineLoop`) the transfer is opened and the request
added -> chunked prefill; after each chunk `KVPusher` pushes the blocks that became
full -> at the first token the rest is pushed and `ready` sent -> `PushDone` -> the
engine's blocks are released and `prefill()` returns the first token. A request that
ends at its first token (EOS, max_tokens 1) returns that token with its finish reason
and no hand-off. KV events go to Redis through the `Publisher` thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import asdict, dataclass

import msgpack
import torch

from cluster.config import WorkerConfig
from cluster.registry import Heartbeat, Publisher, engine_heartbeat
from engine.engine_loop import EngineLoop, freeze_startup_heap
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import FinishReason, SamplingParams
from engine.types import EngineError, RequestId
from kvfabric import FabricError, SenderConfig, Ticket
from prefill_worker.kv_push import KVPusher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ticket: bytes
    """msgpack of the decode worker's `Ticket.to_wire()`."""
    priority: int = 0
    tenant: str = ""


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int | None = None
    logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    """Set when the request ended here at its first token (no hand-off)."""
    num_cached_tokens: int = 0
    """Prompt tokens this worker served from its prefix cache."""
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    """Engine-thread time spent pushing the KV (every chunk and `ready`): the transfer's
    share of the prefill time."""
    error: str | None = None
    """Why no first token: the transfer failed, the request was aborted or refused."""
    invalid: bool = False
    """The error is the request's fault (INVALID_ARGUMENT), not the cluster's."""


class PrefillWorker:
    def __init__(self, worker_id: str, config: WorkerConfig, redis_url: str | None, namespace: str) -> None:
        torch.set_num_threads(config.num_threads)
        self.worker_id = worker_id
        self.config = config
        self.engine = LLMEngine(config.engine_config("prefill"))
        self.pusher = KVPusher(self.engine, SenderConfig(renew_interval_s=config.kv_lease_s / 4))
        self.engine.handoff = self.pusher
        self._waiters: dict[str, tuple[concurrent.futures.Future[PrefillResult], float]] = {}
        self._cached: dict[str, tuple[int, tuple[float, ...]]] = {}
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self.loop = EngineLoop(self.engine, self._on_outputs, self._hook, name=f"engine-{worker_id}")
        self.publisher = Publisher(redis_url, namespace, worker_id, self._heartbeat,
                                   config.heartbeat_interval_s, config.heartbeat_ttl_s) if redis_url else None
        freeze_startup_heap()
        self.loop.start()
        if self.publisher:
            self.publisher.start()

    # -- actor methods ---------------------------------------------------------------------
    def info(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "role": "prefill", "model_id": self.engine.model_id,
                "num_blocks": self.engine.kv_pool.num_blocks, "block_size": self.config.block_size}

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        try:
            fut = await asyncio.wrap_future(self.loop.call(lambda e: self._start(e, request)))
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            await self.abort(request.request_id)
            raise

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.loop.call(lambda e: self._abort(e, request_id, "aborted")))

    async def check_idle(self) -> dict[str, object]:
        """For tests and drains: pool accounting, and what is still held."""
        return await asyncio.wrap_future(self.loop.call(self._idle_report))

    def shutdown(self) -> None:
        if self.publisher:
            self.publisher.stop()
        self.loop.stop()
        self.pusher.close()

    # -- on the engine thread --------------------------------------------------------------
    def _start(self, engine: LLMEngine, r: PrefillRequest) -> concurrent.futures.Future[PrefillResult]:
        fut: concurrent.futures.Future[PrefillResult] = concurrent.futures.Future()
        try:
            self.pusher.attach(Ticket.from_wire(msgpack.unpackb(r.ticket)))
        except (FabricError, KeyError, TypeError, ValueError) as e:
            fut.set_result(PrefillResult(r.request_id, error=f"cannot open the KV transfer: {e}"))
            return fut
        try:
            engine.add_request(r.prompt_token_ids, r.params, r.request_id, r.priority, r.tenant)
        except EngineError as e:
            self.pusher.abort(r.request_id)  # its PushDone reaches _hook, which finds no waiter
            fut.set_result(PrefillResult(r.request_id, error=str(e), invalid=True))
            return fut
        self._waiters[r.request_id] = (fut, time.perf_counter())
        return fut

    def _abort(self, engine: LLMEngine, request_id: str, reason: str) -> bool:
        self.pusher.abort(request_id)
        found = engine.abort(request_id)
        self._resolve(request_id, PrefillResult(request_id, error=reason))
        return found

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._num_prompt_tokens += out.num_prompt_tokens
            self._num_cached_tokens += out.num_cached_tokens
            self._cached[out.request_id] = (out.num_cached_tokens, tuple(out.new_logprobs))
            if out.finished and out.finish_reason is not FinishReason.PREFILL_DONE:
                self._resolve(out.request_id, PrefillResult(
                    out.request_id, out.new_token_ids[0], tuple(out.new_logprobs),
                    out.finish_reason.value if out.finish_reason else None, out.num_cached_tokens))
                self.pusher.abort(out.request_id)

    def _hook(self, wait_s: float) -> bool:
        done = self.pusher.take_done()
        for d in done:
            rid = RequestId(d.request_id)
            cached, logprobs = self._cached.pop(rid, (0, ()))
            if d.error is None:
                self.engine.release_handoff(rid)
                self._resolve(rid, PrefillResult(rid, d.first_token_id, logprobs, None, cached, transfer_s=d.push_s))
            else:
                self.engine.abort(rid)
                self._resolve(rid, PrefillResult(rid, error=f"KV transfer failed: {d.error}"))
        if self.publisher:
            self.publisher.publish_events(self.engine.take_kv_events())
        return bool(done)

    def _resolve(self, request_id: str, result: PrefillResult) -> None:
        waiter = self._waiters.pop(request_id, None)
        self._cached.pop(request_id, None)
        if waiter is None:
            return
        fut, started = waiter
        if not fut.done():
            fut.set_result(PrefillResult(**{**asdict(result), "prefill_s": time.perf_counter() - started}))

    def _heartbeat(self) -> Heartbeat | None:
        return engine_heartbeat(self.loop, self.worker_id, "prefill", "",
                                lambda: (self._num_prompt_tokens, self._num_cached_tokens))

    def _idle_report(self, engine: LLMEngine) -> dict[str, object]:
        usage = engine.check_invariants()
        return {"worker_id": self.worker_id, "usage": asdict(usage), "num_unfinished": engine.scheduler.num_unfinished,
                "num_handed_off": engine.num_handed_off, "num_transfers": self.pusher.num_open,
                "num_waiters": len(self._waiters)}
