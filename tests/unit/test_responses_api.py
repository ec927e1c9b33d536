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
        max_output_tokens=9, temperature=0.5, top_p=0.9, user="acme").as_chat(None, True)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("developer", "Answer in French."), ("user", "a\nb"), ("assistant", "c")]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user) == (9, 0.5, 0.9, "acme")
    assert req(input="hi").as_chat(None, True).messages[0].content == "hi"
    schema = {"type": "object"}
    fmt = req(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": schema}}).as_chat(None, True)
    assert fmt.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": False}}


LOOP = [{"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "w", "arguments": '{"c": "P"}'},
        {"type": "function_call", "id": "fc_2", "call_id": "call_b", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "14:05"}]}]


def test_a_tool_loop_s_items_become_one_assistant_turn_and_its_tool_messages() -> None:
    calls = [{"id": "call_a", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}},
             {"id": "call_b", "type": "function", "function": {"name": "t", "arguments": "{}"}}]
    assert req(input=LOOP).conversation() == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "hm", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "14:05"}]
    # calls without text: their own assistant turn, which the thought before them belongs to
    alone = req(input=[LOOP[0], LOOP[1], LOOP[3]]).conversation()
    assert alone[1] == {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": calls[:1]}
    # a thought before a user's turn belongs to no answer
    assert req(input=[LOOP[1], LOOP[0]]).conversation() == [{"role": "user", "content": "weather?"}]


def test_tools_tool_choice_and_reasoning_effort_as_chat_takes_them() -> None:
    tool = {"type": "function", "name": "w", "description": "d", "parameters": {"type": "object"}, "strict": True}
    chat = req(input="hi", tools=[tool], tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False,
               reasoning={"effort": "none", "summary": "auto"}).as_chat(None, True)
    assert chat.tools == [{"type": "function", "function": {"name": "w", "description": "d",
                                                              "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}} and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    assert req(input="hi", reasoning={"effort": "high"}).as_chat(None, True).chat_template_kwargs == {
        "enable_thinking": True, "reasoning_effort": "high"}
    follow = req(input="c", instructions="i")
    earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert [m.content for m in follow.as_chat(earlier + follow.conversation(), True).messages] == ["i", "a", "b", "c"]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]: tools of type 'web_search' are not served here"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]: a function tool needs a name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "no thinking switch"),
    ({"input": [{"type": "input_image"}]}, "input", "input[0]: items of type 'input_image' are not served here"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image"}]}]}, "input",
     "'input[0].content[1]' is a content part of type 'input_image': only text parts are served here"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "input[0].call_id: Field required"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
    ({"truncatio": "auto"}, "truncatio", "unknown field 'truncatio'"),
])
def test_what_it_does_not_take_is_refused_by_name(fields: dict, param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        req(**{"input": "hi", **fields}).as_chat(None, False)
    assert e.value.param == param


def test_its_no_op_fields_are_listed_in_one_place() -> None:
    with pytest.raises(BadRequest) as e:
        req(input="hi", bogus=1)
    assert "include, prompt_cache_key, safety_identifier, service_tier, truncation" in e.value.message
    assert req(input="hi", service_tier="auto", prompt_cache_key="k", include=["reasoning.encrypted_content"],
               truncation="disabled").as_chat(None, True).messages[0].content == "hi"


def test_the_response_and_its_events_from_the_choice_s_replies() -> None:
    out = Output("chat", "chatcmpl-1", "m", False)
    shape = ResponseShape(req(input="hi", max_output_tokens=2, metadata={"k": "v"}), "m", out)
    events = shape.opening()
    for i, r in enumerate((Reply("r", [5], "Bon"), Reply("r", [6], "jour", finish_reason=FinishReason.LENGTH,
                                                             usage=Usage(3, 1, 2)))):
        out.add(r)
        events += shape.feed(out.chunk(r, i == 0)["choices"][0]["delta"])
    events += shape.closing_items() + shape.completed()
    streamed = events[-1]["response"]
    whole = ResponseShape(shape.req, "m", out).whole()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["content"][0]["text"] == "Bonjour" and whole["metadata"] == {"k": "v"}
    assert whole["output"][0]["status"] == "incomplete"
    assert whole["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert events[-1]["type"] == "response.incomplete"
    assert [{**o, "id": ""} for o in streamed["output"]] == [{**o, "id": ""} for o in whole["output"]]


def test_thought_text_and_calls_are_items_in_order_whole_and_streamed() -> None:
    out = Output("chat", "chatcmpl-1", "m", False)
    shape = ResponseShape(req(input="hi"), "m", out)
    deltas = [{"role": "assistant", "reasoning_content": "Hm"}, {"reasoning_content": "."}, {"content": "Let me"},
              {"content": " check."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "w", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"c": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"P"}'}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "t", "arguments": "{}"}}]}]
    events = [e for d in deltas for e in shape.feed(d)]
    out.add(Reply("r", [1], "", finish_reason=FinishReason.STOP, usage=Usage(3, 0, 9)))
    events += shape.closing_items() + shape.completed()
    kinds = [(e["type"].removeprefix("response."), e.get("output_index")) for e in events]
    assert kinds == [
        ("output_item.added", 0), ("content_part.added", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.delta", 0), ("reasoning_text.done", 0), ("content_part.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1), ("output_text.delta", 1),
        ("output_text.done", 1), ("content_part.done", 1), ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2), ("output_item.done", 2),
        ("output_item.added", 3), ("function_call_arguments.delta", 3), ("function_call_arguments.done", 3),
        ("output_item.done", 3), ("completed", None)]
    output = events[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in output] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed")]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert output[1]["content"][0]["text"] == "Let me check."
    assert [(o["call_id"], o["name"], o["arguments"]) for o in output[2:]] == [("call_a", "w", '{"c": "P"}'),
                                                                               ("call_b", "t", "{}")]
    assert shape.assistant_turn() == {"role": "assistant", "content": "Let me check.", "reasoning_content": "Hm.",
                                      "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "t", "arguments": "{}"}}]}
