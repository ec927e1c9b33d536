"""Structured output through the OpenAI API: which field asks for it, as one constraint
(kind, value) for `SamplingParams.constraint`; and tool calls, which are constrained output
in OpenAI's `tool_calls` shape.

    response_format (json_object | json_schema), vLLM's structured_outputs {json, json_object,
        regex, choice, grammar} or its older guided_json / guided_regex / guided_choice /
        guided_grammar --constraint_of--> (kind, value); two at once is a 400
    tools + tool_choice --tool_constraint--> a named function: its parameters' schema; required:
        {"name": one of the tools, "arguments": that tool's parameters}; auto is not supported
        (a 400 that says what is: a model free to answer in text or call would need the
        model's own tool-call format parsed out of its text)
    ToolCallOutput: the constrained text as `message.tool_calls` (finish_reason tool_calls)
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from proto import generate_pb2 as pb
from router.openai_protocol import BadRequest, ChatRequest, CompletionRequest, Output


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
class ToolChoice:
    name: str | None
    """The function every answer calls (tool_choice names it), or None: required, any tool."""


def tool_constraint(req: ChatRequest) -> tuple[tuple[str, str], ToolChoice] | None:
    """The constraint and tool choice of a chat request with tools (None: no tool call)."""
    if not req.tools or req.tool_choice == "none":
        return None
    functions = {}
    for i, tool in enumerate(req.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[fn["name"]] = params
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise BadRequest(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})",
                             "tool_choice")
        return ("json_schema", _json(functions[name])), ToolChoice(name)
    if choice == "required":
        schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": name}, "arguments": params}}
                            for name, params in functions.items()]}
        return ("json_schema", _json(schema)), ToolChoice(None)
    raise BadRequest(f"tool_choice {choice or 'auto'!r} is not supported: name a function "
                     "({\"type\": \"function\", \"function\": {\"name\": ...}}) or send \"required\" "
                     "(or \"none\")", "tool_choice")


@dataclass
class ToolCallOutput(Output):
    """A chat answer that is one tool call: the constrained text becomes its arguments."""

    tool: ToolChoice = ToolChoice(None)
    call_id: str = ""

    def __post_init__(self) -> None:
        self.call_id = "call_" + uuid.uuid4().hex[:24]

    def _call(self) -> dict[str, Any]:
        text = "".join(self.text)
        name = self.tool.name
        if name is None:  # required: {"name": ..., "arguments": {...}}
            try:
                value = json.loads(text)
                name, text = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
            except (ValueError, KeyError, TypeError):  # cut short (max_tokens): what there is
                name = ""
        return {"id": self.call_id, "type": "function", "function": {"name": name, "arguments": text}}

    def _finish(self) -> str | None:
        return "tool_calls" if self.finish_reason == "stop" else self.finish_reason

    def whole(self) -> dict[str, Any]:
        out = super().whole()
        choice = out["choices"][0]
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [self._call()]}
        choice["finish_reason"] = self._finish()
        return out

    def chunk(self, r: pb.GenerateResponse | None, first: bool = False) -> dict[str, Any] | None:
        """A named function streams its arguments as they come; required, the whole call at the end."""
        out = super().chunk(r, first)
        if r is None or out is None or not out["choices"]:
            return out
        choice = out["choices"][0]
        last = r.HasField("usage")
        if self.tool.name is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": r.text}}
            if first:
                call |= {"id": self.call_id, "type": "function"}
                call["function"] = {"name": self.tool.name, "arguments": r.text}
            delta: dict[str, Any] = {"tool_calls": [call]} if (r.text or first) else {}
        else:
            delta = {"tool_calls": [{"index": 0, **self._call()}]} if last else {}
        if first:
            delta = {"role": "assistant", "content": None, **delta}
        choice["delta"] = delta
        if last:
            choice["finish_reason"] = self._finish()
        return out
