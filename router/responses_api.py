"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the chat path.

    JSON body --(pydantic; an unknown field is a 400 naming it)--> ResponsesRequest
              --(as_chat: instructions, a stored turn's conversation, the input items as messages)-->
    ChatRequest --(the chat path: template, tool plan, reasoning parser, Ask, admission, flow)-->
    Replies --(Output: its chat deltas, reasoning / text / tool calls)--> ResponseShape -->
    one Response object, or its typed events (`response.created` ... `response.completed`)

Input items: `message` (roles user, system, developer, assistant; text or `input_text` /
`output_text` parts), `function_call` and `function_call_output` (an assistant's calls and
their results, as chat's `tool_calls` and tool messages), `reasoning` (a thinking model's
earlier thought, as `reasoning_content` on the assistant message after it: templates that
render the current tool loop's thinking read it). Output items: `reasoning` (from the
reasoning parser; its text in `content`, no summary), `message` with `output_text`,
`function_call` (the tool-call parser's, or a constrained `tool_choice`'s calls).

`store` (OpenAI's default: true) keeps the response, its conversation and its output in the
cluster's Redis (router/response_store.py) for `previous_response_id`; `instructions` are not
carried to the next turn (as OpenAI does). Any other field this API does not implement is a
400 naming it; the fields accepted that change nothing are `IGNORED_FIELDS`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError

from router.openai_output import Output
from router.output_items import Item, ItemStream
from router.openai_protocol import ChatRequest, _Body, _Request, not_text
from router.request_limits import BadRequest

IGNORED_FIELDS = frozenset({"service_tier", "prompt_cache_key", "safety_identifier", "include", "truncation"})
"""OpenAI's own Responses fields that change nothing here: its service tiers, cache keys and
abuse identifiers; `include` (extra output OpenAI adds on request: encrypted reasoning, which
this server never encrypts, since a reasoning item carries its text); `truncation` (the
server never drops input items: a conversation longer than the context is a 400). Also a
no-op: `reasoning.summary` (a reasoning item's text is the model's thought itself, its
summary stays empty). Any other field this API does not implement is a 400 naming it."""

THINKING_OFF = frozenset({"none", "minimal"})
"""`reasoning.effort` values that turn a thinking model's thinking off (the template's switch)."""


class Part(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningPart(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


ITEMS: dict[str, type[_Body]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                 "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
"""The input items taken, by type (an item without a type but with a role is a message)."""


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    ignored: ClassVar[frozenset[str]] = IGNORED_FIELDS
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """This turn's input items as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        thought: str | None = None  # a reasoning item's text, for the assistant's turn right after it
        for i, raw in enumerate(self.input):
            item = _item(i, raw)
            if isinstance(item, ReasoningItem):
                thought = "\n".join(p.text for p in (item.content or item.summary))
                continue
            last = messages[-1] if messages else None
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if last is not None and last["role"] == "assistant" and thought is None:
                    last.setdefault("tool_calls", []).append(call)  # its text, then its calls: one turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            else:
                assert isinstance(item, MessageItem)
                messages.append({"role": item.role, "content": _text(item.content)})
            if thought is not None and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = thought
            thought = None
        return messages

    def as_chat(self, conversation: list[dict[str, Any]] | None, thinking_switch: bool) -> ChatRequest:
        """The same request as chat completions take it: the instructions, then `conversation`
        (None: this turn's, `conversation()`; with `previous_response_id`, the stored turn's
        before it); `thinking_switch`: the chat template has one (`enable_thinking`)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            (self.conversation() if conversation is None else conversation)
        fields: dict[str, Any] = {"messages": messages, "model": self.model, "max_tokens": self.max_output_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None:
            if not thinking_switch:
                raise BadRequest(f"reasoning.effort {effort!r}: this model's chat template has no thinking switch "
                                 "(enable_thinking); leave reasoning.effort out", "reasoning")
            fields["chat_template_kwargs"] = {"enable_thinking": effort not in THINKING_OFF,
                                              "reasoning_effort": effort}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise BadRequest("text.format json_schema needs a schema", "text")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_, "strict": bool(fmt.strict)}}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        try:
            return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:  # an item's fields as chat reads them (a message's role, its text)
            err = e.errors(include_url=False)[0]
            raise BadRequest(f"input: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}", "input") from None


def _item(i: int, raw: dict[str, Any]) -> _Body:
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise BadRequest(f"input[{i}]: items of type {kind!r} are not served here (only {', '.join(ITEMS)})", "input")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if (refusal := not_text(errors, f"input[{i}]")) is not None:
            raise BadRequest(refusal, "input") from None
        err = errors[0]
        raise BadRequest(f"input[{i}].{'.'.join(str(p) for p in err['loc'])}: {err['msg']}", "input") from None


def _text(content: str | list[Part]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) as chat's."""
    if tool.get("type") != "function":
        raise BadRequest(f"tools[{i}]: tools of type {tool.get('type')!r} are not served here (only function tools)",
                         "tools")
    if not isinstance(tool.get("name"), str):
        raise BadRequest(f"tools[{i}]: a function tool needs a name", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: as chat's (which refuses others by name)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise BadRequest(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                         f"\"name\": ...}}, got {choice!r}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _item_json(item: Item, status: str, done: bool = True) -> dict[str, Any]:
    """An output item as the Responses API writes it (not `done`: as it is opened, empty)."""
    if item.kind == "message":
        return {"type": "message", "id": item.id, "status": status, "role": "assistant", "content": [
            {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}] if done else []}
    if item.kind == "reasoning":
        return {"type": "reasoning", "id": item.id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": item.text}] if done else []}
    return {"type": "function_call", "id": item.id, "status": status, "call_id": item.call_id, "name": item.name,
            "arguments": item.text if done else ""}


class ResponseShape(ItemStream):
    """One request's Response object and its stream events, from the chat deltas of the
    `Output` its replies fill (one choice)."""

    def __init__(self, req: ResponsesRequest, model: str, out: Output) -> None:
        super().__init__()
        self.req, self.model, self.out = req, model, out
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.seq = 0
        self.stored = False
        self.reasoning_tokens = 0
        """Output tokens spent thinking (set by the door, which knows the tokenizer)."""

    def response(self, status: str) -> dict[str, Any]:
        """The Response object: `status` in_progress (no output yet), completed, incomplete or failed."""
        req, out = self.req, self.out
        usage = None
        if out.usage is not None and status != "in_progress":
            u = out.usage
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": u["total_tokens"]}
        # the last item of an answer cut at max_output_tokens is incomplete
        output = [] if status == "in_progress" else [
            _item_json(i, "incomplete" if status == "incomplete" and i is self.items[-1] else "completed")
            for i in self.items]
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "model": self.model, "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "metadata": req.metadata or {},
                "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                         if req.text and req.text.format else {"type": "text"}},
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls,
                "reasoning": req.reasoning.model_dump() if req.reasoning else None,
                "previous_response_id": req.previous_response_id, "store": self.stored, "user": req.user}

    def status(self) -> str:
        return "incomplete" if self.out.finish_reason == "length" else "completed"

    def whole(self) -> dict[str, Any]:
        """The Response of a whole answer (after every reply was added to the output)."""
        self.items_of_message(self.out.whole()["choices"][0]["message"])
        return self.response(self.status())

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def _added(self, item: Item) -> list[dict[str, Any]]:
        events = [self.event("response.output_item.added", output_index=item.index,
                             item=_item_json(item, "in_progress", done=False))]
        if item.kind != "function_call":
            part = {"type": "output_text", "text": "", "annotations": []} if item.kind == "message" else \
                {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                                     content_index=0, part=part))
        return events

    def _text_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        at = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "message":
            return [self.event("response.output_text.delta", **at, delta=text, logprobs=[])]
        return [self.event("response.reasoning_text.delta", **at, delta=text)]

    def _arguments_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        return [self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                           delta=text)]

    def _done(self, item: Item, status: str) -> list[dict[str, Any]]:
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **at, name=item.name,
                                 arguments=item.text)]
        elif item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
            events = [self.event("response.output_text.done", **at, content_index=0, text=item.text, logprobs=[]),
                      self.event("response.content_part.done", **at, content_index=0, part=part)]
        else:
            part = {"type": "reasoning_text", "text": item.text}
            events = [self.event("response.reasoning_text.done", **at, content_index=0, text=item.text),
                      self.event("response.content_part.done", **at, content_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=item.index,
                                    item=_item_json(item, status))]

    def closing_items(self) -> list[dict[str, Any]]:
        return self.last_done(self.status())

    def completed(self) -> list[dict[str, Any]]:
        """The response completed (or incomplete, cut at max_output_tokens)."""
        status = self.status()
        return [self.event(f"response.{status}", response=self.response(status))]

    def failed(self, message: str, code: str) -> list[dict[str, Any]]:
        """A failure mid-stream: the error, then the response failed."""
        failed = {**self.response("failed"), "error": {"code": code, "message": message}}
        return [self.event("error", message=message, code=code, param=None),
                self.event("response.failed", response=failed)]
