"""Structured output through the OpenAI API: which field asks for it, as one constraint
(kind, value) for `SamplingParams.constraint`; and tool calls, which are constrained output
in OpenAI's `tool_calls` shape.

    response_format (json_object | json_schema), vLLM's structured_outputs {json, json_object,
        regex, choice, grammar} or its older guided_json / guided_regex / guided_choice /
        guided_grammar --constraint_of--> (kind, value); two at once is a 400
    tools + tool_choice --tool_plan--> named: its parameters' schema; required: a JSON list of
        {"name": one of the tools, "arguments": that tool's parameters} (one at most without
        parallel tool calls); auto (the default with tools): free text, read by the model
        family's tool-call parser (router/tool_parsers.py); none: free text, not read
    ToolCallOutput: the constrained text as `message.tool_calls` (finish_reason tool_calls)
    AutoToolOutput: the free text as content and the calls the parser reads in it
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from router.openai_output import Output
from router.openai_protocol import BadRequest, ChatRequest, CompletionRequest
from router.tool_parsers import PARSERS, ToolCall, ToolParser, ToolStream, call_of, make_parser


STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                   "grammar": "grammar"}


def constraint_of(req: CompletionRequest | ChatRequest) -> tuple[str, str] | None:
    """The request's structured-output constraint as (kind, value), from whichever one field
    sets it; BadRequest for a malformed one or for two at once (the engine checks the rest)."""
    found: list[tuple[str, tuple[str, str]]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequest("response_format json_schema needs json_schema.schema, a JSON schema object",
                                 "response_format")
            found.append(("response_format", ("json_schema", _json(schema))))
        elif kind != "text":
            raise BadRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                             "response_format")
    if req.structured_outputs:
        keys = [k for k, v in req.structured_outputs.items() if k in STRUCTURED_KEYS and v not in (None, False)]
        if len(keys) != 1:
            raise BadRequest(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KEYS)}",
                             "structured_outputs")
        found.append(("structured_outputs", _constraint_value(keys[0], req.structured_outputs[keys[0]],
                                                              "structured_outputs")))
    for key, value in (("json", req.guided_json), ("regex", req.guided_regex), ("choice", req.guided_choice),
                       ("grammar", req.guided_grammar)):
        if value is not None:
            found.append((f"guided_{key}", _constraint_value(key, value, f"guided_{key}")))
    if len(found) > 1:
        raise BadRequest(f"{found[0][0]} and {found[1][0]} both constrain the output; send one", found[1][0])
    return found[0][1] if found else None


def _constraint_value(key: str, value: Any, param: str) -> tuple[str, str]:
    kind = STRUCTURED_KEYS[key]
    if kind == "json_schema":
        if isinstance(value, str):
            return kind, value
        if not isinstance(value, dict):
            raise BadRequest(f"{param}: a JSON schema is an object (or its JSON text)", param)
        return kind, _json(value)
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise BadRequest(f"{param}: choice is a non-empty list of strings", param)
        return kind, _json(value)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param}: {key} is a non-empty string", param)
    return kind, value


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request with tools gets its calls."""

    mode: Literal["none", "auto", "required", "named"]
    constraint: tuple[str, str] | None = None
    """required and named: the output is the calls' JSON, constrained."""
    name: str | None = None
    """named: the function every answer calls."""
    parser: ToolParser | None = None
    """auto: reads the calls out of the model's own text."""
    max_calls: int | None = None
    """1 with `parallel_tool_calls: false`."""


def tool_plan(req: ChatRequest, parser: str | None) -> ToolPlan | None:
    """The plan for a chat request's tools (None: it has none); `parser`: the router's tool-call
    parser (--tool-call-parser, else the chat template's own format), which auto needs."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(req.tools)
    max_calls = None if req.parallel_tool_calls else 1
    choice = req.tool_choice if req.tool_choice is not None else "auto"  # OpenAI's default with tools
    if choice == "none":
        return ToolPlan("none")
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in functions:
            raise BadRequest(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})",
                             "tool_choice")
        return ToolPlan("named", ("json_schema", _json(closed(functions[name]))), name, max_calls=1)
    if choice == "required":
        call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": name}, "arguments": closed(params)}}
                          for name, params in functions.items()]}
        schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return ToolPlan("required", ("json_schema", _json(schema)), max_calls=max_calls)
    if choice != "auto":
        raise BadRequest(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function "
                         f"({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}), got {choice!r}",
                         "tool_choice")
    if parser is None:
        raise BadRequest("tool_choice \"auto\" needs the model's tool-call format, and this model's chat template "
                         f"has none the router knows; start the router with --tool-call-parser ({', '.join(PARSERS)}), "
                         "or send tool_choice \"required\" or a named function", "tool_choice")
    return ToolPlan("auto", parser=make_parser(parser), max_calls=max_calls)


OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
"""An object schema with any of these says itself what else it holds, or composes with schemas
that may (its properties are not all it can hold): it stays as it is."""


def closed(schema: Any) -> Any:
    """A function's parameters as constrained calls take them: an object schema that lists its
    properties and says nothing of others holds no others (`additionalProperties: false`), at
    every depth, as vLLM's default grammar backend (xgrammar's strict mode) reads a schema: a call
    with an argument its function does not name cannot be run. A schema that says (or composes
    with other schemas, or refers away) stays as it is, and so do the schemas it composes with;
    alternatives alone (anyOf / oneOf beside no properties) are each closed. The caller's schema
    is not changed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    lists = isinstance(schema.get("properties"), dict)
    alternatives = () if lists else ("anyOf", "oneOf")
    out = {key: closed(value) if key in ("items", "prefixItems", *alternatives) else value
           for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if lists and not any(k in schema for k in OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[fn["name"]] = params
    return functions


_SPACE = re.compile(r"\s*")


def _past_space(text: str, i: int) -> int:
    match = _SPACE.match(text, i)
    return match.end() if match else i


def closed_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` answer, a JSON list of {"name", "arguments"}: all of them, or of
    a list cut short (max_tokens) the calls it closed; a call cut off in the middle has no name or
    arguments a client could run, so it is left out (its finish reason, length, says so)."""
    decoder, calls = json.JSONDecoder(), []
    i = _past_space(text, 0)
    if not text.startswith("[", i):
        return []
    while True:
        try:
            call, i = decoder.raw_decode(text, _past_space(text, i + 1))
        except ValueError:
            return calls
        if (found := call_of(call)) is not None:
            calls.append(found)
        i = _past_space(text, i)
        if not text.startswith(",", i):
            return calls


def _finish(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish reason: tool_calls when the answer ended by itself in calls (a length
    cut stays length: the calls may be cut short)."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class ToolCallOutput(Output):
    """A constrained chat answer that is its tool calls: a named function's arguments, or
    (required) a JSON list of {"name", "arguments"}."""

    plan: ToolPlan = ToolPlan("required")
    call_id: str = ""

    def __post_init__(self) -> None:
        self.call_id = "call_" + uuid.uuid4().hex[:24]

    def _calls(self, text: str) -> list[dict[str, Any]]:
        if self.plan.name is not None:
            return [{"id": self.call_id, "type": "function", "function": {"name": self.plan.name, "arguments": text}}]
        return [c.as_openai() for c in closed_calls(text)]

    def _finish_reason(self) -> str | None:
        return _finish(self.finish_reason, True)

    def _message(self, content: str) -> dict[str, Any]:
        calls = self._calls(content)
        return {"role": "assistant", "content": None, **({"tool_calls": calls} if calls else {})}

    def _delta(self, content: str, first: bool, last: bool) -> dict[str, Any]:
        """A named function streams its arguments as they come; required, the calls at the end."""
        if self.plan.name is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": content}}
            if first:
                call |= {"id": self.call_id, "type": "function"}
                call["function"] = {"name": self.plan.name, "arguments": content}
            delta: dict[str, Any] = {"tool_calls": [call]} if (content or first) else {}
        else:
            calls = self._calls("".join(self.text)) if last else []
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else {}
        return {"role": "assistant", "content": None, **delta} if first else delta


@dataclass
class AutoToolOutput(Output):
    """A chat answer the model wrote freely: its content and the tool calls its family's
    parser reads out of its text (router/tool_parsers.py), whole or streamed."""

    plan: ToolPlan = ToolPlan("auto")
    stream: ToolStream | None = None

    def __post_init__(self) -> None:
        assert self.plan.parser is not None
        self.stream = ToolStream(self.plan.parser, self.plan.max_calls)

    def _finish_reason(self) -> str | None:
        """Read from the whole text (a stream asks before its last calls are sent)."""
        text = "".join(self.text)
        return _finish(self.finish_reason, bool(self._parse(self.reasoning.split(text)[1] if self.reasoning else text)[1]))

    def _parse(self, content: str) -> tuple[str | None, list[ToolCall]]:
        assert self.plan.parser is not None
        text, calls = self.plan.parser.parse(content)
        return text, calls[:self.plan.max_calls] if self.plan.max_calls is not None else calls

    def _message(self, content: str) -> dict[str, Any]:
        text, calls = self._parse(content)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message

    def _delta(self, content: str, first: bool, last: bool) -> dict[str, Any]:
        assert self.stream is not None
        deltas = self.stream.feed(content) + (self.stream.finish() if last else [])
        text = "".join(d.content for d in deltas)
        calls: list[dict[str, Any]] = []
        for d in deltas:
            if d.call is not None:
                calls.append({"index": d.index, "id": d.call.id, "type": "function",
                              "function": {"name": d.call.name, "arguments": ""}})
            elif d.index >= 0:
                calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        return delta
