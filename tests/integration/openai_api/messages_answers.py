"""Anthropic's Messages API with Anthropic's own client (`client.messages`): the chat answer,
whole and streamed (the client's accumulator gives the whole call's message), a cut at
max_tokens, a stop sequence, a prefill, counting tokens, a named tool, and bad input as 400s in Anthropic's error shape.
Collected by test_api.py, on its 1P+1D cluster (tool loops and thinking:
tests/integration/test_openai_tools.py)."""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.integration.openai_api.calls import MODEL, QUESTION, post

SYSTEM = "You are a helpful assistant."
GREEDY = {"temperature": 0}
"""Anthropic's client of 2026 has no sampling arguments (its models take none); the API still does."""


def claude(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


def test_a_message_is_the_chat_answer_whole_and_streamed(base: str, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
                                          temperature=0, max_tokens=20)
    m = claude(base).messages.create(model=MODEL, system=SYSTEM, messages=QUESTION, extra_body=GREEDY, max_tokens=20)
    assert [(b.type, b.text) for b in m.content] == [("text", chat.choices[0].message.content)]
    assert (m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == ("message", "assistant", MODEL, "end_turn",
                                                                         None)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    blocks = [{"type": "text", "text": SYSTEM}]
    with claude(base).messages.stream(model=MODEL, system=blocks, extra_body=GREEDY, max_tokens=20, messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in m.content]
    assert (final.usage.input_tokens, final.usage.output_tokens, final.stop_reason) == (
        m.usage.input_tokens, m.usage.output_tokens, "end_turn")
    assert final.usage.cache_read_input_tokens >= 16  # the same prompt again: its blocks cached


def test_a_cut_at_max_tokens_and_a_stop_sequence_say_why_they_stopped(base: str) -> None:
    cut = claude(base).messages.create(model=MODEL, messages=QUESTION, extra_body=GREEDY, max_tokens=3)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    stopped = claude(base).messages.create(model=MODEL, messages=QUESTION, extra_body=GREEDY, max_tokens=20,
                                           stop_sequences=["zebra", " Paris"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " Paris")
    assert stopped.content[0].text == "The capital of France is"
    with claude(base).messages.stream(model=MODEL, messages=QUESTION, extra_body=GREEDY, max_tokens=20,
                                      stop_sequences=[" Paris"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", " Paris")
    assert [b.text for b in final.content] == [b.text for b in stopped.content]


def test_a_final_assistant_message_is_continued_as_a_prefill(base: str, client: openai.OpenAI) -> None:
    """Anthropic's prefill: the answer is the rest of the final assistant message, the tokens
    chat's continue_final_message gives."""
    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    m = claude(base).messages.create(model=MODEL, messages=begun, extra_body=GREEDY,  # type: ignore[arg-type]
                                     max_tokens=8)
    chat = client.chat.completions.create(model=MODEL, messages=begun,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=8, extra_body={"continue_final_message": True})
    assert [(b.type, b.text) for b in m.content] == [("text", chat.choices[0].message.content)]
    assert m.content[0].text.startswith(" Paris") and m.usage.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_is_what_the_message_takes(base: str) -> None:
    """`/v1/messages/count_tokens` with Anthropic's client: the input tokens the same request
    is charged, with a system prompt and tools rendered as the request renders them."""
    tool = {"name": "capital", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    fields = {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "tools": [tool],
              "tool_choice": {"type": "any"}}
    counted = claude(base).messages.count_tokens(**fields)  # type: ignore[arg-type]
    m = claude(base).messages.create(**fields, max_tokens=1, extra_body=GREEDY)  # type: ignore[arg-type]
    assert counted.input_tokens == m.usage.input_tokens
    plain = claude(base).messages.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body=GREEDY)
    assert claude(base).messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens == plain.usage.input_tokens
    assert plain.usage.input_tokens != counted.input_tokens  # the template's own system prompt, not SYSTEM
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(base).messages.count_tokens(model=MODEL, messages=[])
    assert e.value.body["type"] == "error" and "messages" in e.value.body["error"]["message"]


def test_a_named_tool_is_one_tool_use(base: str) -> None:
    tool = {"name": "capital", "input_schema": {"type": "object", "properties": {"city": {"type": "string",
            "maxLength": 20}}, "required": ["city"], "additionalProperties": False}}
    m = claude(base).messages.create(model=MODEL, messages=QUESTION, extra_body=GREEDY, max_tokens=40, tools=[tool],
                                     tool_choice={"type": "tool", "name": "capital"})
    [use] = m.content
    assert (m.stop_reason, use.type, use.name, set(use.input)) == ("tool_use", "tool_use", "capital", {"city"})


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": QUESTION}, "'max_tokens' is required"),
    ({"max_tokens": 4, "messages": QUESTION, "container": "c"}, "unknown field 'container'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: blocks of type 'image' are not served here"),
    ({"max_tokens": 4, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "this model does not think"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "'messages.0.role'"),
])
def test_bad_input_is_a_400_in_anthropic_s_shape(base: str, body: dict, message: str) -> None:
    status, _, answer = post(base, "/v1/messages", {"model": MODEL, **body})
    assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert message in answer["error"]["message"], answer
    status, _, answer = post(base, "/v1/messages", {"model": "other", "max_tokens": 4, "messages": QUESTION})
    assert status == 404 and answer["error"]["type"] == "not_found_error", answer
