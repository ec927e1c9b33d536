"""Agent loops through the OpenAI API with the official `openai` client: automatic tool calls
read out of the model's own text (the hermes parser the chat template implies), parallel
calls, tool results sent back, the final answer, the model's thinking as `reasoning_content`
(the qwen3 reasoning parser the template implies; off with `enable_thinking: false`); whole
and streamed, through chat completions, the Responses API (its items, its stored
responses and `previous_response_id`) and Anthropic's Messages API (with Anthropic's client),
on a real cluster (Ray actors, redis-server, two
router replicas behind one port with API keys of two tenants, 1 prefill + 1 decode worker,
disaggregated). The model is the scripted checkpoint of tests/integration/scripted_model.py:
its greedy answers are a Qwen3-style script, so the loop is exact."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from router.api_keys import ApiKeys
from cluster.local import LocalCluster
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.scripted_model import ANSWER, THOUGHT, make_scripted_model

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

MODEL = "scripted"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris and the time there?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
RESULTS = {"get_weather": "sunny, 18 C", "get_time": "14:05"}
KEYS = {"acme": "acme-key-0123456789", "globex": "globex-key-0123456789"}
"""Two tenants' API keys: a stored response is its tenant's alone."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted"))


@pytest.fixture(scope="module")
def cluster(model_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, num_routers=2, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=model_dir,
                            routing=RoutingConfig(mode="disaggregated"),
                            api_keys=ApiKeys.parse(f"{key}:{tenant}" for tenant, key in KEYS.items())))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> openai.OpenAI:  # type: ignore[misc]
    yield connect(cluster)
    assert_idle(cluster)


def connect(cluster: LocalCluster, tenant: str = "acme") -> openai.OpenAI:
    """A client on a connection of its own (the kernel picks the router replica it reaches)."""
    return openai.OpenAI(base_url=f"http://{cluster.info['http_address']}/v1", api_key=KEYS[tenant], max_retries=0,
                         timeout=120)


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, **kw: Any) -> dict[str, Any]:
    """One turn as a plain dict: content, tool calls (id, name, arguments) and finish reason;
    a stream assembled from its deltas as the SDK's users assemble them."""
    args = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0.0, "max_tokens": 40, **kw}
    if not stream:
        r = client.chat.completions.create(**args)  # type: ignore[call-overload]
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return {"reasoning": getattr(m, "reasoning_content", None), "content": m.content, "calls": calls,
                "finish": r.choices[0].finish_reason}
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):  # type: ignore[call-overload]
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            got = calls.setdefault(c.index, ["", "", ""])
            got[0] += c.id or ""
            got[1] += (c.function.name or "") if c.function else ""
            got[2] += (c.function.arguments or "") if c.function else ""
    return {"reasoning": reasoning or None, "content": content or None, "calls": [tuple(c) for c in calls.values()],
            "finish": finish}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_agent_loop_with_parallel_calls(client: openai.OpenAI, stream: bool, thinking: bool) -> None:
    kw = {} if thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    first = _ask(client, ASK, stream, **kw)
    assert first["reasoning"] == (THOUGHT if thinking else None)
    assert first["content"] == "Let me check." and first["finish"] == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in first["calls"]] == CALLS
    assert all(cid.startswith("call_") for cid, _, _ in first["calls"]) and len({c[0] for c in first["calls"]}) == 2
    results = RESULTS
    messages = [*ASK, {"role": "assistant", "content": first["content"], "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        for cid, name, args in first["calls"]]}]
    messages += [{"role": "tool", "tool_call_id": cid, "content": results[name]} for cid, name, _ in first["calls"]]
    second = _ask(client, messages, stream, **kw)
    assert second == {"reasoning": None, "content": ANSWER[1], "calls": [], "finish": "stop"}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_off_none_and_a_length_cut(client: openai.OpenAI, stream: bool) -> None:
    one = _ask(client, ASK, stream, parallel_tool_calls=False)
    assert [(name, json.loads(args)) for _, name, args in one["calls"]] == CALLS[:1]
    none = _ask(client, ASK, stream, tool_choice="none")  # the text as it is: no calls read out of it
    assert none["calls"] == [] and none["finish"] == "stop" and "<tool_call>" in none["content"]
    assert none["reasoning"] == THOUGHT
    thinking = _ask(client, ASK, stream, max_tokens=2)  # cut while thinking: all reasoning so far
    assert thinking == {"reasoning": THOUGHT, "content": None, "calls": [], "finish": "length"}
    cut = _ask(client, ASK, stream, max_tokens=6)  # cut inside the first call: the call so far, finish length
    assert cut["finish"] == "length" and [name for _, name, _ in cut["calls"]] == ["get_weather"]


def test_bad_tool_requests_are_400s_that_say_what_is_wrong(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="bogus")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="tool message needs tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=[*ASK, {"role": "tool", "content": "x"}])  # type: ignore[list-item]


def test_n_choices_each_read_their_own_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=40, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:  # greedy: the same answer thrice, each parsed on its own
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == CALLS
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=40)
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens  # type: ignore[union-attr]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]  # the prompt counts once


# -- the Responses API ----------------------------------------------------------------------
RTOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
          for t in TOOLS]


def _respond(client: openai.OpenAI, stream: bool, **kw: Any) -> Any:
    """A Response, whole or as the SDK's stream accumulates it (its events checked in order)."""
    args = {"model": MODEL, "tools": RTOOLS, "temperature": 0.0, "max_output_tokens": 40, **kw}
    if not stream:
        return client.responses.create(**args)
    with client.responses.stream(**args) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{final.status}"
    added = [(e.item.type, e.item.id) for e in events if e.type == "response.output_item.added"]
    done = [(e.item.type, e.item.id) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(o.type, o.id) for o in final.output]
    return final


def _items(response: Any) -> list[tuple[str, Any]]:
    """A Response's output as (type, what it says): a thought's text, a message's text, a call."""
    out: list[tuple[str, Any]] = []
    for o in response.output:
        if o.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in o.content or [])))
        elif o.type == "message":
            out.append(("message", "".join(c.text for c in o.content)))
        else:
            out.append(("function_call", (o.name, json.loads(o.arguments))))
    return out


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_loop_through_the_responses_api(client: openai.OpenAI, stream: bool, thinking: bool) -> None:
    kw: dict[str, Any] = {} if thinking else {"reasoning": {"effort": "none"}}
    first = _respond(client, stream, input=ASK[0]["content"], store=False, **kw)
    assert _items(first) == [*([("reasoning", THOUGHT)] if thinking else []), ("message", "Let me check."),
                             *(("function_call", c) for c in CALLS)]
    assert first.status == "completed" and first.store is False
    # <think>, the thought and </think>: one token each in the script
    assert first.usage.output_tokens_details.reasoning_tokens == (3 if thinking else 0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    if stream:  # the SDK's accumulation of the events is the whole call's answer
        whole = _respond(client, False, input=ASK[0]["content"], store=False, **kw)
        assert _items(whole) == _items(first)
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (first.usage.input_tokens,
                                                                         first.usage.output_tokens)
    # turn two sends back everything turn one said (as the Agents SDK does) and the results
    items = [*ASK, *(o.model_dump(exclude_none=True) for o in first.output),
             *({"type": "function_call_output", "call_id": c.call_id, "output": RESULTS[c.name]} for c in calls)]
    second = _respond(client, stream, input=items, store=False, **kw)
    assert _items(second) == [("message", ANSWER[1])] and second.status == "completed"


def test_a_cut_through_the_responses_api_is_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=RTOOLS, max_output_tokens=2,
                                  temperature=0.0, store=False)
    assert (cut.status, cut.incomplete_details.reason, _items(cut)) == ("incomplete", "max_output_tokens",
                                                                         [("reasoning", THOUGHT)])
    assert cut.output[0].status == "incomplete"
    cut = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=RTOOLS, max_output_tokens=6,
                                  temperature=0.0, store=False)  # inside the first call: the call so far
    assert cut.status == "incomplete" and [o.type for o in cut.output][-1] == "function_call"


def served_since(cluster: LocalCluster, before: dict[str, int]) -> dict[str, int]:
    return {s["router_id"]: s["num_requests"] - before.get(s["router_id"], 0) for s in cluster.router_stats()}


def test_previous_response_id_continues_a_stored_turn_on_either_replica_for_its_tenant_alone(
        cluster: LocalCluster, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=RTOOLS, temperature=0.0,
                                    max_output_tokens=40)
    assert first.store is True and client.responses.retrieve(first.id).output == first.output
    results = [{"type": "function_call_output", "call_id": o.call_id, "output": RESULTS[o.name]}
               for o in first.output if o.type == "function_call"]
    whole = client.responses.create(model=MODEL, tools=RTOOLS, temperature=0.0, max_output_tokens=40, store=False,
                                    input=[*ASK, *(o.model_dump(exclude_none=True) for o in first.output), *results])
    before = served_since(cluster, {})
    for _ in range(48):  # fresh connections until each replica has continued the stored turn
        follow = connect(cluster).responses.create(model=MODEL, tools=RTOOLS, temperature=0.0, max_output_tokens=40,
                                                   previous_response_id=first.id, input=results, store=False)
        assert _items(follow) == [("message", ANSWER[1])] and follow.previous_response_id == first.id
        # the same prompt as the whole conversation sent again, its stored turn's prefix cached
        assert follow.usage.input_tokens == whole.usage.input_tokens
        assert follow.usage.input_tokens_details.cached_tokens >= 16
        if min((served := served_since(cluster, before)).values()) > 0:
            break
    assert min(served.values()) > 0 and len(served) == 2, served
    other = connect(cluster, "globex")
    with pytest.raises(openai.NotFoundError, match="another tenant's"):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=MODEL, previous_response_id=first.id, input=results)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


# -- Anthropic's Messages API, with Anthropic's own client ------------------------------------
ATOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]


def anthropic_client(cluster: LocalCluster, tenant: str = "acme") -> anthropic.Anthropic:
    """Anthropic's client sends its key as `x-api-key`."""
    return anthropic.Anthropic(base_url=f"http://{cluster.info['http_address']}", api_key=KEYS[tenant],
                               max_retries=0, timeout=120)


def _blocks(message: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for b in message.content:
        out.append((b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input)))
    return out


def _message(client: anthropic.Anthropic, stream: bool, **kw: Any) -> Any:
    args = {"model": MODEL, "tools": ATOOLS, "extra_body": {"temperature": 0.0}, "max_tokens": 40, **kw}
    if not stream:
        return client.messages.create(**args)
    with client.messages.stream(**args) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_stop", "message_delta",
                                     "message_stop")]
    assert raw == ["message_start", *["content_block_start", "content_block_stop"] * len(final.content),
                   "message_delta", "message_stop"], kinds
    return final


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_loop_through_the_messages_api(cluster: LocalCluster, client: openai.OpenAI, stream: bool,
                                                       thinking: bool) -> None:
    claude = anthropic_client(cluster)
    kw: dict[str, Any] = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
    first = _message(claude, stream, messages=ASK, **kw)
    assert _blocks(first) == [*([("thinking", THOUGHT)] if thinking else []), ("text", "Let me check."),
                              *(("tool_use", c) for c in CALLS)]
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.id.startswith("msg_")
    if stream:  # the client's accumulation of the events is the whole call's answer
        whole = _message(claude, False, messages=ASK, **kw)
        assert _blocks(whole) == _blocks(first)
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (first.usage.input_tokens,
                                                                         first.usage.output_tokens)
    uses = [b for b in first.content if b.type == "tool_use"]
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": RESULTS[b.name]}
                                             for b in uses]}]
    second = _message(claude, stream, messages=messages, **kw)
    assert _blocks(second) == [("text", ANSWER[1])] and second.stop_reason == "end_turn"
    # the same conversation through chat completions: the same prompt
    chat_messages = [*ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in uses]},
        *({"role": "tool", "tool_call_id": b.id, "content": RESULTS[b.name]} for b in uses)]
    chat = client.chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=1, tools=TOOLS,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    cut = _message(claude, stream, messages=ASK, max_tokens=2, thinking={"type": "enabled", "budget_tokens": 1024})
    assert cut.stop_reason == "max_tokens" and _blocks(cut) == [("thinking", THOUGHT)]


def test_messages_api_keys_come_as_x_api_key_and_its_errors_are_anthropic_s(cluster: LocalCluster) -> None:
    bad = anthropic.Anthropic(base_url=f"http://{cluster.info['http_address']}", api_key="wrong-key-0123456789",
                              max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"  # type: ignore[index]
    claude = anthropic_client(cluster)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               tools=[{"type": "bash_20250124", "name": "bash"}])
    assert e.value.body["error"] == {"type": "invalid_request_error",  # type: ignore[index]
                                     "message": "tools[0]: tools of type 'bash_20250124' are not served here (only "
                                                "custom tools with an input_schema)"}
