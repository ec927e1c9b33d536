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
from pathlib import Path

import grpc
import ray
from tokenizers import Tokenizer

from cluster.config import RouterConfig, WorkerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.hashing import BlockHasher
from engine.model_config import ModelConfig
from engine.types import InvalidRequestError
from prefill_worker.worker import PrefillRequest, PrefillResult
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import finish_name_from_pb, finish_to_pb, sampling_from_pb, sampling_to_pb
from router.admission import AdmissionQueue, Refused
from router.attempt import Attempt, Deadline, DecodeStream, Prepared, Progress, RequestFailed, WorkerFailed
from router.kv_index import KVIndex
from router.loads import Booking, LoadBook
from router.policy import RouteDecision, choose_round_robin, choose_route

logger = logging.getLogger(__name__)

PEEK_AFTER_TRANSFER_ERROR_S = 1.0
"""After a failed KV transfer, how long to watch the decode stream for the decode worker's death."""


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
        self._down: dict[str, float] = {}
        """Worker id -> until when (router clock) it gets no new requests."""
        self._turn = 0
        self.stats = {"num_requests": 0, "num_refused": 0, "num_local_prefill": 0, "num_remote_prefill": 0,
                      "num_prompt_tokens": 0, "num_cached_tokens": 0, "num_retries": 0}

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
            detok = IncrementalDetokenizer(self.tokenizer, prep.token_ids, prep.params.stop) if self.tokenizer else None
            async for response in self._attempts(prep, deadline, progress, detok):
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

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        remaining = context.time_remaining()
        return Deadline(None if remaining is None else self.clock() + remaining, self.clock)

    async def _admit(self, prep: Prepared, deadline: Deadline) -> None:
        cost = len(prep.token_ids) + prep.params.max_tokens
        verdict = self.admission.offer(prep.request_id, prep.priority, cost, deadline.at)
        if isinstance(verdict, Refused):
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{verdict.reason}; retry after {verdict.retry_after_s:.1f} s", verdict.retry_after_s)
        if verdict:
            return
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[prep.request_id] = fut
        wait_s = deadline.remaining(self.config.admission.max_queue_wait_s)
        try:
            admitted = await asyncio.wait_for(fut, wait_s)
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

    def down_workers(self) -> list[str]:
        now = self.clock()
        return sorted(w for w in [*self.decode_ids, *self.prefills]
                      if self._down.get(w, 0.0) > now or self.loads.gone(w))

    def _route(self, attempt: Attempt, avoid: set[str]) -> tuple[RouteDecision, list[bytes]]:
        """Workers that failed this request are avoided; ones that are down too, unless no decode
        worker is left otherwise (down is a guess; a prefill worker is never needed)."""
        hashes = self.hasher.hash_prompt(attempt.token_ids, attempt.tenant)
        n, blocks = len(attempt.token_ids), self._blocks_for(len(attempt.token_ids))
        down = set(self.down_workers())
        decode_ids = [w for w in self.decode_ids if w not in avoid]
        decode_ids = [w for w in decode_ids if w not in down] or decode_ids
        if not decode_ids:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "every decode worker failed this request; retry later", 1.0)
        decodes = [self.loads.load(w) for w in decode_ids]
        prefills = [self.loads.load(w) for w in self.prefills if w not in avoid and w not in down]
        if self.config.routing.policy == "round_robin":
            self._turn += 1
            decision = choose_round_robin(self._turn, n, blocks, decodes, prefills, self.config.routing)
        else:
            overlap = self.index.overlap(hashes, [*decode_ids, *(w.worker_id for w in prefills)])
            decision = choose_route(n, blocks, overlap, decodes, prefills, self.config.routing, self.block_size, self.rng)
        if decision is None:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "no decode worker has free KV blocks for this prompt now; retry after 1.0 s", 1.0)
        return decision, hashes

    async def _attempts(self, prep: Prepared, deadline: Deadline, progress: Progress,
                        detok: IncrementalDetokenizer | None) -> AsyncIterator[pb.GenerateResponse]:
        """Runs the request; when a worker fails under it, tries again on others, continuing
        from the tokens already sent (greedy output stays the same)."""
        avoid: set[str] = set()
        for n in range(self.config.max_attempts):
            try:
                async for response in self._run(prep, prep.attempt(n, progress.token_ids), deadline, progress, detok, avoid):
                    yield response
                return
            except WorkerFailed as e:
                avoid.add(e.worker_id)
                if e.down:
                    self._down[e.worker_id] = self.clock() + self.config.worker_down_s
                if n + 1 == self.config.max_attempts:
                    raise
                self.stats["num_retries"] += 1
                logger.warning("request %s: %s; trying again (%d tokens sent so far)",
                               prep.request_id, e.message, progress.num_sent)

    async def _run(self, prep: Prepared, attempt: Attempt, deadline: Deadline, progress: Progress,
                   detok: IncrementalDetokenizer | None, avoid: set[str]) -> AsyncIterator[pb.GenerateResponse]:
        decision, hashes = self._route(attempt, avoid)
        progress.routed = progress.routed or time.perf_counter()
        progress.route = _route_pb(decision)
        booking = self._book(attempt, decision, hashes)
        d, p = booking.decode, booking.prefill
        call = self._stubs[d].Decode(pb.DecodeRequest(
            request_id=attempt.worker_request_id, prompt_token_ids=attempt.token_ids,
            sampling=sampling_to_pb(attempt.params, keep_stop_strings=False), priority=attempt.priority,
            tenant=attempt.tenant, local_prefill=p is None))
        abort_prefill = p is not None
        try:
            stream = DecodeStream(call, d, deadline, self.config.prefill_timeout_s, self.config.decode_idle_timeout_s)
            if p is not None:
                first = await self._remote_prefill(attempt, p, stream, deadline)
                abort_prefill = False
                booking.prefilled()
                response, done = self._first_token_response(prep, progress, detok, first)
                yield response
                if done:
                    yield self._final(prep, progress, response.finish_reason)
                    return
            async for response in self._decode_tokens(prep, progress, detok, stream, booking):
                yield response
        except WorkerFailed as e:
            if e.worker_id == p and e.down:
                abort_prefill = False  # nothing left there to abort
            for w in (d, p) if p is not None else (d,):  # a retry must not be routed on blocks that never landed
                self.index.retract(w, hashes)
            raise
        finally:
            call.cancel()
            if abort_prefill:
                self.prefills[p].abort.remote(attempt.worker_request_id)  # type: ignore[attr-defined, index]
            booking.end()

    async def _decode_tokens(self, prep: Prepared, progress: Progress, detok: IncrementalDetokenizer | None,
                             stream: DecodeStream, booking: Booking) -> AsyncIterator[pb.GenerateResponse]:
        """The decode worker's tokens to the client, then the final response. After a remote
        prefill D's first event repeats the first token, which came from P."""
        repeats_first = booking.prefill is not None
        while True:
            ev = await stream.next_tokens()
            token_ids, logprobs = list(ev.token_ids), list(ev.logprobs)
            if repeats_first:
                repeats_first = False
                progress.transfer_window_ms = ev.transfer_ms
                token_ids, logprobs = token_ids[1:], logprobs[1:]
            elif booking.prefilling:  # a local prefill's first token
                booking.prefilled()
                self._first_prefilled(prep, progress, ev.num_cached_tokens)
            response, done = self._tokens_response(prep, progress, detok, token_ids, logprobs,
                                                   finish_name_from_pb(ev.finish_reason))
            if response.token_ids or done:
                yield response
            if done:
                yield self._final(prep, progress, response.finish_reason)
                return

    def _first_token_response(self, prep: Prepared, progress: Progress, detok: IncrementalDetokenizer | None,
                              first: PrefillResult) -> tuple[pb.GenerateResponse, bool]:
        self._first_prefilled(prep, progress, first.num_cached_tokens)
        progress.transfer_ms = first.transfer_s * 1e3
        return self._tokens_response(prep, progress, detok, [first.first_token_id],  # type: ignore[list-item]
                                     list(first.logprobs), first.finish_reason)

    def _book(self, attempt: Attempt, decision: RouteDecision, hashes: list[bytes]) -> Booking:
        """Counts the routed attempt in the load book, the index's predictions and the stats."""
        d, p = decision.decode_worker, decision.prefill_worker
        cached_blocks = decision.num_decode_cached_blocks if p is None else decision.num_prefill_cached_blocks
        num_tokens = len(attempt.token_ids)
        booking = self.loads.book(d, p, num_tokens - cached_blocks * self.block_size, self._blocks_for(num_tokens))
        self.index.predict(d, hashes)
        if p is not None:
            self.index.predict(p, hashes)
        self.stats["num_local_prefill" if p is None else "num_remote_prefill"] += 1
        return booking

    def _first_prefilled(self, prep: Prepared, progress: Progress, num_cached_tokens: int) -> None:
        if progress.num_sent == 0:  # a later try's prompt includes tokens already sent
            progress.num_cached_tokens = min(num_cached_tokens, len(prep.token_ids))

    async def _remote_prefill(self, attempt: Attempt, p: str, stream: DecodeStream,
                              deadline: Deadline) -> PrefillResult:
        reserved = await stream.reserved()
        ref = self.prefills[p].prefill.remote(PrefillRequest(  # type: ignore[attr-defined]
            attempt.worker_request_id, attempt.token_ids, attempt.params, reserved.ticket, attempt.priority,
            attempt.tenant))
        cap_s = self.config.prefill_timeout_s
        try:
            result: PrefillResult = await asyncio.wait_for(asyncio.wrap_future(ref.future()), deadline.remaining(cap_s))
        except TimeoutError:
            deadline.remaining(cap_s)  # raises when it was the request's own deadline
            raise WorkerFailed(p, grpc.StatusCode.UNAVAILABLE,
                               f"prefill worker {p} did not return the first token in {cap_s:.0f} s", down=True) from None
        except ray.exceptions.RayError as e:
            raise WorkerFailed(p, grpc.StatusCode.UNAVAILABLE, f"prefill worker {p} failed: {type(e).__name__}",
                               down=True) from None
        if result.error is None:
            return result
        if result.invalid:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"prefill on {p} failed: {result.error}")
        await stream.raise_if_failed(PEEK_AFTER_TRANSFER_ERROR_S)  # a dead decode worker fails the transfer too
        raise WorkerFailed(p, grpc.StatusCode.UNAVAILABLE, f"prefill on {p} failed: {result.error}", down=False)

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
        progress.token_ids += sent
        done = reason is not None
        if done and detok is not None:
            text += detok.flush()
        response = pb.GenerateResponse(request_id=prep.request_id, token_ids=sent, text=text,
                                       logprobs=logprobs[:len(sent)] if prep.params.logprobs else [],
                                       finish_reason=finish_to_pb(reason))
        if sent and progress.num_sent == len(sent) and progress.route is not None:
            response.route.CopyFrom(progress.route)
        return response, done

    def _final(self, prep: Prepared, progress: Progress, reason: int) -> pb.GenerateResponse:
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
            route=progress.route)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def _route_pb(decision: RouteDecision) -> pb.Route:
    return pb.Route(decode_worker=decision.decode_worker, prefill_worker=decision.prefill_worker or "",
                    local_prefill=decision.local_prefill)
