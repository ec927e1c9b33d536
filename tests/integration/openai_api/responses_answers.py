"""OpenAI's Responses API with the official `openai` client (`client.responses`): the same
answer as chat completions, whole and streamed (the SDK's own accumulator gives the whole
call's object), a cut at max_output_tokens, a JSON-schema output, a stored response read
back, continued and deleted, and what it does not take refused by name (tool loops and
tenants: tests/integration/test_openai_tools.py). Collected by test_api.py, on its 1P+1D cluster."""
from __future__ import annotations

import json

import openai
import pytest

from tests.integration.openai_api.calls import MODEL, QUESTION, post

INSTRUCTIONS = "You are a helpful assistant."


def test_a_response_is_the_chat_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": INSTRUCTIONS},
                                                                 *QUESTION], temperature=0, max_tokens=20)
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION[0]["content"],
                                temperature=0, max_output_tokens=20, store=False)
    assert r.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert (r.status, r.object, r.model, r.instructions) == ("completed", "response", MODEL, INSTRUCTIONS)
    assert r.id.startswith("resp_") and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same as input items, streamed: typed events in order, and the SDK's accumulator
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION[0]["content"]}]}]
    with client.responses.stream(model=MODEL, input=items, temperature=0, max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert final.output_text == r.output_text and final.status == "completed"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)


def test_a_cut_at_max_output_tokens_is_an_incomplete_response(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0, max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL, input="Tell me a long story.", temperature=0,
                                 max_output_tokens=4) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


def test_a_json_schema_text_format_shapes_the_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Which city is the capital of France? Answer in JSON.",
                                temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"city"}
    assert r.text.format.type == "json_schema"


def test_a_named_function_tool_choice_is_one_call_whole_and_streamed(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "capital", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}
    args = {"model": MODEL, "input": "Which city is the capital of France?", "tools": [tool], "temperature": 0,
            "tool_choice": {"type": "function", "name": "capital"}, "max_output_tokens": 40, "store": False}
    r = client.responses.create(**args)
    [call] = r.output
    assert (r.status, call.type, call.name) == ("completed", "function_call", "capital")
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == final.output[0].arguments == call.arguments and final.output[0].name == "capital"


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "only function tools"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning", "no thinking switch"),
    ({"input": "hi", "previous_response_id": "resp_1"}, 404, "previous_response_id", "no stored response 'resp_1'"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation", "unknown field 'conversation'"),
    ({"input": []}, 400, "input", "'input'"),
    ({"input": [{"type": "computer_call_output"}]}, 400, "input", "items of type 'computer_call_output'"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input", "input[0].role: Input should be 'user'"),
])
def test_what_the_responses_api_does_not_take_is_refused_by_name(base: str, body: dict, status: int, param: str,
                                                                 message: str) -> None:
    code, _, answer = post(base, "/v1/responses", {"model": MODEL, **body})
    assert code == status and answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_a_stored_response_is_read_back_and_deleted(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION[0]["content"], temperature=0, max_output_tokens=8)
    assert r.store is True
    again = client.responses.retrieve(r.id)
    assert (again.id, again.output_text, again.usage) == (r.id, r.output_text, r.usage)
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, input="And of Italy?", temperature=0,
                                     max_output_tokens=8, store=False)
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens and follow.store is False
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)  # store false: never kept
