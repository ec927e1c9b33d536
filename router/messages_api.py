"""Anthropic's Messages API (`POST /v1/messages`) over the chat path.

    JSON body --(pydantic; an unknown field is a 400 naming it)--> MessagesRequest
              --(as_chat: system, messages' blocks as chat messages, tools, thinking switch)-->
    ChatRequest --(the chat path: template, tool plan, reasoning parser, Ask, admission, flow)-->
    Replies --(Output: its chat deltas)--> MessageShape --> one Message, or its events
    (message_start, content_block_start / _delta / _stop per block, message_delta, message_stop)

Blocks taken: `text`, `tool_use` and `tool_result` (as chat's tool calls and tool messages),
`thinking` (an earlier thought, as `reasoning_content`); content blocks returned: `thinking`
(from the reasoning parser; its signature empty: nothing here signs), `text`, `tool_use`.
`thinking` {"type": "enabled"} turns the chat template's thinking switch on, and it is off
without it (Anthropic's default); `metadata.user_id` is the request's user (its fair share).
Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`
(`anthropic_error`); the key may come as `x-api-key` (router/http_guard.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError

from router.openai_output import Output
from router.openai_protocol import ChatRequest, _Body, _Request
from router.output_items import Item, ItemStream
from router.request_limits import BadRequest

IGNORED_FIELDS = frozenset({"service_tier", "cache_control"})
"""Anthropic's own request fields that change nothing here: its service tiers, and
`cache_control` (the prefix cache is automatic: every prompt's cached prefix is reused,
marked or not). Also no-ops, inside the request: `cache_control` on any block, `citations`, a tool result's `is_error`
(its content goes to the model as it is), `thinking.budget_tokens` (thinking is bounded by
`max_tokens` alone). Any other field is a 400 that names it."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}
"""Anthropic's error type of an HTTP status (else api_error)."""


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str


BLOCKS: dict[str, type[_Body]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                                  "thinking": ThinkingBlock}


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Request):
    ignored: ClassVar[frozenset[str]] = IGNORED_FIELDS
    model: str | None = None
    max_tokens: int
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat messages: a user's tool results as tool messages (before its
        text), an assistant's thinking, text and tool uses as one assistant turn."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else \
                [_block(i, j, b) for j, b in enumerate(m.content)]
            text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            if m.role == "user":
                for b in blocks:
                    if isinstance(b, ToolUseBlock | ThinkingBlock):
                        raise BadRequest(f"messages[{i}]: a user message holds no {b.type} block", "messages")
                    if isinstance(b, ToolResultBlock):
                        content = b.content if isinstance(b.content, str) else "\n".join(t.text for t in b.content)
                        out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
                if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append({"role": "user", "content": text})
                continue
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise BadRequest(f"messages[{i}]: an assistant message holds no tool_result block", "messages")
            turn: dict[str, Any] = {"role": "assistant", "content": text or None}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                turn["tool_calls"] = calls
            thought = "\n".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thought:
                turn["reasoning_content"] = thought
            out.append(turn)
        return out

    def as_chat(self, thinking_switch: bool, thinks: bool) -> ChatRequest:
        """The same request as chat completions take it; `thinking_switch`: the chat template
        has one (`enable_thinking`); `thinks`: the router splits this model's thinking out."""
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "\n".join(b.text for b in self.system)
        fields: dict[str, Any] = {
            "messages": ([{"role": "system", "content": system}] if system else []) + self.conversation(),
            "model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "stop": self.stop_sequences,
            "user": self.metadata.user_id if self.metadata else None}
        if self.tools:
            fields["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.messages[-1].role == "assistant":  # a prefill: the answer goes on from its text
            begun = fields["messages"][-1]
            if begun.get("tool_calls"):
                raise BadRequest(f"messages[{len(self.messages) - 1}]: a final assistant message is continued; one "
                                 "with tool_use blocks needs the user's tool_result blocks after it", "messages")
            if (text := begun["content"] or "") != text.rstrip():
                raise BadRequest("final assistant content cannot end with trailing whitespace", "messages")
            fields["continue_final_message"], fields["add_generation_prompt"] = True, False
        if (choice := self.tool_choice) is not None:
            if choice.type == "tool" and choice.name is None:
                raise BadRequest("tool_choice {\"type\": \"tool\"} needs the tool's name", "tool_choice")
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        on = self.thinking is not None and self.thinking.type != "disabled"
        if on and not thinks:
            raise BadRequest("thinking: this model does not think (the router has no reasoning parser for it); "
                             "leave thinking out", "thinking")
        if thinking_switch:
            fields["chat_template_kwargs"] = {"enable_thinking": on}
        elif thinks and not on:
            raise BadRequest("thinking disabled: this model always thinks (its chat template has no switch); send "
                             "thinking {\"type\": \"enabled\"}", "thinking")
        try:
            return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            raise BadRequest(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}", "messages") from None


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request's prompt fields, without max_tokens."""

    max_tokens: int = 1


def _block(i: int, j: int, raw: dict[str, Any]) -> _Body:
    model = BLOCKS.get(raw.get("type")) if isinstance(raw.get("type"), str) else None
    if model is None:
        raise BadRequest(f"messages[{i}].content[{j}]: blocks of type {raw.get('type')!r} are not served here (only "
                         f"{', '.join(BLOCKS)})", "messages")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise BadRequest(f"messages[{i}].content[{j}].{where}: {err['msg']}", "messages") from None


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool ({name, description, input_schema}) as chat's function tool."""
    if tool.get("type") not in (None, "custom"):
        raise BadRequest(f"tools[{i}]: tools of type {tool.get('type')!r} are not served here (only custom tools "
                         "with an input_schema)", "tools")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise BadRequest(f"tools[{i}]: a tool needs a name and an input_schema (a JSON schema object)", "tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _block_json(item: Item, done: bool = True) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": item.text if done else "", "signature": ""}
    if item.kind == "message":
        return {"type": "text", "text": item.text if done else ""}
    return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": item.arguments() if done else {}}


class MessageShape(ItemStream):
    """One request's Message and its stream events, from the chat deltas of its `Output`."""

    def __init__(self, req: MessagesRequest, model: str, out: Output, input_tokens: int,
                 stop_sequence: Any = None) -> None:
        """`stop_sequence`: () -> which of the request's stop sequences ended the answer (None: none)."""
        super().__init__()
        self.req, self.model, self.out, self.input_tokens = req, model, out, input_tokens
        self.stop_sequence = stop_sequence
        self.id = "msg_" + uuid.uuid4().hex

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if self.out.finish_reason == "length":
            return "max_tokens", None
        if any(i.kind == "function_call" for i in self.items):
            return "tool_use", None
        matched = self.stop_sequence() if self.stop_sequence is not None else None
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _usage(self) -> dict[str, Any]:
        u = self.out.usage
        return {"input_tokens": u["prompt_tokens"] if u else self.input_tokens,
                "output_tokens": u["completion_tokens"] if u else 0,
                "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"] if u else 0,
                "cache_creation_input_tokens": 0}

    def message(self, done: bool = True) -> dict[str, Any]:
        reason, sequence = self.stop() if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [_block_json(i) for i in self.items] if done else [], "stop_reason": reason,
                "stop_sequence": sequence, "usage": self._usage()}

    def whole(self) -> dict[str, Any]:
        self.items_of_message(self.out.whole()["choices"][0]["message"])
        return self.message()

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message(done=False)}]

    def _added(self, item: Item) -> list[dict[str, Any]]:
        return [{"type": "content_block_start", "index": item.index, "content_block": _block_json(item, done=False)}]

    def _text_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        delta = {"type": "text_delta", "text": text} if item.kind == "message" else \
            {"type": "thinking_delta", "thinking": text}
        return [{"type": "content_block_delta", "index": item.index, "delta": delta}]

    def _arguments_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        return [{"type": "content_block_delta", "index": item.index,
                 "delta": {"type": "input_json_delta", "partial_json": text}}]

    def _done(self, item: Item, status: str) -> list[dict[str, Any]]:
        return [{"type": "content_block_stop", "index": item.index}]

    def closing(self) -> list[dict[str, Any]]:
        """The last block stopped, the stop reason and the usage, the message stopped."""
        events = self.last_done("completed")
        reason, sequence = self.stop()
        u = self._usage()
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": {"output_tokens": u["output_tokens"], "input_tokens": u["input_tokens"],
                                    "cache_read_input_tokens": u["cache_read_input_tokens"]}},
                         {"type": "message_stop"}]
