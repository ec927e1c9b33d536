"""The OpenAI HTTP API end to end, with the official `openai` client: answers equal to
transformers, streaming, stop strings, the side endpoints, errors in OpenAI's shape, overload,
disconnects, metrics shared with gRPC, structured output and tool calls; and the sampling
answers of sampling_answers.py (log-probabilities, choices, seeds) and the Responses API's of
responses_answers.py, on the same cluster."""
from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from tests.integration.cluster_checks import assert_idle
from tests.integration.openai_api.calls import MODEL, QUESTION, grpc_generate, open_stream, post
from tests.integration.openai_api.messages_answers import (  # noqa: F401 (collected here, on this module's cluster)
    test_a_cut_at_max_tokens_and_a_stop_sequence_say_why_they_stopped,
    test_a_final_assistant_message_is_continued_as_a_prefill, test_count_tokens_is_what_the_message_takes,
    test_a_message_is_the_chat_answer_whole_and_streamed,
    test_a_named_tool_is_one_tool_use, test_bad_input_is_a_400_in_anthropic_s_shape)
from tests.integration.openai_api.responses_answers import (  # noqa: F401 (collected here, on this module's cluster)
    test_a_cut_at_max_output_tokens_is_an_incomplete_response, test_a_json_schema_text_format_shapes_the_output,
    test_a_response_is_the_chat_answer_whole_and_streamed,
    test_a_named_function_tool_choice_is_one_call_whole_and_streamed,
    test_a_stored_response_is_read_back_and_deleted, test_what_the_responses_api_does_not_take_is_refused_by_name)
from tests.integration.openai_api.sampling_answers import (  # noqa: F401 (collected here, on this module's cluster)
    test_best_of_returns_the_n_likeliest_of_its_choices, test_completions_equal_the_grpc_path,
    test_n_choices_are_seed_plus_i_alone_and_count_the_prompt_once, test_prompt_and_output_logprobs_equal_transformers,
    test_sampling_controls_over_http_equal_the_grpc_path, test_seeded_sampling_equals_the_grpc_path_and_repeats,
    test_several_prompts_in_one_completions_request_are_choices_by_index)
from tests.integration.test_metrics import scrape, total

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(900)


def test_chat_answers_and_greedy_tokens_equal_transformers_on_the_gguf(client: openai.OpenAI, base: str,
                                                                       hf_gguf) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert abs(r.created - time.time()) < 120 and r.model == MODEL
    status, _, tok = post(base, "/tokenize", {"messages": QUESTION})
    assert status == 200 and r.usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    with torch.inference_mode():
        out = hf_gguf.generate(torch.tensor([tok["tokens"]]), do_sample=False, max_new_tokens=20)
    want = out[0, len(tok["tokens"]):].tolist()
    got = r.choices[0].model_extra["token_ids"]
    assert got == want  # the same tokens, EOS included
    assert r.usage.completion_tokens == len(want)
    # a longer greedy run with EOS ignored, over the completions endpoint with token ids
    prompt = tok["tokens"]
    c = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=32,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    with torch.inference_mode():
        out = hf_gguf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, eos_token_id=None)
    assert c.choices[0].model_extra["token_ids"] == out[0, len(prompt):].tolist()
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 32


def test_an_assistant_turn_begun_by_the_client_is_continued(client: openai.OpenAI, base: str, smollm2_dir: str,
                                                            hf_gguf) -> None:  # type: ignore[no-untyped-def]
    """vLLM's continue_final_message: the prompt ends inside the final (assistant) message,
    tokenized as transformers' apply_chat_template(continue_final_message=True) tokenizes it,
    and the answer is the rest of that message, greedy as transformers writes it."""
    from transformers import AutoTokenizer

    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    want_prompt = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        begun, add_generation_prompt=False, continue_final_message=True, tokenize=True, return_dict=False)
    status, _, tok = post(base, "/tokenize", {"messages": begun, "continue_final_message": True})
    assert status == 200 and tok["tokens"] == list(want_prompt)
    kw: dict = {"model": MODEL, "messages": begun, "temperature": 0, "max_tokens": 8, "extra_body": {
        "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}}
    r = client.chat.completions.create(**kw)
    with torch.inference_mode():
        out = hf_gguf.generate(torch.tensor([want_prompt]), do_sample=False, max_new_tokens=8)
    assert r.usage.prompt_tokens == len(want_prompt)
    assert r.choices[0].model_extra["token_ids"] == out[0, len(want_prompt):].tolist()
    assert r.choices[0].message.content.startswith(" Paris")
    status, _, answer = post(base, "/v1/chat/completions", {"messages": begun, "continue_final_message": True,
                                                            "add_generation_prompt": True})
    assert status == 400 and answer["error"]["param"] == "continue_final_message"


def test_streamed_chat_and_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one sentence. " * 3},
                {"role": "user", "content": "Why is the sky blue?"}]
    usages = []
    for _ in range(2):
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
        usages.append(chunks[-1].usage)
    prompt_tokens = usages[0].prompt_tokens
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    # the repeat hits the prefix cache: every full block of the prompt but the last token's
    assert usages[1].prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0


def test_stop_strings_logprobs_and_the_default_length(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, logprobs=True)
    assert full.choices[0].message.content == "The capital of France is Paris."  # no max_tokens: ends at EOS
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens and content[0].token == "The"
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=[" Paris", "xyz"])
    assert cut.choices[0].message.content == "The capital of France is" and cut.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=["xyz", " Par"],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is Par" and kept.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=[" Par"],
                                              stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "The capital of France is Par"
    short = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16 and short.choices[0].finish_reason == "length"  # OpenAI's default 16


def test_a_clients_request_id_names_its_response(client: openai.OpenAI) -> None:
    """vLLM's: the response's id is the client's request_id under the API's prefix."""
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                          extra_body={"request_id": "trace-42"})
    text = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "trace-43"})
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert (chat.id, text.id) == ("chatcmpl-trace-42", "cmpl-trace-43") and len(plain.id) == len("cmpl-") + 32


def test_models_health_version_tokenize_detokenize(base: str, cluster: LocalCluster) -> None:
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 8192 and models["data"][0]["owned_by"] == "splitserve"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).model_dump(exclude_none=True) == {
        k: v for k, v in models["data"][0].items() if v is not None}
    with pytest.raises(openai.NotFoundError, match="does not exist; this server serves"):
        client.models.retrieve("org/other-model")
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(base + "/version", timeout=10) as r:
        assert json.loads(r.read())["version"] == "0.1.0"
    status, _, tok = post(base, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and tok["count"] == 2 and tok["max_model_len"] == 8192
    status, _, text = post(base, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert status == 200 and text == {"prompt": "Hello world"}
    status, _, err = post(base, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and "outside the model's vocabulary" in err["error"]["message"]


def _error(status: int, body: dict, expected_status: int, message: str) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert message in body["error"]["message"], body


def test_bad_requests_get_4xx_in_openai_shape_and_leave_nothing_held(base: str, cluster: LocalCluster) -> None:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    cases = [
        (comp, {"model": MODEL}, 400, "'prompt' is required"),
        (chat, {"model": MODEL}, 400, "'messages' is required"),
        (comp, {"prompt": "x", "max_tokens": "ten"}, 400, "'max_tokens': Input should be a valid integer"),
        (chat, {"messages": "hi"}, 400, "'messages': Input should be a valid array"),
        (comp, {"prompt": "x", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
        (comp, {"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
        (comp, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be at least 1"),
        (comp, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens=0 returns nothing; send echo=true"),
        (comp, {"prompt": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist; this server serves 'smollm2'"),
        (comp, {"prompt": [5] * 8192}, 400, "prompt has 8192 tokens; the model's context is 8192 tokens"),
        (chat, {"messages": [{"role": "user", "content": "word " * 4000}]}, 400,  # rendered off the loop
         "KV blocks; the largest decode worker holds 91"),
        (comp, b'{"prompt": "x",', 400, "the body is not valid JSON in UTF-8"),
        (comp, b'{"prompt": "\xff\xfe"}', 400, "the body is not valid JSON in UTF-8"),
        (comp, {"prompt": "x", "n": 17}, 400, "n=17: between 1 and 16 choices per request"),
        (chat, {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n=0: between 1 and 16"),
        (comp, {"prompt": "x", "user": "bad\ntenant"}, 400, "tenant must be at most 128 printable characters"),
        (comp, {"prompt": "x", "priority": 99}, 400, "priority must be in [-8, 8]"),
        (comp, b'{"prompt": "' + b"a" * (20 << 20) + b'"}', 413, "the request body is larger than 16777216 bytes"),
    ]
    for path, body, want, message in cases:
        status, _, answer = post(base, path, body)
        _error(status, answer, want, message)
    status, _, answer = post(base, "/v1/nothing", {})
    _error(status, answer, 404, "POST /v1/nothing: Not Found")
    with urllib.request.urlopen(base + "/health", timeout=10) as r:  # still healthy
        assert r.status == 200
    assert cluster.holdings() == []


def test_the_openai_client_raises_its_own_error_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n=30"):
        client.completions.create(model=MODEL, prompt="x", n=30)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=QUESTION)


def test_overload_is_429_with_retry_after(base: str, cluster: LocalCluster) -> None:
    """A long request holds most of the decode pool's KV budget; of the requests that cannot
    be admitted beside it, one may queue (max_queued_per_priority 1), the rest are refused at once."""
    hold, held = open_stream(cluster.info["http_address"], "/v1/completions",
                             {"prompt": "Tell me a long story.", "max_tokens": 1200, "temperature": 0,
                              "ignore_eos": True})
    assert held.status == 200  # admitted and streaming
    body = {"prompt": "Count to one hundred.", "max_tokens": 300, "ignore_eos": True}

    def one(_: int) -> tuple[int, dict, dict]:
        """The answer's status, headers and JSON: a refusal's error, or an admitted one's first chunk
        (then the connection closes, which aborts the rest: its 300 tokens took 60-84 s on this machine)."""
        conn = None
        try:
            conn, r = open_stream(cluster.info["http_address"], "/v1/completions", body, timeout=120)
            if r.status != 200:
                return r.status, dict(r.getheaders()), json.loads(r.read())
            while not (line := r.readline()).startswith(b"data: {"):
                assert line, "the stream ended before its first chunk"
            return r.status, dict(r.getheaders()), json.loads(line[len(b"data: "):])
        except (TimeoutError, OSError) as e:
            return 0, {}, {"error": repr(e)}
        finally:
            if conn is not None:
                conn.close()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(4)]
        try:  # the refused come back at once (and any that fitted, once it streams): all but the queued one
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # time for a fourth answer, were the queued one not held in the queue
            done = [f.result() for f in futures if f.done()]
            waiting = [f for f in futures if not f.done()]  # the queued one: it waits for the long request
        finally:
            hold.close()  # the long request's client goes away: the queued one is admitted and runs
        assert len(waiting) == 1, done  # max_queued_per_priority 1
        queued = [f.result(timeout=130) for f in waiting]
    assert [status for status, _, _ in queued] == [200], queued
    assert queued[0][2]["object"] == "text_completion" and queued[0][2]["choices"][0]["index"] == 0, queued
    refused = [r for r in done if r[0] != 200]  # any other fitted beside the long one and ran
    assert len(refused) >= 2, done
    for status, headers, answer in refused:
        _error(status, answer, 429, "")
        assert int(headers["Retry-After"]) >= 1 and answer["error"]["type"] == "rate_limit_error"


def test_a_client_disconnecting_mid_stream_frees_every_block(base: str, cluster: LocalCluster) -> None:
    """Each door's request whose client goes mid-stream frees everything and is counted as
    aborted (`request_success_total{finished_reason="abort"}`, as vLLM counts it)."""
    poem = [{"role": "user", "content": "Write a long poem about rivers."}]
    address = cluster.router_stats()[0]["metrics_address"]
    before = scrape(address)
    for path, body in (("/v1/completions", {"prompt": "Write a poem about rivers.", "max_tokens": 1000,
                                            "ignore_eos": True}),
                       ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1000, "ignore_eos": True}),
                       ("/v1/responses", {"input": poem, "max_output_tokens": 1000, "store": False}),
                       ("/v1/messages", {"messages": poem, "max_tokens": 1000})):
        conn, response = open_stream(cluster.info["http_address"], path, {**body, "temperature": 0})
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        seen = b""
        while seen.count(b"data: ") < 6:  # past the agent APIs' opening events: tokens are coming
            seen += response.read1(4096)
        conn.sock.close()  # gone mid-stream, with hundreds of tokens to go
        conn.close()
        assert_idle(cluster, timeout_s=20)  # every block on P and D freed, nothing admitted at the router
    stats = cluster.router_stats()[0]
    assert stats["num_admitted"] == 0
    after, name = scrape(address), "splitserve:request_success_total"
    assert total(after, name, finished_reason="abort") - total(before, name, finished_reason="abort") == 4


def test_http_and_grpc_requests_count_in_the_same_prometheus_series(client: openai.OpenAI, stub, base: str,
                                                                    cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    address = cluster.router_stats()[0]["metrics_address"]
    before = scrape(address)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    grpc_generate(stub, "Hello", max_tokens=3, ignore_eos=True)
    # the agent APIs' streams close after their last reply (they used to go uncounted): ended, not aborted
    for path, body in (("/v1/responses", {"input": "Hello", "max_output_tokens": 3, "store": False}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})):
        conn, response = open_stream(cluster.info["http_address"], path, {"model": MODEL, "temperature": 0, **body})
        events = response.read().decode()
        conn.close()
        assert response.status == 200 and ("response.incomplete" in events or "message_stop" in events), events
    after = scrape(address)
    name = "splitserve:request_success_total"
    assert total(after, name, finished_reason="length") - total(before, name, finished_reason="length") == 4
    assert total(after, name, finished_reason="abort") == total(before, name, finished_reason="abort")
    tokens = "splitserve:generation_tokens_total"
    assert total(after, tokens) - total(before, tokens) == 12


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 40}}}


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_structured_chat_output_parses_and_follows_its_schema(client: openai.OpenAI, temperature: float) -> None:
    import jsonschema

    ask = [{"role": "user", "content": "Invent a person: their name, age and city, as JSON."}]
    for response_format in ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
                            {"type": "json_object"}):
        for seed in (1, 2):
            r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200, temperature=temperature,
                                               seed=seed, response_format=response_format)  # type: ignore[arg-type]
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            value = json.loads(choice.message.content or "")
            assert isinstance(value, dict)
            if response_format["type"] == "json_schema":
                jsonschema.validate(value, PERSON)


def test_structured_completions_choice_regex_and_grammar_over_http_and_grpc(client: openai.OpenAI, stub) -> None:  # type: ignore[no-untyped-def]
    import re

    prompt = "Q: Is the sky blue? Answer yes or no.\nA:"
    for extra, check in (({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": r" [0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r" [0-9]{3}-[0-9]{4}", t)),
                         ({"guided_grammar": 'root ::= " " ("yes" | "no") "."'}, lambda t: t in (" yes.", " no."))):
        for temperature in (0.0, 1.0):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=temperature,
                                          seed=3, extra_body=extra)
            assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (extra, r.choices[0].text)
    sampling = pb.SamplingParams(max_tokens=30, temperature=1.0, seed=4,
                                 constraint=pb.Constraint(kind="regex", value=r"[A-Z][a-z]+ [0-9]{2}"))
    text = "".join(x.text for x in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=60))
    assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", text), text


def test_a_bad_schema_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "strang"}}}}})  # type: ignore[arg-type]
    assert e.value.status_code == 400 and "Invalid type: strang" in str(e.value)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string", "maxLength": 30}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_named_and_required_come_back_as_tool_calls(client: openai.OpenAI, stream: bool) -> None:
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kw = dict(model=MODEL, messages=ask, max_tokens=80, temperature=0.0, tools=[WEATHER, TIME],
                  tool_choice=tool_choice, parallel_tool_calls=False)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
                choice = chunk.choices[0]
                finish = choice.finish_reason or finish
                for c in choice.delta.tool_calls or []:
                    call = calls.setdefault(c.index, {"name": "", "arguments": ""})
                    call["name"] += c.function.name or "" if c.function else ""
                    call["arguments"] += c.function.arguments or "" if c.function else ""
            [call] = calls.values()
        else:
            r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
            finish = r.choices[0].finish_reason
            assert r.choices[0].message.content is None
            [tc] = r.choices[0].message.tool_calls
            call = {"name": tc.function.name, "arguments": tc.function.arguments}
        assert finish == "tool_calls"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
        if isinstance(tool_choice, dict):
            assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
