"""One 32-turn agent conversation through each agent API, on one 1P+1D cluster: chat
completions, the Responses API sending the whole conversation each turn, the Responses API
with `previous_response_id` (each turn sends only its new items), and Anthropic's Messages
API, each with its own SDK, streamed.

The model is the scripted tool model of the tests (tests/integration/scripted_model.py):
asked, it thinks, writes "Let me check." and calls two tools; given their results it answers,
and answers every later question at once. So the conversation is: the question, the calls,
their results, the answer, then 30 more questions and answers (32 requests), its prompt
growing each turn. Each arm's conversation opens with its own system line, so no arm finds
another's turns in the prefix cache (the tools' header aside, which every arm shares).

Per arm, one JSON line: TTFT p50 / p90 (to the first streamed byte of the answer: thought,
text or call), the prompt tokens the turns hold in all, the bytes the client sent, and the
prefix-cache hit rate (cached prompt tokens / prompt tokens).

    ./dev python benchmarks/serving/agent_apis.py [--turns 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import anthropic  # noqa: E402
import openai  # noqa: E402

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig  # noqa: E402
from cluster.local import LocalCluster  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402
from tests.integration.scripted_model import make_scripted_model  # noqa: E402

MODEL = "scripted"
QUESTION = "What is the weather in Paris and the time there?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [("get_weather", PARAMS), ("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})]
RESULTS = {"get_weather": "sunny, 18 C", "get_time": "14:05"}


class Turns:
    """One arm's numbers: per turn its TTFT, prompt and cached tokens, and the bytes sent."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.prompt = self.cached = self.sent = 0

    def add(self, ttft_s: float, prompt: int, cached: int, body: dict[str, Any]) -> None:
        self.ttft.append(ttft_s)
        self.prompt, self.cached = self.prompt + prompt, self.cached + cached
        self.sent += len(json.dumps(body, default=str))

    def row(self, arm: str) -> dict[str, Any]:
        q = statistics.quantiles(self.ttft, n=10)
        return {"arm": arm, "turns": len(self.ttft), "ttft_p50_ms": round(statistics.median(self.ttft) * 1000, 1),
                "ttft_p90_ms": round(q[8] * 1000, 1), "prompt_tokens": self.prompt, "cached_tokens": self.cached,
                "hit_rate": round(self.cached / self.prompt, 3), "bytes_sent": self.sent}


def chat(client: openai.OpenAI, turns: int, salt: str) -> Turns:
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "system", "content": salt}, {"role": "user", "content": QUESTION}]
    out = Turns()
    for _ in range(turns):
        body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 40, "temperature": 0}
        start, first, text, calls, usage = time.perf_counter(), None, "", {}, None
        for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                d = choice.delta
                if first is None and (d.content or d.tool_calls or getattr(d, "reasoning_content", None)):
                    first = time.perf_counter() - start
                text += d.content or ""
                for c in d.tool_calls or []:
                    got = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
                    got["id"] += c.id or ""
                    got["name"] += (c.function.name or "") if c.function else ""
                    got["arguments"] += (c.function.arguments or "") if c.function else ""
        out.add(first or 0.0, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, body)
        messages = [*messages, {"role": "assistant", "content": text or None, **({"tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]} if calls else {})}]
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": RESULTS[c["name"]]} for c in calls.values()] \
            or [{"role": "user", "content": QUESTION}]
    return out


def responses(client: openai.OpenAI, turns: int, salt: str, chained: bool) -> Turns:
    tools = [{"type": "function", "name": n, "parameters": p} for n, p in TOOLS]
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    previous, out = None, Turns()
    for _ in range(turns):
        body: dict[str, Any] = {"model": MODEL, "instructions": salt, "input": items, "tools": tools,
                                "max_output_tokens": 40, "temperature": 0, "store": chained}
        if previous is not None:
            body["previous_response_id"] = previous
        start, first = time.perf_counter(), None
        with client.responses.stream(**body) as s:
            for e in s:
                if first is None and e.type.endswith(".delta"):
                    first = time.perf_counter() - start
            r = s.get_final_response()
        out.add(first or 0.0, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, body)
        new = [{"type": "function_call_output", "call_id": o.call_id, "output": RESULTS[o.name]}
               for o in r.output if o.type == "function_call"] or [{"role": "user", "content": QUESTION}]
        if chained:
            previous, items = r.id, new
        else:
            items = [*items, *(o.model_dump(exclude_none=True) for o in r.output), *new]
    return out


def messages_api(client: anthropic.Anthropic, turns: int, salt: str) -> Turns:
    tools = [{"name": n, "input_schema": p} for n, p in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    out = Turns()
    for _ in range(turns):
        body = {"model": MODEL, "system": salt, "messages": messages, "tools": tools, "max_tokens": 40,
                "thinking": {"type": "enabled", "budget_tokens": 1024}, "extra_body": {"temperature": 0}}
        start, first = time.perf_counter(), None
        with client.messages.stream(**body) as s:
            for e in s:
                if first is None and e.type == "content_block_delta":
                    first = time.perf_counter() - start
            m = s.get_final_message()
        out.add(first or 0.0, m.usage.input_tokens, m.usage.cache_read_input_tokens or 0, body)
        uses = [b for b in m.content if b.type == "tool_use"]
        messages = [*messages, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                  "content": RESULTS[b.name]} for b in uses] or QUESTION}]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="each arm this many times, arms alternating")
    args = p.parse_args()
    model_dir = str(make_scripted_model(Path(tempfile.mkdtemp(prefix="scripted-")) / "scripted"))
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=model_dir, block_size=16, kv_cache_bytes=64 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=model_dir,
                            routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as cluster:
        http = cluster.info["http_address"]
        oai = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=120)
        claude = anthropic.Anthropic(base_url=f"http://{http}", api_key="unused", max_retries=0, timeout=120)
        arms = {"chat": lambda salt: chat(oai, args.turns, salt),
                "responses": lambda salt: responses(oai, args.turns, salt, chained=False),
                "responses_previous_id": lambda salt: responses(oai, args.turns, salt, chained=True),
                "messages": lambda salt: messages_api(claude, args.turns, salt)}
        chat(oai, 2, "warm up")
        for r in range(args.rounds):
            for i, (arm, run) in enumerate(arms.items()):
                row = run(" ".join(["session"] * (1 + i + r * len(arms))))  # its own prefix
                print(json.dumps({**row.row(arm), "round": r, "model": "scripted", "workers": "1P+1D",
                                  "mode": "disaggregated"}), flush=True)


if __name__ == "__main__":
    main()
