"""OpenAI's Responses API (`POST /v1/responses`) over the chat path.

    JSON body --(pydantic, strict; an unknown field is a 400 naming it)--> ResponsesRequest
              --(as_chat: instructions as the system message, input items as messages)-->
    ChatRequest --(the chat path: template, Ask, admission, flow)--> Replies --(Output)-->
    one Response object, or its events (`response.created` ... `response.completed`)

What it takes now: `input` as text or a list of message items (roles user, system,
developer, assistant; content as text or `input_text` / `output_text` parts),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (text,
json_object, json_schema), `stream`, `user`, `metadata` (returned as sent), `store` false.
Tools and their items, `previous_response_id` and stored responses (`store` true),
`reasoning` and a thinking model's reasoning items are not implemented yet: each is refused
by name, never ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field

from router.openai_output import Output
from router.openai_protocol import ChatRequest, _Body, _Request
from router.request_limits import BadRequest

IGNORED_FIELDS = frozenset({"service_tier", "prompt_cache_key", "safety_identifier"})
"""OpenAI's own Responses fields that change nothing here (its service tiers, cache keys,
abuse identifiers): accepted and ignored. Any other field this API does not implement is a
400 that names it."""


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    ignored: ClassVar[frozenset[str]] = IGNORED_FIELDS
    model: str | None = None
    input: str | list[MessageItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def as_chat(self) -> ChatRequest:
        """The same request as chat completions take it."""
        if self.store:
            raise BadRequest("store=true: stored responses (and previous_response_id) are not implemented yet; "
                             "send store=false", "store")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
                messages.append({"role": item.role, "content": content})
        fields: dict[str, Any] = {"messages": messages, "model": self.model, "max_tokens": self.max_output_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p, "user": self.user}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise BadRequest("text.format json_schema needs a schema", "text")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_, "strict": bool(fmt.strict)}}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})


class ResponseShape:
    """One request's Response object and its stream events, from the chat `Output` its
    replies fill (one choice)."""

    def __init__(self, req: ResponsesRequest, model: str, out: Output) -> None:
        self.req, self.model, self.out = req, model, out
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.seq = 0
        self.started = False

    def response(self, status: str, text: str | None = None) -> dict[str, Any]:
        """The Response object: `status` in_progress (no output yet), completed or incomplete."""
        req, out = self.req, self.out
        output = [] if text is None else [self._message(text, "completed" if status == "completed" else "incomplete")]
        usage = None
        if out.usage is not None:
            u = out.usage
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "model": self.model, "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "metadata": req.metadata or {},
                "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                         if req.text and req.text.format else {"type": "text"}},
                "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "previous_response_id": None,
                "store": False, "user": req.user}

    def whole(self) -> dict[str, Any]:
        return self.response(self._status(), "".join(self.out.text))

    def _status(self) -> str:
        return "incomplete" if self.out.finish_reason == "length" else "completed"

    def _message(self, text: str | None, status: str) -> dict[str, Any]:
        """The message item (None: no text part yet)."""
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        """The events before the first text: the response created and in progress, its message
        item and its text part added."""
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", output_index=0, item=self._message(None, "in_progress")),
                self.event("response.content_part.added", **at,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def delta(self, text: str) -> dict[str, Any]:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self) -> list[dict[str, Any]]:
        """The text, its part and its message item done, then the response completed (or
        incomplete, cut at max_output_tokens)."""
        text, status = "".join(self.out.text), self._status()
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        return [self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=part),
                self.event("response.output_item.done", output_index=0,
                           item=self._message(text, "completed" if status == "completed" else "incomplete")),
                self.event("response.completed" if status == "completed" else "response.incomplete",
                           response=self.response(status, text))]

    def failed(self, message: str, code: str) -> list[dict[str, Any]]:
        """A failure mid-stream: the error, then the response failed."""
        failed = {**self.response("failed"), "error": {"code": code, "message": message}}
        return [self.event("error", message=message, code=code, param=None),
                self.event("response.failed", response=failed)]
