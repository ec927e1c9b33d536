"""Router: the public gRPC `Generate` stream (one per request) over prefill and decode pools.

A request's path through here (ARCHITECTURE.md "The life of a request"):
validate + tokenize (`_prepare`) -> admission (`AdmissionQueue`, may wait or refuse
early with a retry-after hint) -> block hashes + KV index overlap -> `choose_route`
-> open the decode worker's `Decode` stream -> remote prefill: `Reserved{ticket}`
arrives, the prefill actor's `prefill()` returns the first token, which is sent to the
client at once -> tokens from the decode worker, detokenized here (stop strings too)
-> a final response with usage, timing and route. Whatever ends the stream (finish,
stop string, client gone, deadline, error) cancels the decode stream and aborts the
prefill, which frees KV on both workers. Errors map to status codes in `_fail`.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from cluster.config import RouterConfig, WorkerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.hashing import BlockHasher
from engine.model_config import ModelConfig
from engine.request import SamplingParams
from engine.types import InvalidRequestError
from prefill_worker.worker import PrefillRequest, PrefillResult
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import finish_to_pb, sampling_from_pb, sampling_to_pb
from router.admission import AdmissionQueue, Refused
from router.kv_index import KVIndex
from router.loads import LoadBook
from router.policy import RouteDecision, choose_round_robin, choose_route

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """Ends a Generate stream with `code`; `retry_after_s` becomes trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclass
class Prepared:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str


@dataclass
class Progress:
    """One request's counters and clock readings (perf_counter seconds)."""

    arrived: float
    admitted: float = 0.0
    routed: float = 0.0
    first_token: float = 0.0
    transfer_ms: float = 0.0
    transfer_window_ms: float = 0.0
    num_cached_tokens: int = 0
    num_sent: int = 0


class Router(pb_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig, worker: WorkerConfig, prefills: dict[str, object],
                 decodes: dict[str, dict[str, object]], clock=time.monotonic, seed: int | None = None) -> None:  # type: ignore[no-untyped-def]
        """`prefills`: worker id -> Ray actor handle; `decodes`: worker id -> info (address, num_blocks)."""
        self.config = config
        self.clock = clock
        model_dir = Path(worker.model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        tok = model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok)) if tok.is_file() else None
        self.max_model_len = min(worker.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.block_size = worker.block_size
        self.hasher = BlockHasher(worker.cluster_secret, model_dir.resolve().name, worker.block_size)
        self.prefills = prefills
        self.decode_ids = sorted(decodes)
        self.decode_blocks = {w: int(d["num_blocks"]) for w, d in decodes.items()}  # type: ignore[call-overload]
        self._channels = {w: grpc.aio.insecure_channel(str(d["address"])) for w, d in decodes.items()}
        self._stubs = {w: pb_grpc.DecodeWorkerStub(c) for w, c in self._channels.items()}
        self.index = KVIndex(clock)
        self.loads = LoadBook({**self.decode_blocks, **{w: 1 << 30 for w in prefills}})
        self.admission = AdmissionQueue(config.admission, clock)
        self.rng = random.Random(seed)
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._active: set[str] = set()
        self._turn = 0
        self.stats = {"num_requests": 0, "num_refused": 0, "num_local_prefill": 0, "num_remote_prefill": 0,
                      "num_prompt_tokens": 0, "num_cached_tokens": 0}

    # -- the RPC ---------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        progress = Progress(time.perf_counter())
        try:
            prep = self._prepare(request)
            deadline = self._deadline(context)
            await self._admit(prep, deadline)
        except RequestFailed as e:
            self.stats["num_refused"] += 1
            await self._fail(context, e)
        self._active.add(prep.request_id)
        try:
            progress.admitted = time.perf_counter()
            async for response in self._run(prep, deadline, progress):
                yield response
        except RequestFailed as e:
            await self._fail(context, e)
        finally:
            self._active.discard(prep.request_id)
            self._wake(self.admission.release(prep.request_id))

    async def _fail(self, context: grpc.aio.ServicerContext, e: RequestFailed) -> None:
        if e.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
        await context.abort(e.code, e.message)

    # -- before routing ----------------------------------------------------------------------
    def _prepare(self, request: pb.GenerateRequest) -> Prepared:
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._active or rid in self._waiters:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running; use a new id")
        try:
            params = sampling_from_pb(request.sampling)
            token_ids = self._tokenize(request)
        except InvalidRequestError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if t >= vocab]
        if bad:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len} "
                                "tokens, so the prompt must be shorter than that")
        need = self._blocks_for(len(token_ids))
        if need > max(self.decode_blocks.values()):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt needs {need} KV blocks; the largest decode worker holds "
                                f"{max(self.decode_blocks.values())}")
        if params.stop and self.tokenizer is None:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a model with a tokenizer")
        return Prepared(rid, token_ids, params, request.priority, request.tenant)

    def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            ids = list(request.token_ids.ids)
        elif which == "text":
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send the prompt as token_ids")
            ids = self.tokenizer.encode(request.text).ids
        else:
            ids = []
        if not ids:
            raise InvalidRequestError("prompt is empty: send text or token_ids with at least one token")
        return ids

    def _deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else self.clock() + remaining

    def _remaining(self, deadline: float | None, cap_s: float) -> float:
        if deadline is None:
            return cap_s
        left = deadline - self.clock()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return min(left, cap_s)

    async def _admit(self, prep: Prepared, deadline: float | None) -> None:
        cost = len(prep.token_ids) + prep.params.max_tokens
        verdict = self.admission.offer(prep.request_id, prep.priority, cost, deadline)
        if isinstance(verdict, Refused):
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{verdict.reason}; retry after {verdict.retry_after_s:.1f} s", verdict.retry_after_s)
        if verdict:
            return
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[prep.request_id] = fut
        try:
            admitted = await asyncio.wait_for(fut, self._remaining(deadline, self.config.admission.max_queue_wait_s))
        except TimeoutError:
            self.admission.release(prep.request_id)
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed while it waited for admission") from None
        except BaseException:
            self._wake(self.admission.release(prep.request_id))
            raise
        finally:
            self._waiters.pop(prep.request_id, None)
        if not admitted:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "waited too long for admission; retry later",
                                self.config.admission.min_retry_after_s)

    def _wake(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            fut = self._waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(True)
            elif fut is None:  # left already: give its place back
                self._wake(self.admission.release(rid))

    def expire_queued(self) -> None:
        """Called on a timer: queued requests past their max wait are refused."""
        for rid in self.admission.expire():
            fut = self._waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(False)

    # -- routing and the request's streams ---------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-(num_tokens + 1) // self.block_size)

    def _route(self, prep: Prepared) -> tuple[RouteDecision, list[bytes]]:
        hashes = self.hasher.hash_prompt(prep.token_ids, prep.tenant)
        n, blocks = len(prep.token_ids), self._blocks_for(len(prep.token_ids))
        decodes = [self.loads.load(w) for w in self.decode_ids]
        prefills = [self.loads.load(w) for w in self.prefills]
        if self.config.routing.policy == "round_robin":
            self._turn += 1
            decision = choose_round_robin(self._turn, n, blocks, decodes, prefills, self.config.routing)
        else:
            overlap = self.index.overlap(hashes, [*self.decode_ids, *self.prefills])
            decision = choose_route(n, blocks, overlap, decodes, prefills, self.config.routing, self.block_size, self.rng)
        if decision is None:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "no decode worker has free KV blocks for this prompt now; retry after 1.0 s", 1.0)
        return decision, hashes

    async def _run(self, prep: Prepared, deadline: float | None, progress: Progress) -> AsyncIterator[pb.GenerateResponse]:
        decision, hashes = self._route(prep)
        progress.routed = time.perf_counter()
        d, p = decision.decode_worker, decision.prefill_worker
        uncached_d = len(prep.token_ids) - decision.num_decode_cached_blocks * self.block_size
        uncached_p = len(prep.token_ids) - decision.num_prefill_cached_blocks * self.block_size
        blocks = self._blocks_for(len(prep.token_ids))
        self.loads.start(d, uncached_d if p is None else 0, blocks)
        if p is not None:
            self.loads.start(p, uncached_p, 0)
        self.index.predict(d, hashes)
        if p is not None:
            self.index.predict(p, hashes)
        self.stats["num_local_prefill" if p is None else "num_remote_prefill"] += 1
        detok = IncrementalDetokenizer(self.tokenizer, prep.token_ids, prep.params.stop) if self.tokenizer else None
        call = self._stubs[d].Decode(pb.DecodeRequest(
            request_id=prep.request_id, prompt_token_ids=prep.token_ids,
            sampling=sampling_to_pb(prep.params, keep_stop_strings=False), priority=prep.priority,
            tenant=prep.tenant, local_prefill=p is None))
        prefill_open = p is not None
        try:
            stream = _DecodeStream(call, self, deadline)
            if p is not None:
                first = await self._remote_prefill(prep, p, stream, deadline)
                prefill_open = False
                self.loads.prefilled(p, uncached_p)
                progress.num_cached_tokens = first.num_cached_tokens
                progress.transfer_ms = first.transfer_s * 1e3
                response, done = self._tokens_response(prep, progress, detok, [first.first_token_id],  # type: ignore[list-item]
                                                       list(first.logprobs), first.finish_reason)
                yield response
                if done:
                    yield self._final(prep, progress, decision, response.finish_reason)
                    return
            first_from_p = p is not None
            while True:
                ev = await stream.next_tokens()
                token_ids, logprobs = list(ev.token_ids), list(ev.logprobs)
                if first_from_p:  # D's first event repeats the first token, which came from P
                    first_from_p = False
                    progress.transfer_window_ms = ev.transfer_ms
                    token_ids, logprobs = token_ids[1:], logprobs[1:]
                elif p is None and progress.num_sent == 0:
                    progress.num_cached_tokens = ev.num_cached_tokens
                    self.loads.prefilled(d, uncached_d)
                reason = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                          pb.FINISH_REASON_ABORT: "abort"}.get(ev.finish_reason)
                response, done = self._tokens_response(prep, progress, detok, token_ids, logprobs, reason)
                if response.token_ids or done:
                    yield response
                if done:
                    yield self._final(prep, progress, decision, response.finish_reason)
                    return
        finally:
            call.cancel()
            if prefill_open:
                self.loads.prefilled(p, uncached_p)  # type: ignore[arg-type]
                self.prefills[p].abort.remote(prep.request_id)  # type: ignore[attr-defined, index]
            if p is None and progress.num_sent == 0:
                self.loads.prefilled(d, uncached_d)
            self.loads.end(d, blocks)
            if p is not None:
                self.loads.end(p, 0)

    async def _remote_prefill(self, prep: Prepared, p: str, stream: _DecodeStream, deadline: float | None) -> PrefillResult:
        reserved = await stream.reserved()
        ref = self.prefills[p].prefill.remote(PrefillRequest(  # type: ignore[attr-defined]
            prep.request_id, prep.token_ids, prep.params, reserved.ticket, prep.priority, prep.tenant))
        try:
            result: PrefillResult = await asyncio.wait_for(
                asyncio.wrap_future(ref.future()), self._remaining(deadline, self.config.prefill_timeout_s))
        except TimeoutError:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"prefill worker {p} did not return the first token in time") from None
        if result.error is not None:
            code = grpc.StatusCode.INVALID_ARGUMENT if result.invalid else grpc.StatusCode.UNAVAILABLE
            raise RequestFailed(code, f"prefill on {p} failed: {result.error}")
        return result

    def _tokens_response(self, prep: Prepared, progress: Progress, detok: IncrementalDetokenizer | None,
                         token_ids: list[int], logprobs: list[float], reason: str | None) -> tuple[pb.GenerateResponse, bool]:
        if progress.num_sent == 0 and token_ids:
            progress.first_token = time.perf_counter()
        text, sent = "", []
        for t in token_ids:
            sent.append(t)
            if detok is not None:
                delta, stopped = detok.append(t)
                text += delta
                if stopped:
                    reason = "stop"
                    break
        progress.num_sent += len(sent)
        done = reason is not None
        if done and detok is not None:
            text += detok.flush()
        response = pb.GenerateResponse(request_id=prep.request_id, token_ids=sent, text=text,
                                       logprobs=logprobs[:len(sent)] if prep.params.logprobs else [],
                                       finish_reason=finish_to_pb(reason))
        return response, done

    def _final(self, prep: Prepared, progress: Progress, decision: RouteDecision, reason: int) -> pb.GenerateResponse:
        self.stats["num_requests"] += 1
        self.stats["num_prompt_tokens"] += len(prep.token_ids)
        self.stats["num_cached_tokens"] += progress.num_cached_tokens
        ms = 1e3
        return pb.GenerateResponse(
            request_id=prep.request_id, finish_reason=reason,
            usage=pb.Usage(prompt_tokens=len(prep.token_ids), cached_tokens=progress.num_cached_tokens,
                           completion_tokens=progress.num_sent),
            timing=pb.Timing(queue_ms=(progress.admitted - progress.arrived) * ms,
                             prefill_ms=(progress.first_token - progress.routed) * ms,
                             transfer_ms=progress.transfer_ms, transfer_window_ms=progress.transfer_window_ms,
                             ttft_ms=(progress.first_token - progress.arrived) * ms),
            route=pb.Route(decode_worker=decision.decode_worker, prefill_worker=decision.prefill_worker or "",
                           local_prefill=decision.local_prefill))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class _DecodeStream:
    """Reads one Decode call with a timeout per message; maps its errors to RequestFailed."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, router: Router, deadline: float | None) -> None:
        self.call, self.router, self.deadline = call, router, deadline

    async def _read(self, cap_s: float) -> pb.DecodeEvent:
        try:
            ev = await asyncio.wait_for(self.call.read(), self.router._remaining(self.deadline, cap_s))
        except TimeoutError:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the decode worker sent nothing in time") from None
        except grpc.aio.AioRpcError as e:
            code = e.code()
            passthrough = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.DEADLINE_EXCEEDED}
            retry = 1.0 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            raise RequestFailed(code if code in passthrough else grpc.StatusCode.UNAVAILABLE,
                                f"decode worker: {e.details()}", retry) from None
        if ev is grpc.aio.EOF:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the decode worker ended the stream early")
        return ev

    async def reserved(self) -> pb.Reserved:
        ev = await self._read(self.router.config.prefill_timeout_s)
        if not ev.HasField("reserved"):
            raise RequestFailed(grpc.StatusCode.INTERNAL, "decode worker: expected a reservation first")
        return ev.reserved

    async def next_tokens(self) -> pb.Tokens:
        ev = await self._read(self.router.config.decode_idle_timeout_s)
        if not ev.HasField("tokens"):
            raise RequestFailed(grpc.StatusCode.INTERNAL, "decode worker: expected tokens")
        return ev.tokens

