"""The agent APIs' routes of the HTTP door: OpenAI's Responses API (`POST /v1/responses`,
`GET` / `DELETE /v1/responses/{id}`) and Anthropic's Messages API (`POST /v1/messages`, and
`/v1/messages/count_tokens`), each a chat request underneath (router/responses_api.py,
router/messages_api.py) answered whole or as its typed events; stored responses in the
cluster's Redis (router/response_store.py).

A mixin of `OpenAIServer` (router/http_api.py), whose chat machinery it uses: `_chat_part`
(template, tool plan, reasoning parser), `_stream_of` (the request under its key's identity),
`_prescanned`, the body reader. Torch-free.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web

from router.attempt import Ask, RequestFailed
from router.http_errors import HTTP_STATUS, SSE_HEADERS, dumps, failed, sse
from router.http_guard import identity
from router.messages_api import CountTokensRequest, MessageShape, MessagesRequest, anthropic_error
from router.openai_output import Output
from router.openai_protocol import BadRequest, parse
from router.reasoning import END
from router.response_store import ResponseStore, ResponseTooLarge, StoredResponse, StoreUnavailable
from router.responses_api import ResponseShape, ResponsesRequest

if TYPE_CHECKING:
    from router.frontend import Frontend
    from router.http_connections import BodyReader
    from router.openai_protocol import ChatRequest
    from router.reasoning import ReasoningParser

logger = logging.getLogger(__name__)

UNREACHABLE = "the response store (the cluster's Redis) cannot be reached; retry"


class NotFound(Exception):
    """A stored object the request names does not exist for its tenant (404)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param



def gone(response_id: str, param: str) -> NotFound:
    """Not found for this tenant, whyever: another tenant's id reads as one never stored."""
    return NotFound(f"no stored response '{response_id}' (never stored, expired, deleted, or another tenant's)", param)


class AgentRoutes:
    """The agent APIs' handlers (see the module's docstring)."""

    store: ResponseStore | None
    frontend: Frontend
    reasoning: ReasoningParser | None
    thinking_switch: bool
    bodies: BodyReader
    model_name: str | None

    if TYPE_CHECKING:  # the chat machinery of OpenAIServer
        def _prescanned(self, body: bytes) -> bytes: ...
        async def _chat_part(self, req: ChatRequest, body_chars: int) -> tuple[Ask, list[Output]]: ...
        def _stream_of(self, request: web.Request, ask: Ask) -> AsyncIterator[Any]: ...

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API over the chat path (router/responses_api.py)."""
        body = self._prescanned(await self.bodies.read(request))
        req = parse(ResponsesRequest, body)
        tenant = self._tenant(request)
        conversation = req.conversation()
        if req.previous_response_id is not None:
            conversation = (await self._stored(tenant, req.previous_response_id, "previous_response_id")).conversation \
                + conversation
        chat = req.as_chat(conversation, self.thinking_switch)
        ask, [out] = await self._chat_part(chat, len(body))
        shape = ResponseShape(req, self.model_name or "", out)

        async def whole() -> dict[str, Any]:
            shape.whole()
            shape.reasoning_tokens = self._reasoning_tokens(out)
            await self._keep(tenant, shape, conversation)
            return shape.response(shape.status())

        async def finish() -> list[dict[str, Any]]:
            events = shape.closing_items()
            shape.reasoning_tokens = self._reasoning_tokens(out)
            await self._keep(tenant, shape, conversation)
            return events + shape.completed()

        return await self._answer(request, dataclasses.replace(ask, route="responses"), out, req.stream, whole,
                                  shape.opening, shape.feed, finish,
                                  lambda e: shape.failed(e.message, e.code.name.lower()))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API over the chat path (router/messages_api.py); its errors are
        put in Anthropic's shape by `_anthropic_errors`."""
        body = self._prescanned(await self.bodies.read(request))
        req = parse(MessagesRequest, body)
        ask, [out] = await self._chat_part(req.as_chat(self.thinking_switch, self.reasoning is not None), len(body))

        def matched() -> str | None:
            """The stop sequence that ended the answer: the text the tokens decode to, past the
            text returned (which the engine cut where a stop string began), starts with it."""
            if not req.stop_sequences or out.finish_reason != "stop":
                return None
            text, full = "".join(out.text), self.frontend.decode(out.token_ids)
            rest = full[len(text):] if full.startswith(text) else ""
            return next((s for s in req.stop_sequences if rest.startswith(s)), None)

        shape = MessageShape(req, self.model_name or "", out, len(ask.prompt), matched)

        async def whole() -> dict[str, Any]:
            return shape.whole()

        async def finish() -> list[dict[str, Any]]:
            return shape.closing()

        return await self._answer(request, dataclasses.replace(ask, route="messages"), out, req.stream, whole,
                                  shape.opening, shape.feed, finish,
                                  lambda e: [anthropic_error(HTTP_STATUS.get(e.code, 500), e.message)])

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's `POST /v1/messages/count_tokens`: the prompt tokens a Messages request of
        these fields would take (rendered and tokenized as the request itself would be)."""
        body = self._prescanned(await self.bodies.read(request))
        req = parse(CountTokensRequest, body)
        ask, _ = await self._chat_part(req.as_chat(self.thinking_switch, self.reasoning is not None), len(body))
        return web.json_response({"input_tokens": len(ask.prompt)}, dumps=dumps)

    async def _answer(self, request: web.Request, ask: Ask, out: Output, stream: bool,
                      whole: Callable[[], Awaitable[dict[str, Any]]], opening: Callable[[], list[dict[str, Any]]],
                      feed: Callable[[dict[str, Any]], list[dict[str, Any]]],
                      finish: Callable[[], Awaitable[list[dict[str, Any]]]],
                      fail: Callable[[RequestFailed], list[dict[str, Any]]]) -> web.StreamResponse:
        """An agent API's answer of one choice: a refusal before the first reply as an HTTP
        error; then `whole()` once every reply is in, or the events (`_item_events`)."""
        replies = self._stream_of(request, ask)
        try:
            try:
                first = await anext(replies)
            except StopAsyncIteration:
                return failed(RequestFailed(grpc.StatusCode.INTERNAL, "the request ended without a response"))
            except RequestFailed as e:
                return failed(e)
            if not stream:
                try:
                    out.add(first)
                    async for r in replies:
                        out.add(r)
                except RequestFailed as e:
                    return failed(e)
                return web.json_response(await whole(), dumps=dumps)
            return await self._item_events(request, out, first, replies, opening(), feed, finish, fail)
        finally:
            await replies.aclose()

    async def _item_events(self, request: web.Request, out: Output, first: Any, replies: AsyncIterator[Any],
                           opening: list[dict[str, Any]], feed: Callable[[dict[str, Any]], list[dict[str, Any]]],
                           finish: Callable[[], Awaitable[list[dict[str, Any]]]],
                           fail: Callable[[RequestFailed], list[dict[str, Any]]]) -> web.StreamResponse:
        """An agent API's events (Responses, Messages), each typed (`event:` and `data:` lines):
        `opening`, then each reply's chat delta through `feed`, then `finish`; a failure as
        `fail` says it, then the stream closes."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)

        async def send(events: list[dict[str, Any]]) -> None:
            for e in events:
                await resp.write(b"event: " + e["type"].encode() + b"\n" + sse(e))

        try:
            await send(opening)
            r, opened = first, True
            while True:
                out.add(r)
                chunk = out.chunk(r, opened)
                opened = False
                if chunk is not None and chunk["choices"]:
                    await send(feed(chunk["choices"][0]["delta"]))
                if r.last:
                    break
                r = await anext(replies)
            await send(await finish())
        except ConnectionResetError:  # the client went away: closing the stream cancels the request
            return resp
        except Exception as e:  # noqa: BLE001 - mid-stream: the error events, whatever failed
            if not isinstance(e, RequestFailed):
                logger.exception("%s %s failed mid-stream", request.method, request.path)
                e = RequestFailed(grpc.StatusCode.INTERNAL, "internal error in the router (logged); retry")
            with contextlib.suppress(ConnectionResetError):
                await send(fail(e))
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    def _reasoning_tokens(self, out: Output) -> int:
        """The output tokens up to the end of its think block (all, where it never closed; none
        without one): the reasoning parser's end marker is one token in the families it reads."""
        if out.reasoning is None or not out.token_ids:
            return 0
        reasoning, _ = out.reasoning.split("".join(out.text))
        if reasoning is None:
            return 0
        end = self.frontend.encode(END, add_special_tokens=False)
        if len(end) == 1 and end[0] in out.token_ids:
            return out.token_ids.index(end[0]) + 1
        return len(out.token_ids) if len(end) == 1 else len(self.frontend.encode(reasoning, add_special_tokens=False))

    async def _keep(self, tenant: str | None, shape: ResponseShape, conversation: list[dict[str, Any]]) -> None:
        """Stores a finished response where asked (and a store is there) for its follow-ups; a
        response that cannot be stored is still returned, with `store: false`."""
        if not shape.req.store or self.store is None:
            return
        shape.stored = True
        try:
            await self.store.put(tenant, shape.id, StoredResponse(shape.response(shape.status()),
                                                                  [*conversation, shape.assistant_turn()]))
        except (StoreUnavailable, ResponseTooLarge) as e:
            shape.stored = False
            logger.warning("response %s not stored: %s", shape.id, e)

    async def _stored(self, tenant: str | None, response_id: str, param: str) -> StoredResponse:
        if self.store is None:
            raise BadRequest("this server keeps no stored responses (no response store)", param)
        try:
            stored = await self.store.get(tenant, response_id)
        except StoreUnavailable:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, UNREACHABLE, retry_after_s=1.0) from None
        if stored is None:
            raise gone(response_id, param)
        return stored

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a response stored by this request's tenant."""
        stored = await self._stored(self._tenant(request), request.match_info["response_id"], "response_id")
        return web.json_response(stored.response, dumps=dumps)

    async def delete_response(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id}: one Redis call, which says whether the tenant had it."""
        response_id = request.match_info["response_id"]
        if self.store is None:
            raise BadRequest("this server keeps no stored responses (no response store)", "response_id")
        try:
            deleted = await self.store.delete(self._tenant(request), response_id)
        except StoreUnavailable:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, UNREACHABLE, retry_after_s=1.0) from None
        if not deleted:
            raise gone(response_id, "response_id")
        return web.json_response({"id": response_id, "object": "response", "deleted": True}, dumps=dumps)

    @staticmethod
    def _tenant(request: web.Request) -> str | None:
        """Whose stored responses the request sees: its API key's tenant, else the key (None: the
        server has no keys, and one shared store)."""
        who = identity(request)
        return who.owner if who is not None else None
