"""The OpenAI request shapes: types checked strictly, unsupported fields refused by name, the
mapping onto the router's `Ask`, and the response and chunk shapes."""
from __future__ import annotations

import json

import pytest

from engine.core.request import FinishReason
from proto import generate_pb2 as pb
from router.constraints import AutoToolOutput, ToolCallOutput, ToolPlan, constraint_of, tool_plan
from router.openai_output import Output
from router.reply import Reply, Usage
from router.attempt import Ask
from router.openai_protocol import (BadRequest, ChatRequest, CompletionRequest, ask_of, messages_as_dicts, parse,
                                    prompts_of, sampling_of)


def to_ask(req: ChatRequest | CompletionRequest, client_id: str, prompt: str | list[int],
           max_tokens_default: int | None, constraint: tuple[str, str] | None = None) -> Ask:
    """What the HTTP door hands the router for one prompt of `req`."""
    route = "chat" if isinstance(req, ChatRequest) else "completion"
    return ask_of(req, client_id, prompt, sampling_of(req, max_tokens_default, constraint), route)


def bad(kind, body: dict | bytes) -> BadRequest:  # type: ignore[no-untyped-def]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as e:
        req = parse(kind, raw)
        to_ask(req, "r", [1] if kind is ChatRequest else prompts_of(req.prompt)[0], None, constraint_of(req))
        if kind is ChatRequest:
            messages_as_dicts(req.messages)
            tool_plan(req, None)
    return e.value


@pytest.mark.parametrize(("kind", "body", "param", "message"), [
    (CompletionRequest, {}, "prompt", "'prompt' is required"),
    (ChatRequest, {"model": "m"}, "messages", "'messages' is required"),
    (ChatRequest, {"messages": []}, "messages", "'messages': List should have at least 1 item"),
    (CompletionRequest, {"prompt": 5}, "prompt", "'prompt' must be str or list[int] or list[str] or list[list[int]]"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}, "max_tokens", "'max_tokens': Input should be a valid integer"),
    (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature", "'temperature': Input should be a valid number"),
    (CompletionRequest, {"prompt": "x", "stream": "yes"}, "stream", "'stream': Input should be a valid boolean"),
    (ChatRequest, {"messages": [{"role": "function", "content": "x"}]}, "messages", "'messages.0.role': Input should be"),
    (ChatRequest, {"messages": [{"role": "tool", "content": "x"}]}, "messages",
     "messages[0]: a tool message needs tool_call_id and content"),
    (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages", "messages[0]: a tool call's arguments must be a JSON object"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice",
     "tool_choice needs tools"),
    (ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "'messages[0].content[0]' is a content part of type 'image_url': only text parts are served here"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "y"}, {"type": "input_audio"}]}]}, "messages",
     "'messages[1].content[1]' is a content part of type 'input_audio'"),
    (CompletionRequest, {"prompt": "x", "n": 17}, "n", "n=17: between 1 and 16 choices per request"),
    (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of=1: between n=2 and 16"),
    (CompletionRequest, {"prompt": "x", "best_of": 3, "stream": True}, "best_of", "best_of > n cannot stream"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed with stream=true"),
    (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs=21: at most 20 alternatives per token"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0 returns nothing; send echo=true"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs needs logprobs=true"),
    (CompletionRequest, {"prompt": "x", "seed": -1}, "seed", "'seed' is -1, outside [0, 18446744073709551615]"),
    (CompletionRequest, {"prompt": [1, -2]}, "prompt", "'prompt' holds token ids [-2]"),
    (CompletionRequest, {"prompt": ["a"] * 129}, "prompt", "prompt holds 129 prompts; at most 128 per request"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys are token ids"),
    (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens", "'min_tokens' is -1"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 30}, "prompt_logprobs",
     "prompt_logprobs=30: at most 20"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format", "response_format type must be text, json_object or json_schema, got 'xml'"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format", "response_format json_schema needs json_schema.schema"),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "structured_outputs must set exactly one of json, json_object, regex, choice, grammar"),
    (CompletionRequest, {"prompt": "x", "guided_choice": []}, "guided_choice", "choice is a non-empty list"),
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", "response_format and guided_regex both constrain the output"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice", 'tool_choice "auto" needs the model\'s tool-call format'),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "any"}, "tool_choice", 'tool_choice must be "none", "auto", "required"'),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "tool_choice names 'g', which is not among the tools (f)"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice",
     "tool_choice names None, which is not among the tools (f)"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice",
     "tool_choice names ['f'], which is not among the tools (f)"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}],
      "tool_choice": "required"}, "tools", "tools[0] must be"),
    (CompletionRequest, b"{bad", None, "the body is not valid JSON in UTF-8"),
    (CompletionRequest, b'{"prompt": "\xff"}', None, "the body is not valid JSON in UTF-8"),
    (CompletionRequest, b"[1, 2]", None, "the body must be a JSON object"),
])
def test_bad_requests_name_the_field(kind, body, param, message) -> None:  # type: ignore[no-untyped-def]
    e = bad(kind, body)
    assert e.param == param and message in e.message, (e.param, e.message)


def test_a_completion_maps_onto_the_router_s_request() -> None:
    req = parse(CompletionRequest, json.dumps({
        "model": "m", "prompt": "Hello", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 3,
        "stop": "\n", "stop_token_ids": [2], "ignore_eos": True, "user": "acme", "priority": -2, "logprobs": 0,
        "store": True, "frequency_penalty": 0}).encode())
    g = to_ask(req, "cmpl-1", prompts_of(req.prompt)[0], None)
    assert (g.prompt, g.client_id, g.tenant, g.priority, g.route) == ("Hello", "cmpl-1", "acme", -2, "completion")
    s = g.params
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.5, 0.9, 0, 3)
    assert s.stop == ("\n",) and s.stop_token_ids == (2,) and s.ignore_eos and s.logprobs
    [one] = prompts_of(parse(CompletionRequest, b'{"prompt": [[5, 6, 7]]}').prompt)
    ids = to_ask(parse(CompletionRequest, b'{"prompt": [[5, 6, 7]]}'), "r", one, None)
    assert ids.prompt == [5, 6, 7] and ids.params.max_tokens == 16 and ids.params.temperature == 1.0


def test_a_chat_request_takes_the_rendered_prompt_and_max_completion_tokens() -> None:
    req = parse(ChatRequest, json.dumps({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 9}).encode())
    assert messages_as_dicts(req.messages) == [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}]
    g = to_ask(req, "chatcmpl-1", [1, 2, 3], 100)
    assert g.prompt == [1, 2, 3] and g.params.max_tokens == 9 and g.route == "chat"
    assert to_ask(parse(ChatRequest, b'{"messages": [{"role": "user"}]}'), "r", [1], 100).params.max_tokens == 100


def _responses() -> list[Reply]:
    return [Reply("r", token_ids=[10], text="Hi", logprobs=[-0.5]),
            Reply("r", token_ids=[11], text="", logprobs=[-1.0]),  # half a character: no chunk
            Reply("r", token_ids=[12], text=" there", logprobs=[-0.25], finish_reason=FinishReason.STOP),
            Reply("r", finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, cached_tokens=2,
                                                                    completion_tokens=3))]


def test_chat_output_whole_and_as_chunks() -> None:
    out = Output("chat", "chatcmpl-1", "m", include_logprobs=False)
    chunks = []
    for i, r in enumerate(_responses()):
        out.add(r)
        chunks.append(out.chunk(r, first=i == 0))
    assert [c and c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Hi"}, None, {"content": " there"}, {}]
    assert [c and c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks if c)
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}
    assert out.chunk(None) == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": out.created,
                               "model": "m", "choices": [], "usage": usage}
    whole = out.whole()
    assert whole["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "Hi there"}}]
    assert whole["usage"] == usage and whole["object"] == "chat.completion"


def test_completion_output_with_logprobs_and_token_ids() -> None:
    out = Output("completion", "cmpl-1", "m", include_logprobs=True, token_text=lambda t: f"<{t}>",
                 return_token_ids=True)
    for r in _responses():
        out.add(r)
    choice = out.whole()["choices"][0]
    assert choice["text"] == "Hi there" and choice["token_ids"] == [10, 11, 12] and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"tokens": ["<10>", "<11>", "<12>"], "token_logprobs": [-0.5, -1.0, -0.25],
                                  "top_logprobs": None, "text_offset": [0, 4, 8]}


@pytest.mark.parametrize(("fields", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                 "schema": {"type": "object"}}}},
     "json_schema", '{"type": "object"}'),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json_schema", '{"type": "integer"}'),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"response_format": {"type": "text"}}, "", ""),
])
def test_each_way_of_asking_for_structured_output_maps_onto_one_constraint(fields, kind, value) -> None:  # type: ignore[no-untyped-def]
    req = parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode())
    c = to_ask(req, "chat-1", [1, 2], 16, constraint_of(req)).params.constraint
    assert ((c.kind, c.value) if c is not None else ("", "")) == (kind, value)


def tool_output(plan: ToolPlan, texts: list[str], kind: type = ToolCallOutput,
                finish: FinishReason = FinishReason.STOP) -> tuple[dict, list[dict]]:
    """The whole answer and the stream chunks of a tool call whose text came as `texts`."""
    whole, streamed = (kind("chat", "chatcmpl-1", "m", False, plan=plan) for _ in range(2))
    chunks = []
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        r = Reply("r", text=t, token_ids=[i], finish_reason=finish if last else None,
                  usage=Usage(0, 0, len(texts)) if last else None)
        whole.add(r)
        streamed.add(r)
        if (c := streamed.chunk(r, i == 0)) is not None:
            chunks.append(c)
    return whole.whole(), chunks


def test_a_named_tool_call_is_openais_tool_calls_shape_whole_and_streamed() -> None:
    whole, chunks = tool_output(ToolPlan("named", name="get_weather"), ['{"city": ', '"Paris"', "}"])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _tools_request(choice: object, parallel: bool = True) -> ChatRequest:
    return parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
                                          "parallel_tool_calls": parallel,
                                          "tools": [{"type": "function", "function": {"name": n, "parameters": {
                                              "type": "object", "properties": {"q": {"type": "string"}}}}}
                                                    for n in ("search", "lookup")]}).encode())


def test_required_tool_calls_are_a_list_of_the_tools_the_model_chose() -> None:
    plan = tool_plan(_tools_request("required"), None)
    assert plan is not None and plan.constraint is not None
    kind, value = plan.constraint
    schema = json.loads(value)
    assert kind == "json_schema" and schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [a["properties"]["name"] for a in schema["items"]["anyOf"]] == [{"const": "search"}, {"const": "lookup"}]
    whole, chunks = tool_output(plan, ['[{"name": "lookup", ', '"arguments": {"q": "x"}}, ',
                                       '{"name": "search", "arguments": {"q": "y"}}]'])
    assert [c["function"] for c in whole["choices"][0]["message"]["tool_calls"]] == [
        {"name": "lookup", "arguments": '{"q": "x"}'}, {"name": "search", "arguments": '{"q": "y"}'}]
    assert [c["index"] for c in chunks[-1]["choices"][0]["delta"]["tool_calls"]] == [0, 1]
    one = tool_plan(_tools_request("required", parallel=False), None)
    assert one is not None and one.constraint is not None and json.loads(one.constraint[1])["maxItems"] == 1


def test_required_tool_calls_cut_short_keep_the_calls_they_closed() -> None:
    """max_tokens cuts the list in its second call: the first comes back whole, the second,
    with neither a name nor arguments a client could run, is left out; cut in the first, there
    is no call. The finish reason, length, says the answer was cut."""
    plan = tool_plan(_tools_request("required"), None)
    assert plan is not None
    cut = ['[{"name": "lookup", ', '"arguments": {"q": "x"}}, ', '{"name": "search", "arguments": {"q": "y']
    whole, chunks = tool_output(plan, cut, finish=FinishReason.LENGTH)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "lookup", "arguments": '{"q": "x"}'}]
    assert [(c["index"], c["function"]["name"]) for c in chunks[-1]["choices"][0]["delta"]["tool_calls"]] == [
        (0, "lookup")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole, chunks = tool_output(plan, ['[{"name": "lookup", "argu'], finish=FinishReason.LENGTH)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)


def test_auto_reads_content_and_parallel_calls_out_of_the_model_s_text_whole_and_streamed() -> None:
    plan = tool_plan(_tools_request("auto"), "hermes")
    assert plan is not None and plan.mode == "auto" and plan.constraint is None
    texts = ["Let me", " check.\n", "<tool", "_call>\n{\"name\": \"search\", ", "\"arguments\": {\"q\": \"a\"}}",
             "\n</tool_call>\n<tool_call>\n", "{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"]
    whole, chunks = tool_output(plan, texts, AutoToolOutput)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me check." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "search", "arguments": '{"q": "a"}'},
                                                               {"name": "lookup", "arguments": "{}"}]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls: dict[int, dict] = {}
    for d in deltas:  # assembled as the OpenAI SDK assembles them
        for c in d.get("tool_calls", []):
            got = calls.setdefault(c["index"], {"id": c.get("id"), "name": "", "arguments": ""})
            got["name"] += c.get("function", {}).get("name", "")
            got["arguments"] += c["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("search", '{"q": "a"}'), ("lookup", "{}")]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # cut by max_tokens, the calls so far are sent and the finish reason stays length
    cut, _ = tool_output(plan, texts[:5], AutoToolOutput, FinishReason.LENGTH)
    assert cut["choices"][0]["finish_reason"] == "length"
    # an answer without calls is content
    plain, _ = tool_output(plan, ["Paris", " is the capital."], AutoToolOutput)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Paris is the capital."}
    assert plain["choices"][0]["finish_reason"] == "stop"
    # parallel_tool_calls false: the first call only
    first, _ = tool_output(tool_plan(_tools_request("auto", parallel=False), "hermes"), texts, AutoToolOutput)
    assert [c["function"]["name"] for c in first["choices"][0]["message"]["tool_calls"]] == ["search"]


def test_tool_messages_and_an_assistant_s_calls_reach_the_template_as_transformers_takes_them() -> None:
    req = parse(ChatRequest, json.dumps({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}).encode())
    assert messages_as_dicts(req.messages) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


def test_the_sampling_controls_map_onto_the_engine_s_sampling() -> None:
    req = parse(CompletionRequest, json.dumps({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25,
                                               "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3,
                                               "logit_bias": {"7": -100, "42": 2.5}}).encode())
    s = to_ask(req, "r", "x", None).params
    assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.min_tokens) == (0.5, -0.25, 0.05, 3)
    assert s.repetition_penalty == 1.2 and s.logit_bias == ((7, -100.0), (42, 2.5))
    plain = to_ask(parse(CompletionRequest, b'{"prompt": "x"}'), "r", "x", None).params
    assert plain.repetition_penalty == 1.0 and not plain.logit_bias and plain.min_tokens == 0


def test_echo_with_logprobs_and_max_tokens_0_is_the_shape_lm_eval_scores() -> None:
    """lm-evaluation-harness's log-likelihood request: echo, logprobs 1, max_tokens 0 (the
    prompt's per-token logprobs and top alternatives, nothing generated): it reads
    token_logprobs[ctxlen:] and checks each against max(top_logprobs[i].values())."""
    req = parse(CompletionRequest, json.dumps({"prompt": [5, 6, 7], "echo": True, "logprobs": 1,
                                               "max_tokens": 0, "temperature": 0}).encode())
    s = to_ask(req, "r", [5, 6, 7], None).params
    assert (s.max_tokens, s.logprobs, s.top_logprobs, s.prompt_logprobs) == (1, True, 1, 1)
    out = Output("completion", "cmpl-1", "m", include_logprobs=True, token_text=lambda t: f"<{t}>",
                 prompt_ids=[5, 6, 7], echo="<5><6><7>", hide=True, num_top=1)
    r = Reply("r", token_ids=[9], text="<9>", logprobs=[-0.1], top_logprobs=[pb.TopLogprobs(
        token_ids=[9], logprobs=[-0.1])], finish_reason=FinishReason.LENGTH, prompt_logprobs=pb.PromptLogprobs(
        logprobs=[-2.0, -0.5], ranks=[3, 1], top=[pb.TopLogprobs(token_ids=[8], logprobs=[-1.0]),
                                                  pb.TopLogprobs(token_ids=[7], logprobs=[-0.5])]))
    r.usage = Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=1)
    out.add(r)
    choice = out.whole()["choices"][0]
    assert choice["text"] == "<5><6><7>"  # the prompt, and nothing generated
    assert choice["logprobs"] == {"tokens": ["<5>", "<6>", "<7>"], "token_logprobs": [None, -2.0, -0.5],
                                  "top_logprobs": [None, {"<8>": -1.0}, {"<7>": -0.5}], "text_offset": [0, 3, 6]}
    assert out.whole()["usage"]["completion_tokens"] == 0
    greedy = [lp == max(top.values()) for lp, top in zip(choice["logprobs"]["token_logprobs"][1:],
                                                         choice["logprobs"]["top_logprobs"][1:], strict=True)]
    assert greedy == [False, True]


def test_chat_top_logprobs_and_vllm_prompt_logprobs() -> None:
    out = Output("chat", "chatcmpl-1", "m", include_logprobs=True, token_text=lambda t: f"<{t}>",
                 prompt_ids=[1, 2], prompt_logprobs=1)
    r = Reply("r", token_ids=[4], text="<4>", logprobs=[-0.3], finish_reason=FinishReason.STOP,
                            top_logprobs=[pb.TopLogprobs(token_ids=[4, 5], logprobs=[-0.3, -1.5])],
                            prompt_logprobs=pb.PromptLogprobs(logprobs=[-4.0], ranks=[7], top=[pb.TopLogprobs(
                                token_ids=[3], logprobs=[-0.2])]))
    r.usage = Usage(prompt_tokens=2, cached_tokens=0, completion_tokens=1)
    out.add(r)
    choice = out.whole()["choices"][0]
    [entry] = choice["logprobs"]["content"]
    assert entry["token"] == "<4>" and entry["logprob"] == pytest.approx(-0.3)
    assert [(t["token"], round(t["logprob"], 3)) for t in entry["top_logprobs"]] == [("<4>", -0.3), ("<5>", -1.5)]
    assert choice["prompt_logprobs"] == [None, {"3": {"logprob": pytest.approx(-0.2), "rank": 1, "decoded_token": "<3>"},
                                                "2": {"logprob": -4.0, "rank": 7, "decoded_token": "<2>"}}]


def test_an_unknown_field_is_refused_by_name_and_openai_s_own_no_op_fields_are_ignored() -> None:
    with pytest.raises(BadRequest, match="unknown field 'length_penalty'") as e:
        parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                       "length_penalty": True, "store": True}).encode())
    assert e.value.param == "length_penalty"
    req = parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x", "refusal": None},
                                                      {"role": "assistant", "content": "y", "annotations": []}],
                                         "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                                         "modalities": ["text"]}).encode())
    assert len(req.messages) == 2  # fields OpenAI's responses carry, sent back with a conversation
    with pytest.raises(BadRequest, match="modalities"):
        to_ask(parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                   "modalities": ["text", "audio"]}).encode()), "r", [1], 4)
    with pytest.raises(BadRequest, match="unknown field 'suffixes'"):
        parse(CompletionRequest, b'{"prompt": "x", "suffixes": 1}')


def test_continuing_the_final_message_opens_no_generation_prompt() -> None:
    from router.openai_protocol import prompt_end

    def chat(**fields: object) -> ChatRequest:
        return parse(ChatRequest, json.dumps({"messages": [{"role": "assistant", "content": "x"}], **fields}).encode())

    assert prompt_end(chat()) == (True, False)
    assert prompt_end(chat(add_generation_prompt=False)) == (False, False)
    assert prompt_end(chat(continue_final_message=True)) == (False, True)  # the default generation prompt yields
    assert prompt_end(chat(continue_final_message=True, add_generation_prompt=False)) == (False, True)
    with pytest.raises(BadRequest, match="send one of them") as e:
        prompt_end(chat(continue_final_message=True, add_generation_prompt=True))
    assert e.value.param == "continue_final_message"


def test_a_calls_arguments_hold_only_the_properties_its_function_names() -> None:
    """Constrained calls (named, required) close every object schema that lists its properties
    and says nothing of others, as xgrammar's strict mode (vLLM's default) reads them; schemas
    that say, compose or refer stay open; the request's own tools are not changed."""
    from router.constraints import closed

    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    params = {"type": "object", "properties": {"at": point, "path": {"type": "array", "items": point},
                                               "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                                               "either": {"anyOf": [point, {"type": "string"}]},
                                               "mixed": {"properties": {"a": {}}, "oneOf": [{"properties": {"b": {}}}]},
                                               "ref": {"$ref": "#/$defs/p"}},
              "$defs": {"p": point}}
    shut = closed(params)
    assert shut["additionalProperties"] is False
    props = shut["properties"]
    assert props["at"]["additionalProperties"] is False and props["path"]["items"]["additionalProperties"] is False
    assert props["tags"] == params["properties"]["tags"]  # it says what else it holds
    assert props["either"]["anyOf"][0]["additionalProperties"] is False  # alternatives alone: each closed
    assert props["mixed"] == params["properties"]["mixed"]  # composed: the branch adds properties
    assert props["ref"] == {"$ref": "#/$defs/p"} and shut["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in params and "additionalProperties" not in point  # not changed
    assert closed({"type": "object"}) == {"type": "object"}  # any object: nothing listed, nothing closed
    plan = tool_plan(_tools_request({"type": "function", "function": {"name": "search"}}), None)
    assert plan is not None and plan.constraint is not None
    assert json.loads(plan.constraint[1])["additionalProperties"] is False
    required = tool_plan(_tools_request("required"), None)
    assert required is not None and required.constraint is not None
    arguments = [a["properties"]["arguments"] for a in json.loads(required.constraint[1])["items"]["anyOf"]]
    assert all(a["additionalProperties"] is False for a in arguments)
