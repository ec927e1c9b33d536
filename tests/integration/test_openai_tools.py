"""Agent loops through the OpenAI API with the official `openai` client: automatic tool calls
read out of the model's own text (the hermes parser the chat template implies), parallel
calls, tool results sent back, the final answer, the model's thinking as `reasoning_content`
(the qwen3 reasoning parser the template implies; off with `enable_thinking: false`); whole
and streamed, on a real cluster (Ray actors, redis-server, 1 prefill + 1 decode worker,
disaggregated). The model is the scripted checkpoint of tests/integration/scripted_model.py:
its greedy answers are a Qwen3-style script, so the loop is exact."""
from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted"))


@pytest.fixture(scope="module")
def cluster(model_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=model_dir,
                            routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> openai.OpenAI:  # type: ignore[misc]
    yield openai.OpenAI(base_url=f"http://{cluster.info['http_address']}/v1", api_key="unused", max_retries=0,
                        timeout=120)
    assert_idle(cluster)


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
    results = {"get_weather": "sunny, 18 C", "get_time": "14:05"}
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
