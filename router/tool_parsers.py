"""Tool calls parsed out of a model's own text (OpenAI's `tool_choice: "auto"`), per model family.

A model free to answer or to call a tool writes its calls in its family's format; each
parser knows one (torch-free, pure):

    hermes       Qwen2.5/Qwen3, Hermes, SmolLM: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
                 once per call (a JSON list inside one pair of tags also reads as several calls)
    llama3_json  Llama 3.1-3.3: the whole answer is {"name": ..., "parameters": {...}} (after
                 <|python_tag|> or not), several separated by ";"
    mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or from v11 on
                 [TOOL_CALLS]name[ARGS]{...} per call

`parse` reads a whole answer: its content (the text before the first call; None when empty)
and its calls. `ToolStream` reads it as it streams: content is passed on as it comes, less
any tail that may be the start of a call's marker; a call is sent once its text is whole (a
hermes call at its closing tag, the others at the end), as two deltas the OpenAI SDK
assembles: its id and name, then its arguments. Text that looked like a call but does not
parse as one is content after all. `parser_for_template` picks the parser a chat template's
own format implies.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_of(value: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call from its decoded JSON, {"name": str, args_key: object or its JSON text}; None if not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _calls(value: Any, args_key: str = "arguments") -> list[ToolCall] | None:
    """Calls from one JSON value: a call, or a non-empty list of calls; None if it is neither."""
    items = value if isinstance(value, list) else [value]
    calls = [call_of(v, args_key) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in `text`, separated by whitespace, ";" or ","; None if it is not that."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    """One family's format: where calls begin (`markers`) and how their text reads."""

    name = ""
    markers: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    """Markers that are special tokens in the family's tokenizers: the text must keep them."""

    def start(self, text: str) -> int:
        """Where the first call begins in `text` (-1: none yet)."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found, default=-1)

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls in `text`, which begins where `start` found one; None if it does not parse."""
        raise NotImplementedError

    def complete(self, text: str) -> int:
        """How much of `text` (from a call's start) holds whole calls that can be sent now
        (0: wait for the end of the answer)."""
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.start(text)
        if at < 0:
            return text or None, []
        calls = self.calls(text[at:])
        if calls is None:
            return text or None, []
        return text[:at].rstrip() or None, calls

    def hold_back(self, text: str) -> int:
        """How many characters at the end of content `text` may be the start of a marker."""
        return max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _pair = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def calls(self, text: str) -> list[ToolCall] | None:
        """Every tagged call that parses (one left open at the end too); text between them is
        not content (content ends where the first call begins)."""
        bodies = self._pair.findall(text)
        rest = self._pair.sub("", text)
        if "<tool_call>" in rest:  # the last call left open: the answer ended in it
            bodies.append(rest.split("<tool_call>", 1)[1])
        out: list[ToolCall] = []
        for body in bodies:
            try:
                out += _calls(json.loads(body)) or []
            except ValueError:
                continue
        return out or None

    def complete(self, text: str) -> int:
        end = text.rfind("</tool_call>")
        return end + len("</tool_call>") if end >= 0 else 0


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    special_tokens = ("<|python_tag|>",)

    def start(self, text: str) -> int:
        tag = super().start(text)
        if tag >= 0:
            return tag
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1  # a call is the whole answer

    def calls(self, text: str) -> list[ToolCall] | None:
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>"):]
        values = _json_values(text)
        if not values:
            return None
        calls = [call_of(v, "parameters") for v in values]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_tokens = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def calls(self, text: str) -> list[ToolCall] | None:
        pieces = [p.strip() for p in text.split("[TOOL_CALLS]") if p.strip()]
        out: list[ToolCall] = []
        for piece in pieces:
            if "[ARGS]" in piece:  # v11: name[ARGS]{...}; later: name[CALL_ID]id[ARGS]{...}
                name, _, args = piece.partition("[ARGS]")
                name = name.partition("[CALL_ID]")[0]
                try:
                    call = call_of({"name": name.strip(), "arguments": json.loads(args)})
                except ValueError:
                    return None
                found = [call] if call is not None else None
            else:
                values = _json_values(piece)
                found = _calls(values[0]) if values and len(values) == 1 else None
            if found is None:
                return None
            out += found
        return out or None


_BY_NAME: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def make_parser(name: str) -> ToolParser:
    if name not in _BY_NAME:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return _BY_NAME[name]()


def parser_for_template(source: str | None) -> str | None:
    """The parser a chat template's own tool-call format implies (None: no format it knows)."""
    if not source or "tools" not in source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|eom_id|>" in source and "parameters" in source):
        return "llama3_json"
    return None


@dataclass
class Delta:
    """One piece of a streamed answer: content text, or a tool call's start (id and name) or
    its arguments, at `index` among the answer's calls."""

    content: str = ""
    index: int = -1
    call: ToolCall | None = None
    arguments: str = ""


class ToolStream:
    """A streamed answer split into content and calls as its text arrives (`feed`, then `finish`)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        """`parallel_tool_calls: false`: 1 (later calls are dropped)."""
        self.calls: list[ToolCall] = []
        self._text = ""
        self._sent = 0
        """Content characters sent."""
        self._start = -1
        """Where the calls begin in the text (-1: not yet)."""
        self._done = 0
        """Characters from the calls' start already sent as calls."""

    def feed(self, delta: str) -> list[Delta]:
        self._text += delta
        out: list[Delta] = []
        if self._start < 0:
            at = self.parser.start(self._text)
            if at < 0:
                safe = len(self._text) - self.parser.hold_back(self._text[self._sent:])
                while safe > self._sent and self._text[safe - 1].isspace():
                    safe -= 1  # blanks are sent with what follows them: before a call they are dropped
                return self._content(safe)
            out += self._content(len(self._text[:at].rstrip()))
            self._start = at
        body = self._text[self._start + self._done:]
        n = self.parser.complete(body)
        if n:
            calls = self.parser.calls(body[:n])
            if calls is not None:
                self._done += n
                out += self._send(calls)
        return out

    def finish(self) -> list[Delta]:
        """The rest, at the end of the answer: calls that parse, else the text as content."""
        if self._start < 0:
            return self._content(len(self._text))
        body = self._text[self._start + self._done:]
        calls = self.parser.calls(body) if body.strip() else None
        if calls is not None:
            return self._send(calls)
        if self.calls:  # after whole calls, what does not parse is dropped, as a whole answer drops it
            return []
        self._start = -1  # nothing parsed: it was content after all
        return self._content(len(self._text))

    def _content(self, upto: int) -> list[Delta]:
        if upto <= self._sent:
            return []
        text, self._sent = self._text[self._sent:upto], upto
        return [Delta(content=text)]

    def _send(self, calls: list[ToolCall]) -> list[Delta]:
        out = []
        for call in calls:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break
            index = len(self.calls)
            self.calls.append(call)
            out += [Delta(index=index, call=call), Delta(index=index, arguments=call.arguments)]
        return out
