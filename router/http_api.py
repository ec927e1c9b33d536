"""The OpenAI-compatible HTTP API of a router replica, on the router's own event loop.

    HTTP request --(aiohttp, same loop as grpc.aio)--> body (size-capped) --(openai_protocol)-->
    Ask --(Generation.stream: frontend -> gate -> flow, as for gRPC)-->
    responses --> one JSON body, or server-sent events ending with `data: [DONE]`

aiohttp (not uvicorn): its `AppRunner` serves on the running loop with no signal handlers of
its own and no second loop, so grpc.aio's channels and this server share one loop and one
thread; `handler_cancellation` cancels a request's handler when its client disconnects,
which cancels the request's worker calls exactly as a gRPC cancel does. Errors use OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, with the status the gRPC code
maps to (`HTTP_STATUS`) and a `Retry-After` header when the router has a retry hint. This
module imports no torch. The agent APIs (OpenAI's Responses, Anthropic's Messages) are its
routes too, written in router/agent_routes.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

import grpc
from aiohttp import web

from engine.checkpoints.quant_config import served_name
from engine.types import InvalidRequestError
from router.attempt import CUT_OFF, Ask, RequestFailed
from router.constraints import AutoToolOutput, ToolCallOutput, constraint_of, tool_plan
from router.http_guard import ANTHROPIC_PATHS, HttpGuard, identity
from router.config import HttpDeadlines
from router.http_connections import BodyReader, ConnectionGuard
from router.off_loop import OffLoop
from router.request_limits import RequestLimits
from router.http_errors import DONE, ERROR_TYPES, HTTP_STATUS, SSE_HEADERS, dumps, error, failed, grpc_status, sse
from router.frontend import (MAX_TEXT_CHARS_PER_TOKEN, NOT_SERVING, OFF_LOOP_CHARS, Frontend, check_vocabulary,
                             serving_facts)
from router.members import Members
from router.openai_output import Output, best, merged, new_id, sum_usage
from router.openai_protocol import (BadRequest, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                    ask_of, messages_as_dicts, parse, prompt_end, prompts_of, sampling_of)
from router.servicer import Generation, refused
from router.reasoning import ReasoningParser
from router.agent_routes import AgentRoutes, NotFound
from router.messages_api import anthropic_error
from router.response_store import ResponseStore
from router.reasoning import parser_for_template as reasoning_for_template
from router.tool_parsers import parser_for_template

logger = logging.getLogger(__name__)

TOKENIZE_MAX_MODEL_LEN = 1 << 17
"""/tokenize before any worker reported the model's context: the text limit as for this context."""
OFF_LOOP_TOKENS = 4096
"""/detokenize of more tokens than this runs off the event loop."""
GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "responses",
                     "/v1/messages": "messages"}
"""The POST paths that generate, by the route name their access lines carry."""
FLOWED = web.RequestKey("flowed", bool)
"""Set on an HTTP request once it is handed to the flow, which writes its access line."""


class ModelNotFound(Exception):
    """A request names a model this server does not serve (404)."""


class OpenAIServer(AgentRoutes):
    """The HTTP routes of one router replica; `start` serves them on the running loop."""

    def __init__(self, generation: Generation, frontend: Frontend, members: Members,
                 served_model_name: str | None, max_request_bytes: int, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, guard: HttpGuard | None = None,
                 limits: RequestLimits | None = None, deadlines: HttpDeadlines | None = None,
                 off_loop: OffLoop | None = None, store: ResponseStore | None = None) -> None:
        self.generation, self.frontend, self.members = generation, frontend, members
        self.store = store
        """Where the Responses API keeps stored responses (None: it stores none)."""
        source = frontend.chat_template.source if frontend.chat_template else None
        self.thinking_switch = source is not None and "enable_thinking" in source
        self.tool_call_parser = tool_call_parser or parser_for_template(source)
        """Reads `tool_choice: "auto"` calls out of the model's text (None: auto is refused)."""
        name = reasoning_parser or reasoning_for_template(source)
        self.reasoning = ReasoningParser(name) if name and name != "none" else None
        """Splits a thinking model's reasoning from its chat answers (None: no split)."""
        self.limits = limits or RequestLimits()
        self.off_loop = off_loop or OffLoop()
        """Where long prompts and conversations are rendered and tokenized (the gRPC door's pool)."""
        self.deadlines = deadlines or HttpDeadlines()
        d = self.deadlines
        self.connections = ConnectionGuard(d.max_connections, d.max_idle_connections, d.header_timeout_s)
        self.bodies = BodyReader(max_request_bytes, d.max_body_bytes_in_flight, d.body_timeout_s,
                                 d.max_body_bytes_per_client)
        self.served_model_name = served_model_name
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        guard = guard or HttpGuard()
        app = web.Application(client_max_size=max_request_bytes,
                              middlewares=[self._refusals_logged, self._anthropic_errors, self.connections.middleware,
                                           guard.middleware, self._errors])
        app.add_routes([web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                        web.post("/v1/responses", self.responses), web.post("/v1/messages", self.messages),
                        web.post("/v1/messages/count_tokens", self.count_tokens),
                        web.get("/v1/responses/{response_id}", self.stored_response),
                        web.delete("/v1/responses/{response_id}", self.delete_response),
                        web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model),
                        web.get("/health", self.health),
                        web.get("/version", self.version), web.post("/tokenize", self.tokenize),
                        web.post("/detokenize", self.detokenize)])
        self.app = app

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        """Serves on host:port (0: a free port) and returns the port."""
        runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True, access_log=None)
        await runner.setup()
        self.connections.install(runner.server)
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=1024)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise RuntimeError(f"cannot serve HTTP on {host}:{port} ({e.strerror}): another server? pick another "
                               "with --http-port") from None
        self._runner = runner
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def model_name(self) -> str | None:
        facts = self.members.facts
        return self.served_model_name or (served_name(facts.model_id) if facts else None)

    @web.middleware
    async def _refusals_logged(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A generation request refused before it reached the flow (its key, the connection guard,
        its body, its fields, its model) gets its access line here; one that reached the flow gets
        the flow's (`Generation.stream`)."""
        arrived = time.perf_counter()
        response = await handler(request)
        route = GENERATION_ROUTES.get(request.path) if request.method == "POST" else None
        if route is not None and response.status >= 400 and not request.get(FLOWED):
            who = identity(request)
            tenant = who.tenant if who is not None and who.tenant is not None else ""
            refused("", tenant, route, grpc_status(response.status), arrived)
        return response

    @web.middleware
    async def _anthropic_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """/v1/messages and /v1/messages/count_tokens answer their errors, whoever refused (key,
        connections, body, handler), in Anthropic's shape, with the same status and headers."""
        response = await handler(request)
        if request.path not in ANTHROPIC_PATHS or response.status < 400 or not isinstance(response, web.Response) \
                or response.content_type != "application/json" or not isinstance(response.body, bytes):
            return response
        try:
            message = json.loads(response.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return response
        converted = web.json_response(anthropic_error(response.status, message), status=response.status, dumps=dumps)
        for name in ("Retry-After", "WWW-Authenticate"):
            if name in response.headers:
                converted.headers[name] = response.headers[name]
        return converted

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error in OpenAI's shape: aiohttp's own (404 path, 405, 413) too; 500 only for our bugs."""
        try:
            return await handler(request)
        except BadRequest as e:
            return error(400, e.message, e.param)
        except RequestFailed as e:
            return failed(e)
        except ModelNotFound as e:
            return error(404, str(e), "model", "model_not_found")
        except NotFound as e:
            return error(404, e.message, e.param, "not_found")
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"the request body is larger than {self.max_request_bytes} bytes", code="request_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = error(e.status, f"{request.method} {request.path}: {e.reason}")
            if e.status == 408:  # the rest of the body is not waited for: the connection ends with the answer
                response.force_close()
            return response
        except Exception:  # a bug of ours: logged, and still an answer in OpenAI's shape
            logger.exception("%s %s failed", request.method, request.path)
            return error(500, "internal error in the router (logged); retry", code="internal")

    # -- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(CompletionRequest, self._prescanned(await self.bodies.read(request)))
        model = self._check_model(req.model)
        rid = new_id("completion", req.request_id)
        prompts = prompts_of(req.prompt)
        params = sampling_of(req, None, constraint_of(req))  # once, whatever the prompts
        parts = []
        choices = max(req.n, req.best_of or 1)  # best_of: that many drawn, the n likeliest returned
        for i, prompt in enumerate(prompts):
            prompt_ids, text = None, None
            if req.echo or req.prompt_logprobs is not None:  # the prompt's tokens are returned: tokenized here
                prompt_ids, text = await self._prompt(prompt)
            request_id = (req.request_id or rid) + (f"-{i}" if len(prompts) > 1 else "")
            ask = ask_of(req, request_id, prompt_ids if prompt_ids is not None else prompt, params, "completion")
            parts.append((ask, [Output(
                "completion", rid, model, req.logprobs is not None, self._token_text,
                return_token_ids=req.return_token_ids, prompt_ids=prompt_ids, echo=text if req.echo else None,
                hide=req.echo and req.max_tokens == 0, prompt_logprobs=req.prompt_logprobs, num_top=req.logprobs or 0,
                index=i * req.n + c) for c in range(choices)]))  # OpenAI's order: each prompt's n choices
        return await self._run(request, req.stream, req.stream_options, parts, keep=req.n if choices > req.n else None)

    async def _prompt(self, prompt: str | list[int]) -> tuple[list[int], str]:
        """A completion prompt's token ids and text (a long one tokenized off the event loop)."""
        try:
            if isinstance(prompt, str):
                encode = functools.partial(self.frontend.encode, prompt)
                ids = await self.off_loop.run(encode) if len(prompt) > OFF_LOOP_CHARS else encode()
                return ids, prompt
            return prompt, self.frontend.decode(prompt)
        except InvalidRequestError as e:
            raise BadRequest(str(e), "prompt") from None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = self._prescanned(await self.bodies.read(request))
        req = parse(ChatRequest, body)
        ask, outs = await self._chat_part(req, len(body))
        return await self._run(request, req.stream, req.stream_options, [(ask, outs)])

    async def _chat_part(self, req: ChatRequest, body_chars: int) -> tuple[Ask, list[Output]]:
        """A chat request's `Ask` (its conversation rendered and tokenized, off the loop when
        long) and the outputs its choices fill; the Responses API's requests come here too."""
        self.limits.check(req)
        model = self._check_model(req.model)
        facts = serving_facts(self.members.facts)
        messages = messages_as_dicts(req.messages)
        constraint, plan = constraint_of(req), tool_plan(req, self.tool_call_parser)
        if constraint is not None and plan is not None and plan.mode != "none":
            raise BadRequest("tool calls and a response_format or structured_outputs both shape the output; send "
                             "one (or tool_choice \"none\")", "tool_choice")
        kwargs = {"tools": req.tools, **(req.chat_template_kwargs or {})} if plan else req.chat_template_kwargs
        generation_prompt, continue_final = prompt_end(req)
        render = functools.partial(self.frontend.chat_token_ids, messages, facts.max_model_len,
                                   generation_prompt, kwargs, continue_final)
        try:  # a long request (all it holds: messages, names, tools, kwargs) renders and tokenizes off the loop
            prompt_ids = await self.off_loop.run(render) if body_chars > OFF_LOOP_CHARS else render()
        except InvalidRequestError as e:
            raise BadRequest(str(e), "messages") from None
        # no max_tokens: as long as the context and the largest decode worker allow (vLLM's default;
        # a model that slides a window on every layer holds only that window, whatever its length)
        pool = self.members.max_decode_blocks() * facts.block_size if not facts.kv_window else facts.max_model_len
        room = min(facts.max_model_len, pool) - len(prompt_ids) - 1
        rid = new_id("chat", req.request_id)
        params = sampling_of(req, max(room, 1), plan.constraint if plan and plan.constraint else constraint)
        constrained = params.constraint is not None
        fields: dict[str, Any] = {"return_token_ids": req.return_token_ids,
                                  "reasoning": None if constrained else self.reasoning,
                                  "prompt_ids": prompt_ids if req.prompt_logprobs is not None else None,
                                  "prompt_logprobs": req.prompt_logprobs}
        markers = [*(fields["reasoning"].special_tokens if fields["reasoning"] else ()),
                   *(plan.parser.special_tokens if plan and plan.parser else ())]
        if self.frontend.special_tokens.intersection(markers):  # the parsers read them: the text keeps them
            params = dataclasses.replace(params, skip_special_tokens=False)
        if plan is not None and plan.mode == "auto":
            kind, fields = AutoToolOutput, {**fields, "plan": plan}
        elif plan is not None and plan.constraint is not None:
            kind, fields = ToolCallOutput, {**fields, "plan": plan}
        else:
            kind = Output
        outs = [kind("chat", rid, model, req.logprobs, self._token_text, index=c, **fields) for c in range(req.n)]
        return ask_of(req, req.request_id or rid, prompt_ids, params, "chat"), outs

    async def _run(self, request: web.Request, stream: bool, options: Any, parts: list[tuple[Ask, list[Output]]],
                   keep: int | None = None) -> web.StreamResponse:
        """Runs each part, a request with its choices' outputs (a completion's several prompts,
        each of n choices), at once: one JSON body, or one event stream interleaving them; a
        response goes to its part's output of its `choice`."""
        streams = [self._stream_of(request, ask) for ask, _ in parts]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
            for f in firsts:  # a refusal before the first token is an HTTP error
                if isinstance(f, RequestFailed):
                    return failed(f)
                if isinstance(f, StopAsyncIteration):
                    return failed(RequestFailed(grpc.StatusCode.INTERNAL, "the request ended without a response"))
                if isinstance(f, BaseException):
                    raise f
            routed = [part for _, part in parts]
            if not stream:
                return await self._whole(streams, firsts, routed, keep)
            return await self._stream(request, streams, firsts, routed, bool(options and options.include_usage))
        finally:
            for s in streams:
                await s.aclose()

    def _stream_of(self, request: web.Request, ask: Ask) -> AsyncIterator[Any]:
        """`Generation.stream` of `ask` under the HTTP request's identity (an API key's tenant,
        whatever the body says) and headers (for tracing; never the key)."""
        headers = [(k.lower(), v) for k, v in request.headers.items() if k.lower() != "authorization"]
        request[FLOWED] = True  # its access line is the flow's
        who = identity(request)
        if who is not None and who.tenant is not None:
            ask = dataclasses.replace(ask, tenant=who.tenant)
        return self.generation.stream(ask, headers, None)

    async def _whole(self, streams: list[AsyncIterator[Any]], firsts: list[Any], routed: list[list[Output]],
                     keep: int | None = None) -> web.Response:
        async def collect(responses: AsyncIterator[Any], first: Any, part: list[Output]) -> None:
            part[first.choice].add(first)
            async for r in responses:
                part[r.choice].add(r)

        try:
            await asyncio.gather(*(collect(s, f, p) for s, f, p in zip(streams, firsts, routed, strict=True)))
        except RequestFailed as e:
            return failed(e)
        outs = [o for part in routed for o in part]
        if keep is not None:  # best_of: each part's `keep` likeliest choices (usage still counts them all)
            return web.json_response(merged(best(routed, keep), usage_of=outs), dumps=dumps)
        return web.json_response(outs[0].whole() if len(outs) == 1 else merged(outs), dumps=dumps)

    async def _stream(self, request: web.Request, streams: list[AsyncIterator[Any]], firsts: list[Any],
                      routed: list[list[Output]], include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        started: set[int] = set()

        async def pump(i: int, responses: AsyncIterator[Any]) -> None:
            try:
                async for r in responses:
                    await queue.put((i, r))
            except Exception as e:  # noqa: BLE001 - a RequestFailed, or a fault below: the client is told
                queue.put_nowait((i, e))
            except asyncio.CancelledError:  # cancelled from below (this stream's own end cancels no pump it reads)
                queue.put_nowait((i, RequestFailed(grpc.StatusCode.UNAVAILABLE, CUT_OFF)))
                raise
            finally:
                queue.put_nowait((i, None))  # however it ends, the stream below is done

        for i, first in enumerate(firsts):
            queue.put_nowait((i, first))
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            running = len(streams)
            while running:
                i, r = await queue.get()
                if r is None:
                    running -= 1
                    continue
                if isinstance(r, BaseException):
                    raise r
                out = routed[i][r.choice]
                out.add(r)
                if (chunk := out.chunk(r, id(out) not in started)) is not None:
                    await resp.write(sse(chunk))
                    started.add(id(out))
            if include_usage:
                outs = [o for part in routed for o in part]
                usage = outs[0].chunk(None)
                if len(outs) > 1:
                    usage["usage"] = sum_usage([o.usage for o in outs if o.usage is not None])
                await resp.write(sse(usage))
        except ConnectionResetError:  # the client went away: closing the streams cancels the requests
            return resp
        except Exception as e:  # noqa: BLE001 - mid-stream: an error event, then [DONE], whatever failed
            if not isinstance(e, RequestFailed):  # a fault of ours (a conversion, a bug below): logged
                logger.exception("%s %s failed mid-stream", request.method, request.path)
                e = RequestFailed(grpc.StatusCode.INTERNAL, "internal error in the router (logged); retry")
            status = HTTP_STATUS.get(e.code, 500)
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse({"error": {"message": e.message, "type": ERROR_TYPES.get(status, "internal_error"),
                                                 "param": None, "code": status}}))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(DONE)
            await resp.write_eof()
        return resp

    # -- the rest ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = self._model_card()
        return web.json_response({"object": "list", "data": [] if card is None else [card]}, dumps=dumps)

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`)."""
        card, asked = self._model_card(), request.match_info["model"]
        if card is None or card["id"] != asked:
            raise ModelNotFound(f"the model {asked[:200]!r} does not exist; this server serves "
                                f"{repr(card['id']) if card else 'none yet'}")
        return web.json_response(card, dumps=dumps)

    def _model_card(self) -> dict[str, Any] | None:
        name, facts = self.model_name, self.members.facts
        return None if name is None else {
            "id": name, "object": "model", "created": self.created, "owned_by": "splitserve",
            "root": served_name(facts.model_id) if facts else name, "parent": None,
            "max_model_len": facts.max_model_len if facts else None}

    async def health(self, request: web.Request) -> web.Response:
        if self.members.facts is None or not self.members.serving("decode"):
            return error(503, NOT_SERVING, code="unavailable")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()}, dumps=dumps)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = self._prescanned(await self.bodies.read(request))
        req = parse(TokenizeRequest, body)
        self.limits.check(req)
        self._check_model(req.model)
        facts = self.members.facts  # the tokenizer is the router's own: no worker needed
        max_model_len = facts.max_model_len if facts else TOKENIZE_MAX_MODEL_LEN
        if req.messages is not None:
            if req.add_special_tokens:
                raise BadRequest("add_special_tokens with messages: the chat template adds them", "add_special_tokens")
            messages = messages_as_dicts(req.messages)
            num_chars = len(body)  # all it renders
            generation_prompt, continue_final = prompt_end(req)
            work = functools.partial(self.frontend.chat_token_ids, messages, max_model_len, generation_prompt, None,
                                     continue_final)
        elif req.prompt is not None:
            num_chars = len(req.prompt)
            if num_chars > MAX_TEXT_CHARS_PER_TOKEN * max_model_len:
                raise BadRequest(f"prompt has {num_chars} characters; the model's context is {max_model_len} "
                                 "tokens", "prompt")
            work = functools.partial(self.frontend.encode, req.prompt, req.add_special_tokens is not False)
        else:
            raise BadRequest("send 'prompt' or 'messages'", "prompt")
        try:  # as the generation endpoints do: long text off the event loop
            ids = await self.off_loop.run(work) if num_chars > OFF_LOOP_CHARS else work()
        except InvalidRequestError as e:
            raise BadRequest(str(e)) from None
        return web.json_response({"count": len(ids), "max_model_len": facts.max_model_len if facts else None,
                                  "tokens": ids}, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse(DetokenizeRequest, self._prescanned(await self.bodies.read(request)))  # tokens: at most the context
        self._check_model(req.model)
        try:
            check_vocabulary(req.tokens, self.members.facts.vocab_size if self.members.facts else 1 << 32)
            decode = functools.partial(self.frontend.decode, req.tokens)
            text = await self.off_loop.run(decode) if len(req.tokens) > OFF_LOOP_TOKENS else decode()
        except InvalidRequestError as e:
            raise BadRequest(str(e), "tokens") from None
        return web.json_response({"prompt": text}, dumps=dumps)

    def _prescanned(self, body: bytes) -> bytes:
        """The body, once its lists and maps are within their limits (router/request_limits.py)."""
        facts = self.members.facts
        self.limits.prescan(body, facts.max_model_len if facts else TOKENIZE_MAX_MODEL_LEN)
        return body

    def _check_model(self, model: str | None) -> str:
        name = self.model_name
        if name is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, NOT_SERVING, 1.0)
        if model is not None and model != name:
            raise ModelNotFound(f"the model '{model}' does not exist; this server serves '{name}'")
        return name

    def _token_text(self, token_id: int) -> str:
        return self.frontend.decode([token_id])


def _version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return "unknown"
