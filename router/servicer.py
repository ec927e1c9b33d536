"""Generation: the public `Generate` stream, a thin servicer over the router's parts.

proto in -> `ask_from_pb` (the router's one form, `Ask`; the HTTP door builds its own) ->
`Frontend.prepare` (validate, tokenize) -> `AdmissionGate.admit` (may wait, or refuse early
with a retry-after hint) -> `RequestFlow.run` (workers, retries) -> `Reply`s ->
`reply_to_pb` -> proto out. A `RequestFailed` from any of them ends the stream with its status
code and message (and `retry-after-ms` trailing metadata when it has a hint); the
client going away cancels the flow, which cancels its worker calls.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from engine.core.request import FinishReason
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from control import tracing
from router.api_keys import ApiKeys, Unauthenticated, authorization
from router.attempt import CUT_OFF, Ask, Deadline, Prepared, Progress, RequestFailed
from router.flow import RequestFlow
from router.choices import Choices
from router.frontend import Frontend, ItlWindow, ask_from_pb, output_tokens, runs_to_the_end, slow_to_prepare
from router.admission import admission_cost
from router.gate import AdmissionGate
from router.metrics import RouterMetrics
from router.reply import Reply, reply_to_pb
from router.off_loop import OffLoop
from router.members import Members


SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name

logger = logging.getLogger(__name__)
ABORT, ERROR = FinishReason.ABORT.value, "error"
"""`request_success_total`'s reasons for an admitted request that did not finish: its client
went away, or it failed (both vLLM's labels)."""


class Generation(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, gate: AdmissionGate, flow: RequestFlow, members: Members,
                 clock: Callable[[], float] = time.monotonic, metrics: RouterMetrics | None = None,
                 api_keys: ApiKeys | None = None, default_timeout_s: float | None = None) -> None:
        self.frontend, self.gate, self.flow, self.members, self.clock = frontend, gate, flow, members, clock
        self.metrics = metrics
        self.off_loop = OffLoop()
        """Where long requests are prepared (tokenized, their constraints checked), bounded."""
        self.default_timeout_s = default_timeout_s
        """The deadline of a request whose caller gives none (an HTTP request, a gRPC call without one)."""
        self.api_keys = api_keys
        """The keys a gRPC `Generate` call shows, checked here (`KeyCheck` checks other methods'),
        with the tenant a key names, which replaces the request's."""
        self._named: set[tuple[str, str]] = set()
        """(tenant, the client's request_id) of the requests running or queued that the client
        named: a second one of the same name from the same tenant is refused. Another tenant's
        names are neither visible nor in the way (the workers know requests by the router's ids)."""
        self.itl = ItlWindow(on_gap=metrics.observe_itl if metrics else None)
        self.stats = {"num_requests": 0, "num_refused": 0, "num_invalid": 0, "num_prompt_tokens": 0,
                      "num_cached_tokens": 0}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers `Generate` taking the request's raw bytes, so a request that is not a valid
        `GenerateRequest` (bad wire bytes, invalid UTF-8 in a string) is the caller's fault,
        INVALID_ARGUMENT, rather than grpc's deserialization failure (INTERNAL)."""
        handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
            self.GenerateRaw, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    async def GenerateRaw(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            request = pb.GenerateRequest.FromString(raw)
        except DecodeError as e:
            self.stats["num_invalid"] += 1
            refused("", "", "generate", grpc.StatusCode.INVALID_ARGUMENT)
            await _fail(context, RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                               f"the request is not a valid {SERVICE}.Generate request ({e}); "
                                               "string fields must be UTF-8"))
        async with contextlib.aclosing(self.Generate(request, context)) as responses:
            async for response in responses:
                yield response

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if self.api_keys is not None:
                try:
                    who = self.api_keys.check(authorization(context.invocation_metadata()))
                except Unauthenticated as e:
                    refused(request.request_id, "", "generate", grpc.StatusCode.UNAUTHENTICATED)
                    raise RequestFailed(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
                if who.tenant is not None:
                    request.tenant = who.tenant
            try:
                ask = ask_from_pb(request)
            except RequestFailed:
                self.stats["num_invalid"] += 1
                refused(request.request_id, request.tenant, "generate", grpc.StatusCode.INVALID_ARGUMENT)
                raise
            async with contextlib.aclosing(self.stream(ask, context.invocation_metadata(),
                                                       context.time_remaining())) as replies:
                async for reply in replies:
                    yield reply_to_pb(reply)
        except RequestFailed as e:
            await _fail(context, e)

    async def stream(self, ask: Ask, trace_metadata: Iterable[tuple[str, Any]] | None,
                     timeout_s: float | None) -> AsyncIterator[Reply]:
        """One request, whatever door it came in by (gRPC here, OpenAI HTTP in router/http_api.py):
        its replies, or RequestFailed with the status it ends with. `trace_metadata` carries the
        caller's `traceparent`; `timeout_s` is its deadline from now (None: the router's default,
        `default_timeout_s`)."""
        if timeout_s is None:
            timeout_s = self.default_timeout_s
        progress = Progress(time.perf_counter(), span=tracing.child(
            "router.generate", tracing.extract(trace_metadata), tracing.SpanKind.SERVER))
        try:  # closed, it closes what it reads at once (not when collected): its end is logged as it was
            async with contextlib.aclosing(self._generate(ask, progress, timeout_s)) as replies:
                async for reply in replies:
                    yield reply
        except RequestFailed as e:
            progress.status = e.code.value[0]
            raise
        except asyncio.CancelledError:  # the client went away (or the router stops)
            progress.status = grpc.StatusCode.CANCELLED.value[0]
            raise
        finally:
            self._end_trace(progress)
            access(ask.client_id, ask.tenant, ask.route, progress)

    async def _generate(self, ask: Ask, progress: Progress, timeout_s: float | None
                        ) -> AsyncIterator[Reply]:
        name = (ask.tenant, ask.client_id)
        if ask.client_id and name in self._named:
            self.stats["num_invalid"] += 1
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request id {ask.client_id!r} is already running; "
                                "use a new id")
        if ask.client_id:
            self._named.add(name)
        try:
            async with contextlib.aclosing(self._serve(ask, progress, timeout_s)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            if ask.client_id:
                self._named.discard(name)

    async def _serve(self, ask: Ask, progress: Progress, timeout_s: float | None) -> AsyncIterator[Reply]:
        try:
            prep = progress.prep = await self.prepare(ask)
        except RequestFailed as e:
            self.stats["num_invalid" if e.code == grpc.StatusCode.INVALID_ARGUMENT else "num_refused"] += 1
            raise
        try:
            deadline = Deadline(None if timeout_s is None else self.clock() + timeout_s, self.clock)
            admit = tracing.child("router.admit", progress.span)
            prep, cost = await self._admit(prep, deadline)
            tracing.end(admit, splitserve__cost_tokens=cost)
        except RequestFailed as e:
            tracing.end(admit, splitserve__refused=e.message)
            self.stats["num_refused"] += 1
            raise
        ended = 0  # choices whose last reply was sent
        try:
            progress.admitted = time.perf_counter()
            out = Choices(prep, progress, [self.frontend.detokenizer(prep) for _ in range(prep.params.n)], self.itl)
            observed = False
            async with contextlib.aclosing(self.flow.run(prep, deadline, progress, out)) as replies:
                async for reply in replies:
                    self.gate.progress(prep.request_id, progress.num_sent)
                    if not observed and progress.first_token:
                        observed = True
                        self.gate.observe_ttft(progress.first_token - progress.admitted, cost)
                    progress.finish_reason = reply.finish_reason or progress.finish_reason
                    ended += reply.last
                    yield reply
            self._ended(prep, progress)
        except GeneratorExit:  # the HTTP door closed the stream: after its last reply, or as its client left
            if ended == prep.params.n:
                self._ended(prep, progress)
            else:
                progress.status = grpc.StatusCode.CANCELLED.value[0]
                self._count(prep, progress, ABORT)
            raise
        except RequestFailed:  # admitted, then failed (workers gone past the retries, its deadline, ...)
            self._count(prep, progress, ERROR)
            raise
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is None or task.cancelling():
                self._count(prep, progress, ABORT)
                raise  # the client went away, or the server is stopping
            # a cancellation from below (a bug): the client gets a status now, not silence until its deadline
            logger.exception("request %s: cancelled inside the router", prep.request_id)
            self._count(prep, progress, ERROR)
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, CUT_OFF, 1.0) from None
        finally:
            self.gate.release(prep.request_id)

    @staticmethod
    def _end_trace(progress: Progress) -> None:
        """router.generate's attributes (OpenTelemetry GenAI names where one fits) and its end."""
        if not progress.span.is_recording():  # tracing off: nothing to build
            return
        prep, route = progress.prep, progress.route
        tracing.end(progress.span, splitserve__request_id=prep.request_id if prep else None,
                    splitserve__client_request_id=prep.client_id or None if prep else None,
                    splitserve__tenant=prep.tenant if prep else None, splitserve__priority=prep.priority if prep else None,
                    gen_ai__usage__input_tokens=len(prep.token_ids) if prep else None,
                    gen_ai__usage__output_tokens=progress.num_sent, splitserve__cached_tokens=progress.num_cached_tokens,
                    splitserve__decode_worker=route.decode_worker if route else None,
                    splitserve__prefill_worker=(route.prefill_worker or "local") if route else None,
                    gen_ai__response__finish_reasons=[reason.value if (reason := progress.finish_reason) else "none"],
                    rpc__grpc__status_code=progress.status)

    async def _admit(self, prep: Prepared, deadline: Deadline) -> tuple[Prepared, int]:
        """Waits for admission (or raises RequestFailed); returns the request as the workers get
        it (with its tenant's weight, for the engines' fair order) and its cost."""
        facts = self.members.facts
        max_model_len, held = (facts.max_model_len, facts.max_held_tokens) if facts else (1 << 30, None)
        limit = output_tokens(prep, max_model_len)
        output = self.gate.queue.expected_output(prep.tenant, prep.route, limit, known=runs_to_the_end(prep))
        # refused whatever part of the prompt is cached? then without hashing it
        n, output = len(prep.token_ids), output * prep.params.n  # n choices: n outputs, one prompt
        self.gate.refuse_early(prep, deadline, admission_cost(n, output, n - 1, held), admission_cost(n, output, 0, held))
        cost = admission_cost(n, output, self.flow.cached_tokens(prep), held)
        await self.gate.admit(prep, deadline, cost, output, limit)
        return dataclasses.replace(prep, tenant_weight=self.gate.queue.weight(prep.tenant)), cost

    async def prepare(self, ask: Ask) -> Prepared:
        """`Frontend.prepare`, off the event loop where it may take long."""
        prepare = functools.partial(self.frontend.prepare, ask, self.members.facts, self.members.max_decode_blocks())
        return await self.off_loop.run(prepare) if slow_to_prepare(ask) else prepare()

    def _ended(self, prep: Prepared, progress: Progress) -> None:
        """An admitted request sent its every last reply."""
        if progress.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and not runs_to_the_end(prep):
            self.gate.ended(prep, progress.num_sent)  # a length it chose: a sample of what is expected
        self._count(prep, progress)

    def _count(self, prep: Prepared, progress: Progress, reason: str | None = None) -> None:
        """An admitted request's numbers as it ends: `reason` where given (`ABORT` for one whose
        client went away, `ERROR` for one that failed: vLLM's `request_success_total` labels),
        else its last reply's finish reason."""
        reason = reason or (progress.finish_reason.value if progress.finish_reason else None)
        self.stats["num_requests"] += 1
        self.stats["num_prompt_tokens"] += len(prep.token_ids)
        self.stats["num_cached_tokens"] += progress.num_cached_tokens
        if self.metrics is not None:
            self.metrics.finished(
                queue_s=progress.admitted - progress.arrived, e2e_s=time.perf_counter() - progress.arrived,
                ttft_s=progress.first_token - progress.arrived if progress.first_token else None,
                num_prompt=len(prep.token_ids), num_output=progress.num_sent, num_cached=progress.num_cached_tokens,
                reason=reason or "unknown")


access_log = logging.getLogger("splitserve.access")
"""One line per request as it ends (who, what, how it ended); its own logger, to route or silence."""


def access(client_id: str, tenant: str, route: str, progress: Progress) -> None:
    prep = progress.prep
    access_log.info("request %s client_id=%r tenant=%r route=%s status=%d prompt=%d output=%d cached=%d %.3fs",
                    prep.request_id if prep else "-", client_id[:128], tenant[:128], route,
                    progress.status, len(prep.token_ids) if prep else 0, progress.num_sent, progress.num_cached_tokens,
                    time.perf_counter() - progress.arrived)


def refused(client_id: str, tenant: str, route: str, code: grpc.StatusCode, arrived: float | None = None) -> None:
    """The access line of a request refused at the door, before it had a request id."""
    at = time.perf_counter() if arrived is None else arrived
    access(client_id, tenant, route, Progress(at, status=code.value[0]))


async def _fail(context: grpc.aio.ServicerContext, e: RequestFailed) -> None:
    if e.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    await context.abort(e.code, e.message)
