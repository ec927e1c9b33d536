"""How much one OpenAI request may ask the router to parse, render and tokenize.

    body bytes --prescan (one C scan, before any parse: a flood of messages is refused in
               milliseconds, not after seconds of validation)--> parse
    request    --check (messages, tools, names, chat_template_kwargs)--> render, tokenize

Each limit is a flag (`serve` / `router`); a request past one is a 400 naming the field and
the flag. The text itself is bounded by the model's context (router/frontend.py). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from router.openai_protocol import BadRequest, ChatRequest, Message, TokenizeRequest


@dataclass(frozen=True)
class RequestLimits:
    max_messages: int = 2048
    """Messages in one chat (or /tokenize) request (--max-messages)."""
    max_tools: int = 128
    """Tools in one chat request: OpenAI's own limit (--max-tools)."""
    max_name_chars: int = 64
    """A message's `name`, a function's name, a tool call's id: OpenAI's 64 characters."""
    max_template_kwargs_bytes: int = 16384
    """chat_template_kwargs, as JSON (--max-template-kwargs-bytes)."""

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_tools", "max_name_chars", "max_template_kwargs_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def prescan(self, body: bytes) -> None:
        """Refuses a body that holds more messages than allowed, before it is parsed: every
        message has a "role" key, so counting the key bounds them (a string value "role"
        counts too, so the count can only be over, never under)."""
        if body.count(b'"role"') > self.max_messages:
            raise BadRequest(f"the request holds more than {self.max_messages} messages (--max-messages)", "messages")

    def check(self, req: ChatRequest | TokenizeRequest) -> None:
        messages = req.messages or []
        if len(messages) > self.max_messages:
            raise BadRequest(f"the request holds {len(messages)} messages; at most {self.max_messages} "
                             "(--max-messages)", "messages")
        for i, m in enumerate(messages):
            self._check_message(i, m)
        if isinstance(req, ChatRequest):
            self._check_tools(req.tools or [])
            self._check_template_kwargs(req.chat_template_kwargs)

    def _check_message(self, i: int, m: Message) -> None:
        names = [("name", m.name), ("tool_call_id", m.tool_call_id)]
        names += [(f"tool_calls[{j}].id", c.id) for j, c in enumerate(m.tool_calls or [])]
        names += [(f"tool_calls[{j}].function.name", c.function.name) for j, c in enumerate(m.tool_calls or [])]
        for where, value in names:
            if value is not None and len(value) > self.max_name_chars:
                raise BadRequest(f"messages[{i}].{where} has {len(value)} characters; at most {self.max_name_chars}",
                                 "messages")

    def _check_tools(self, tools: list[dict[str, Any]]) -> None:
        if len(tools) > self.max_tools:
            raise BadRequest(f"the request holds {len(tools)} tools; at most {self.max_tools} (--max-tools)", "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and len(name) > self.max_name_chars:
                raise BadRequest(f"tools[{i}].function.name has {len(name)} characters; at most "
                                 f"{self.max_name_chars}", "tools")

    def _check_template_kwargs(self, kwargs: dict[str, Any] | None) -> None:
        if not kwargs:
            return
        try:
            size = len(orjson.dumps(kwargs))
        except orjson.JSONEncodeError as e:
            raise BadRequest(f"chat_template_kwargs cannot be used: {e}", "chat_template_kwargs") from None
        if size > self.max_template_kwargs_bytes:
            raise BadRequest(f"chat_template_kwargs is {size} bytes as JSON; at most "
                             f"{self.max_template_kwargs_bytes} (--max-template-kwargs-bytes)", "chat_template_kwargs")
