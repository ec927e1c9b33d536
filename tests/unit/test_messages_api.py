"""Anthropic's Messages API onto the chat path, and its Message and events from a choice's
output (router/messages_api.py)."""
from __future__ import annotations

import json

import pytest

from engine.core.request import FinishReason
from router.messages_api import MessageShape, MessagesRequest, anthropic_error
from router.openai_output import Output
from router.openai_protocol import BadRequest, parse
from router.reply import Reply, Usage


def req(**fields: object) -> MessagesRequest:
    body = json.dumps({"model": "m", "max_tokens": 8, **fields}).encode()
    return parse(MessagesRequest, body)  # type: ignore[no-any-return]


LOOP = [{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "call_a", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_a", "content": "sunny",
                                      "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "and?"}]}]


def test_blocks_become_chat_messages_and_fields_chat_s() -> None:
    r = req(system=[{"type": "text", "text": "Be brief."}], messages=LOOP, stop_sequences=["x"], temperature=0.5,
            top_p=0.9, top_k=5, metadata={"user_id": "u1"},
            tools=[{"name": "w", "description": "d", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "enabled",
                                                                                      "budget_tokens": 1024})
    chat = r.as_chat(True, True)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "hm", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"}, {"role": "user", "content": "and?"}]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.user) == (
        8, ["x"], 0.5, 0.9, 5, "u1")
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                              "description": "d"}}]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    named = req(messages=LOOP[:1], tools=[{"name": "w", "input_schema": {}}], tool_choice={"type": "tool", "name": "w"})
    assert named.as_chat(False, False).tool_choice == {"type": "function", "function": {"name": "w"}}
    assert req(messages=LOOP[:1]).as_chat(True, True).chat_template_kwargs == {"enable_thinking": False}


def test_a_final_assistant_message_is_a_prefill_the_answer_continues() -> None:
    """Anthropic's prefill: the answer goes on from the final assistant message's text."""
    chat = req(messages=[LOOP[0], {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]).as_chat(
        False, False)
    assert (chat.continue_final_message, chat.add_generation_prompt) == (True, False)
    assert chat.messages[-1].model_dump(exclude_none=True) == {"role": "assistant", "content": "It is"}
    plain = req(messages=LOOP[:1]).as_chat(False, False)
    assert (plain.continue_final_message, plain.add_generation_prompt) == (False, True)


@pytest.mark.parametrize(("fields", "switch", "thinks", "param", "message"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 9}}, False, False, "thinking", "does not think"),
    ({}, False, True, "thinking", "always thinks"),
    ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, True, True, "tools", "type 'web_search_20250305'"),
    ({"tools": [{"name": "s"}]}, True, True, "tools", "needs a name and an input_schema"),
    ({"tool_choice": {"type": "tool"}}, True, True, "tool_choice", "needs the tool's name"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, True, True, "messages",
     "blocks of type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]}, True,
     True, "messages", "a user message holds no tool_use block"),
    ({"mcp_servers": []}, True, True, "mcp_servers", "unknown field 'mcp_servers'"),
    ({"messages": [LOOP[0], {"role": "assistant", "content": "It is "}]}, False, False, "messages",
     "final assistant content cannot end with trailing whitespace"),
    ({"messages": LOOP[:2]}, False, False, "messages", "a final assistant message is continued; one with tool_use"),
])
def test_what_it_does_not_take_is_refused_by_name(fields: dict, switch: bool, thinks: bool, param: str,
                                                  message: str) -> None:
    with pytest.raises(BadRequest, match=message) as e:
        req(**{"messages": LOOP[:1], **fields}).as_chat(switch, thinks)
    assert e.value.param == param


def test_the_message_and_its_events_from_the_choice_s_replies() -> None:
    out = Output("chat", "chatcmpl-1", "m", False)
    shape = MessageShape(req(messages=LOOP[:1]), "m", out, 3)
    events = shape.opening()
    assert events[0]["message"]["usage"]["input_tokens"] == 3 and events[0]["message"]["content"] == []
    for delta in ({"reasoning_content": "hm"}, {"content": "Let me check."},
                  {"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "w", "arguments": '{"c":'}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ' "P"}'}}]}):
        events += shape.feed(delta)
    out.add(Reply("r", [1], "", finish_reason=FinishReason.STOP, usage=Usage(3, 2, 7)))
    events += shape.closing()
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 7, "input_tokens": 3, "cache_read_input_tokens": 2}
    assert shape.message()["content"] == [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "call_a", "name": "w", "input": {"c": "P"}}]
    cut = Output("chat", "chatcmpl-2", "m", False)
    cut.add(Reply("r", [1], "Bon", finish_reason=FinishReason.LENGTH, usage=Usage(3, 0, 1)))
    whole = MessageShape(req(messages=LOOP[:1]), "m", cut, 3, lambda: None).whole()
    assert (whole["stop_reason"], whole["content"]) == ("max_tokens", [{"type": "text", "text": "Bon"}])
    stopped = Output("chat", "chatcmpl-3", "m", False)
    stopped.add(Reply("r", [1], "Bon", finish_reason=FinishReason.STOP, usage=Usage(3, 0, 1)))
    assert MessageShape(req(messages=LOOP[:1]), "m", stopped, 3, lambda: "jour").whole()["stop_sequence"] == "jour"
    assert anthropic_error(429, "slow down") == {"type": "error", "error": {"type": "rate_limit_error",
                                                                           "message": "slow down"}}
