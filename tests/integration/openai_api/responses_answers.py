"""OpenAI's Responses API with the official `openai` client (`client.responses`): the same
answer as chat completions, whole and streamed (the SDK's own accumulator gives the whole
call's object), a cut at max_output_tokens, a JSON-schema output, and what is not done yet
refused by name. Collected by test_api.py, on its 1P+1D cluster."""
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


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
     "unknown field 'tools'"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "unknown field 'previous_response_id'"),
    ({"input": "hi", "store": True}, "store", "stored responses (and previous_response_id) are not implemented yet"),
    ({"input": []}, "input", "'input'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "'input"),
])
def test_what_the_responses_api_does_not_take_yet_is_refused_by_name(base: str, body: dict, param: str,
                                                                      message: str) -> None:
    status, _, answer = post(base, "/v1/responses", {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer
