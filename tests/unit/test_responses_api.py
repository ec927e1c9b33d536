"""The Responses API's request onto the chat path, and its Response object and events from a
choice's output (router/responses_api.py)."""
from __future__ import annotations

import json

import pytest

from engine.core.request import FinishReason
from router.openai_output import Output
from router.openai_protocol import BadRequest, parse
from router.reply import Reply, Usage
from router.responses_api import ResponseShape, ResponsesRequest


def req(**fields: object) -> ResponsesRequest:
    return parse(ResponsesRequest, json.dumps({"model": "m", **fields}).encode())  # type: ignore[no-any-return]


def test_instructions_and_input_items_become_the_chat_conversation() -> None:
    chat = req(instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}],
        max_output_tokens=9, temperature=0.5, top_p=0.9, user="acme").as_chat()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("developer", "Answer in French."), ("user", "a\nb"), ("assistant", "c")]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user) == (9, 0.5, 0.9, "acme")
    assert req(input="hi").as_chat().messages[0].content == "hi"
    schema = {"type": "object"}
    fmt = req(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": schema}}).as_chat()
    assert fmt.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": False}}


def test_what_it_does_not_take_is_refused_by_name_and_its_no_op_fields_are_listed() -> None:
    with pytest.raises(BadRequest, match="unknown field 'tools'") as e:
        req(input="hi", tools=[])
    assert "prompt_cache_key, safety_identifier, service_tier" in e.value.message
    assert req(input="hi", service_tier="auto", prompt_cache_key="k").as_chat().messages[0].content == "hi"
    with pytest.raises(BadRequest, match="store=true") as e:
        req(input="hi", store=True).as_chat()
    assert e.value.param == "store" and req(input="hi", store=False).as_chat() is not None


def test_the_response_and_its_events_from_the_choice_s_replies() -> None:
    out = Output("chat", "chatcmpl-1", "m", False)
    shape = ResponseShape(req(input="hi", max_output_tokens=2, metadata={"k": "v"}), "m", out)
    opening = shape.opening()
    for r in (Reply("r", [5], "Bon"), Reply("r", [6], "jour", finish_reason=FinishReason.LENGTH),
              Reply("r", finish_reason=FinishReason.LENGTH, usage=Usage(3, 1, 2))):
        out.add(r)
    closing = shape.closing()
    whole = shape.whole()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["content"][0]["text"] == "Bonjour" and whole["metadata"] == {"k": "v"}
    assert whole["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
    events = opening + closing
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"] == whole["output"]
