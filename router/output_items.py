"""An answer as the agent APIs write it: a list of items (OpenAI's Responses output items,
Anthropic's content blocks), each a thought, a text or a tool call, built from the chat
deltas an `Output` reads out of the replies (its reasoning parser's thought, its text, its
tool-call parser's calls).

    chat delta {reasoning_content, content, tool_calls} --(ItemStream.feed)--> item opened,
    grown, done as the next opens or the answer ends --(each API's hooks)--> its events

A whole answer takes the same items from the chat message (`items_of_message`), so a
stream accumulated is the whole answer. Torch-free.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["reasoning", "message", "function_call"]


@dataclass
class Item:
    """One item as it is written: a thought's text, a message's text, or a call's arguments."""

    kind: Kind
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} for a call cut short before they parse)."""
        try:
            value = json.loads(self.text)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class ItemStream:
    """The items of one answer; subclasses turn each step into their API's events."""

    prefixes: dict[str, str] = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.open: Item | None = None
        self.calls: dict[int, Item] = {}
        """Chat's tool-call index -> its item."""

    # -- what subclasses write ----------------------------------------------------------------
    def _added(self, item: Item) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _text_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _arguments_delta(self, item: Item, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _done(self, item: Item, status: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    # -- the items --------------------------------------------------------------------------
    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta: its thought, its text, its calls' starts and arguments."""
        events: list[dict[str, Any]] = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if text := delta.get(key):
                if self.open is None or self.open.kind != kind:
                    events += self._close("completed") + self._added(self._open(kind))
                assert self.open is not None
                self.open.text += text
                events += self._text_delta(self.open, text)
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a call starts
                events += self._close("completed")
                self.calls[call["index"]] = self._open("function_call", call["id"], function.get("name", ""))
                events += self._added(self.calls[call["index"]])
            item = self.calls[call["index"]]
            if arguments := function.get("arguments"):
                item.text += arguments
                events += self._arguments_delta(item, arguments)
        return events

    def items_of_message(self, message: dict[str, Any]) -> None:
        """A whole answer's items, from its chat message (an answer of nothing: an empty text)."""
        if message.get("reasoning_content"):
            self._open("reasoning").text = message["reasoning_content"]
        if message.get("content"):
            self._open("message").text = message["content"]
        for call in message.get("tool_calls") or []:
            self._open("function_call", call["id"], call["function"]["name"]).text = call["function"]["arguments"]
        if not self.items:
            self._open("message")

    def last_done(self, status: str) -> list[dict[str, Any]]:
        """The last item done at the answer's end (an answer of nothing: an empty text, as whole)."""
        events = [] if self.items else self._added(self._open("message"))
        return events + self._close(status)

    def _open(self, kind: Kind, call_id: str = "", name: str = "") -> Item:
        item = Item(kind, self.prefixes[kind] + uuid.uuid4().hex, len(self.items), call_id=call_id, name=name)
        self.items.append(item)
        self.open = item
        return item

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        return [] if item is None else self._done(item, status)

    def assistant_turn(self) -> dict[str, Any]:
        """The answer as the chat message it adds to a conversation."""
        by_kind = {k: "".join(i.text for i in self.items if i.kind == k) for k in ("reasoning", "message")}
        turn: dict[str, Any] = {"role": "assistant", "content": by_kind["message"] or None}
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items if i.kind == "function_call"]
        if calls:
            turn["tool_calls"] = calls
        if by_kind["reasoning"]:
            turn["reasoning_content"] = by_kind["reasoning"]
        return turn
