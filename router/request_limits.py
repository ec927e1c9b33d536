"""How much one OpenAI request may ask the router to parse, render and tokenize.

    body bytes --prescan (router/json_shape.py, before any parse: every list and map counted
               against its limit, a flood refused a few KiB into it)--> parse
    request    --check (names, chat_template_kwargs)--> render, tokenize

Lists and maps: messages (and a message's parts) and tools by their flags, token id lists
(a prompt, /detokenize's tokens) by the model's context, stop strings, stop token ids and
logit_bias by the engine's own limits (engine/core/request.py), a completion's prompts by
MAX_PROMPTS, anything else by `max_items`. A request past one is a 400 naming the field (and
the flag, where one sets it). The text itself is bounded by the model's context
(router/frontend.py). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from engine.core.request import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from router.json_shape import Shape, TooMany

if TYPE_CHECKING:
    from router.openai_protocol import ChatRequest, Message, TokenizeRequest

FLAGS = {("messages",): "--max-messages", ("messages", "*", "content"): "--max-messages",
         ("tools",): "--max-tools", ("messages", "*", "tool_calls"): "--max-tools"}
NOUNS = {("messages",): "messages", ("messages", "*", "content"): "content parts", ("tools",): "tools",
         ("messages", "*", "tool_calls"): "tool calls", ("stop",): "stop strings", ("logit_bias",): "tokens",
         ("prompt",): "prompts"}
TOKEN_LISTS = (("prompt",), ("prompt", "*"), ("tokens",), ("stop_token_ids",))
MAX_PROMPTS = 128
"""Prompts in one completions request (each a choice, run at once)."""


class BadRequest(Exception):
    """A 400 before any work: `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


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
    max_items: int = 4096
    """Any other list or map of a request (a schema's properties, guided_choice's options...)."""
    max_depth: int = 64
    """Lists and maps inside one another, the body's own object counted."""

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_tools", "max_name_chars", "max_template_kwargs_bytes", "max_items",
                     "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def prescan(self, body: bytes, max_model_len: int) -> None:
        """Refuses a body with a list or map past its limit, before it is parsed (token id
        lists are bounded by the model's context, `max_model_len`)."""
        try:
            self.shape(max_model_len).check(body)
        except TooMany as e:
            where = ".".join(e.path)
            flag = f" ({FLAGS[e.path]})" if e.path in FLAGS else ""
            if e.what == "numbers":  # a flat list of numbers: token ids where a token list is
                noun = "token ids" if e.path in TOKEN_LISTS else "numbers"
            else:
                noun = NOUNS.get(e.path, e.what)
            raise BadRequest(f"{where or 'the body'} holds more than {e.limit} {noun}{flag}",
                             e.path[0] if e.path else None) from None

    def shape(self, max_model_len: int) -> Shape:
        tokens = max_model_len  # a prompt of as many is refused later, with its own message
        return Shape({("messages",): self.max_messages, ("messages", "*", "content"): self.max_messages,
                      ("messages", "*", "tool_calls"): self.max_tools, ("tools",): self.max_tools,
                      ("stop",): MAX_STOP_STRINGS, ("logit_bias",): MAX_LOGIT_BIAS, ("prompt",): MAX_PROMPTS},
                     {**dict.fromkeys(TOKEN_LISTS, tokens), ("stop_token_ids",): MAX_STOP_TOKEN_IDS},
                     self.max_items, self.max_depth)

    def check(self, req: ChatRequest | TokenizeRequest) -> None:
        """What the prescan cannot count: names' lengths, chat_template_kwargs' size."""
        from router.openai_protocol import ChatRequest  # here: router/config.py's readers have no pydantic

        for i, m in enumerate(req.messages or []):
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
