"""The OpenAI HTTP API end to end, with the official `openai` client, on the embedded default
model (SmolLM2-135M-Instruct from its GGUF file): a real cluster (Ray actors, redis-server),
1 prefill + 1 decode worker in mode disaggregated, so every request goes router -> prefill
-> kvfabric -> decode. After every test nothing is held on any worker or router."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import torch

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.test_metrics import scrape, total

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: str, smollm2_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=smollm2_gguf, block_size=16, kv_cache_bytes=64 * 2**20),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=smollm2_dir,
                            routing=RoutingConfig(mode="disaggregated"),
                            # charged the worst case, one long request holds the budget (the overload test)
                            # a queue wait limit no loaded machine's forecast reaches: the overload test's
                            # queued request waits behind a 1,200-token one, however slow the steps
                            admission=AdmissionConfig(max_queued_per_priority=1, max_queue_wait_s=300.0,
                                                      charge_output="max")))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def base(cluster: LocalCluster) -> str:  # type: ignore[misc]
    yield f"http://{cluster.info['http_address']}"
    assert_idle(cluster)


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    """transformers loading the same GGUF file (dequantized to float32): the reference."""
    from transformers import AutoModelForCausalLM

    path = Path(smollm2_gguf)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def post(base: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def grpc_generate(stub, prompt: str | list[int], **sampling) -> tuple[str, list[int], pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], responses[-1]


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


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_and_output_logprobs_equal_transformers(client: openai.OpenAI, stub, hf_gguf, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """lm-evaluation-harness's log-likelihood request (echo, logprobs 1, max_tokens 0) and top
    alternatives: each prompt token's log-probability, and each generated token's with its 5
    likeliest, within 2e-3 of transformers' float32 log-softmax on the same GGUF, through
    prefill worker (the prompt's, the first token's) and decode worker (the rest)."""
    prompt = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
    ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0).choices[0]
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    if stream:
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lp = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
        tops = [x for c in chunks for x in c.choices[0].logprobs.top_logprobs]
    else:
        r = client.completions.create(**kw)
        text, lp, tops = r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.top_logprobs
        assert r.usage.completion_tokens == 0
    assert text == prompt and lp[0] is None and tops[0] is None
    n = len(lp)
    tokens = ids.logprobs.tokens[:n]
    status, _, tok = post(client.base_url.scheme + "://" + client.base_url.host + ":" + str(client.base_url.port),
                          "/tokenize", {"prompt": prompt})
    assert status == 200 and tok["count"] == n and "".join(tokens) == prompt
    with torch.inference_mode():
        want = torch.log_softmax(hf_gguf(torch.tensor([tok["tokens"]])).logits[0].float(), -1)
    want_lp = [float(want[i - 1, t]) for i, t in enumerate(tok["tokens"]) if i]
    assert max(abs(a - b) for a, b in zip(lp[1:], want_lp, strict=True)) < 2e-3
    assert all(len(t) == 1 and abs(max(t.values()) - float(want[i].max())) < 2e-3 for i, t in enumerate(tops[1:]))
    # generated tokens' logprobs and 5 alternatives (chat), the greedy token the likeliest
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=5, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    gen = r.choices[0].model_extra["token_ids"]
    assert len(content) == len(gen) and all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob for c in content)
    _, _, prompt_tok = post(client.base_url.scheme + "://" + client.base_url.host + ":" + str(client.base_url.port),
                            "/tokenize", {"messages": QUESTION})
    with torch.inference_mode():
        full = torch.log_softmax(hf_gguf(torch.tensor([prompt_tok["tokens"] + gen])).logits[0].float(), -1)
    start = len(prompt_tok["tokens"]) - 1
    assert max(abs(c.logprob - float(full[start + i, t])) for i, (c, t) in enumerate(zip(content, gen))) < 2e-3
    # the gRPC door: prompt_logprobs on the first response, ranks too
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tok["tokens"]), sampling=pb.SamplingParams(
        max_tokens=2, prompt_logprobs=3, logprobs=True, top_logprobs=2))
    responses = list(stub.Generate(request, timeout=120))
    p = responses[0].prompt_logprobs
    assert len(p.logprobs) == n - 1 and all(len(t.token_ids) == 3 for t in p.top)
    assert all(r == 1 + int((want[i] > want[i, t]).sum()) for i, (r, t) in enumerate(zip(p.ranks, tok["tokens"][1:])))
    assert [len(t.token_ids) for r in responses for t in r.top_logprobs] == [2, 2]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_grpc_path(client: openai.OpenAI, stub, stream: bool) -> None:  # type: ignore[no-untyped-def]
    prompt = "Once upon a time, in a small village,"
    want_text, want_ids, last = grpc_generate(stub, prompt, max_tokens=24, ignore_eos=True)
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []  # exactly one, last
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        usage = usage[0]
    else:
        r = client.completions.create(**kwargs)
        text, usage = r.choices[0].text, r.usage
        assert r.choices[0].finish_reason == "length" and r.id.startswith("cmpl-") and r.object == "text_completion"
    assert text == want_text
    assert usage.completion_tokens == len(want_ids) == 24
    assert usage.prompt_tokens == last.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_in_one_completions_request_are_choices_by_index(client: openai.OpenAI, stream: bool) -> None:
    prompts = ["The sky is", "One, two, three,", "def fibonacci(n):"]
    alone = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8).choices[0].text
             for p in prompts]
    kw = dict(model=MODEL, prompt=prompts, temperature=0, max_tokens=8)
    if stream:
        texts, usage = ["", "", ""], None
        for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                texts[c.index] += c.text
            usage = chunk.usage or usage
    else:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        texts, usage = [c.text for c in r.choices], r.usage
    assert texts == alone
    assert usage is not None and usage.completion_tokens == 24


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_seed_plus_i_alone_and_count_the_prompt_once(client: openai.OpenAI, stub, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """n = 4 through prefill -> kvfabric -> decode: the prompt computed and pushed once, forked
    on the decode worker; choice i equals the request with seed + i alone, by both doors."""
    prompt = "Write a short poem about the sea:"
    alone = [grpc_generate(stub, prompt, max_tokens=10, temperature=1.0, seed=40 + i)[1] for i in range(4)]
    assert len({tuple(a) for a in alone}) == 4
    kw = dict(model=MODEL, prompt=prompt, temperature=1.0, seed=40, max_tokens=10, n=4,
              extra_body={"return_token_ids": True})
    if stream:
        ids: dict[int, list[int]] = {}
        finishes: dict[int, str] = {}
        usage = None
        for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                ids.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
            usage = chunk.usage or usage
        got = [ids[i] for i in range(4)]
        assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    else:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        got, usage = [c.model_extra["token_ids"] for c in r.choices], r.usage
    assert got == alone
    _, _, one = grpc_generate(stub, prompt, max_tokens=10)
    assert usage.prompt_tokens == one.usage.prompt_tokens and usage.completion_tokens == 40
    request = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=10, temperature=1.0, seed=40, n=4))
    by_choice: dict[int, list[int]] = {}
    for response in stub.Generate(request, timeout=120):
        by_choice.setdefault(response.choice, []).extend(response.token_ids)
    assert [by_choice[i] for i in range(4)] == alone


def test_best_of_returns_the_n_likeliest_of_its_choices(client: openai.OpenAI, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = "My favourite colour is"
    drawn = []
    for i in range(4):  # best_of 4 draws choices 0..3 as seeds 50..53 would
        responses = list(stub.Generate(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            max_tokens=6, temperature=1.0, seed=50 + i, logprobs=True)), timeout=120))
        drawn.append((sum(lp for r in responses for lp in r.logprobs), [t for r in responses for t in r.token_ids]))
    want = [ids for _, ids in sorted(drawn, key=lambda d: -d[0])[:2]]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=50, max_tokens=6, n=2, best_of=4,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].logprobs is None
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    assert r.usage.completion_tokens == 24  # the 4 drawn count


def test_sampling_controls_over_http_equal_the_grpc_path(client: openai.OpenAI, stub) -> None:  # type: ignore[no-untyped-def]
    """Penalties, min_p, logit_bias and min_tokens: the same tokens by both doors, through
    prefill (the first token) and decode (the rest); they change the greedy answer."""
    prompt = "List the days of the week: Monday, Tuesday,"
    _, plain, _ = grpc_generate(stub, prompt, max_tokens=24)
    banned = plain[1]
    grpc_kw = dict(max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                   logit_bias={banned: -100.0}, min_tokens=20)
    _, want, last = grpc_generate(stub, prompt, **grpc_kw)
    assert want != plain and banned not in want and len(want) >= 20
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, presence_penalty=0.3,
                                  frequency_penalty=0.5, logit_bias={str(banned): -100},
                                  extra_body={"repetition_penalty": 1.3, "min_tokens": 20, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want  # type: ignore[index]
    sampled = client.completions.create(model=MODEL, prompt=prompt, temperature=0.8, seed=11, max_tokens=16,
                                        extra_body={"min_p": 0.3, "return_token_ids": True})
    _, again, _ = grpc_generate(stub, prompt, max_tokens=16, temperature=0.8, seed=11, min_p=0.3)
    assert sampled.choices[0].model_extra["token_ids"] == again  # type: ignore[index]


def test_seeded_sampling_equals_the_grpc_path_and_repeats(client: openai.OpenAI, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = "The three best things about autumn are"
    want_text, _, _ = grpc_generate(stub, prompt, max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.95,
                                       seed=1234).choices[0].text for _ in range(2)]
    assert texts == [want_text, want_text]
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.95, seed=99)
    assert other.choices[0].text != want_text


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
    short = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16 and short.choices[0].finish_reason == "length"  # OpenAI's default 16


def test_models_health_version_tokenize_detokenize(base: str, cluster: LocalCluster) -> None:
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 8192 and models["data"][0]["owned_by"] == "splitserve"
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
    hold = http.client.HTTPConnection(*cluster.info["http_address"].split(":"), timeout=60)
    hold.request("POST", "/v1/completions", json.dumps({"prompt": "Tell me a long story.", "max_tokens": 1200,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    assert hold.getresponse().status == 200  # admitted and streaming
    body = {"prompt": "Count to one hundred.", "max_tokens": 300, "ignore_eos": True}

    def one(_: int) -> tuple[int, dict, dict]:
        try:
            return post(base, "/v1/completions", body)
        except (TimeoutError, OSError) as e:
            return 0, {}, {"error": repr(e)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(4)]
        done, waiting = [], []
        try:
            for f in futures:
                try:
                    done.append(f.result(timeout=10))
                except concurrent.futures.TimeoutError:
                    waiting.append(f)  # the queued one: it waits for the long request
        finally:
            hold.close()  # the long request's client goes away: the queued one is admitted and runs
        assert len(waiting) == 1, done  # max_queued_per_priority 1
        queued = [f.result(timeout=120) for f in waiting]
    assert [status for status, _, _ in queued] == [200], queued
    assert queued[0][2]["usage"]["completion_tokens"] == 300
    refused = [r for r in done if r[0] != 200]  # any other fitted beside the long one and ran
    assert len(refused) >= 2, done
    for status, headers, answer in refused:
        _error(status, answer, 429, "")
        assert int(headers["Retry-After"]) >= 1 and answer["error"]["type"] == "rate_limit_error"


def test_a_client_disconnecting_mid_stream_frees_every_block(base: str, cluster: LocalCluster) -> None:
    for path, body in (("/v1/completions", {"prompt": "Write a poem about rivers.", "max_tokens": 1000}),
                       ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1000})):
        conn = http.client.HTTPConnection(*cluster.info["http_address"].split(":"), timeout=60)
        conn.request("POST", path, json.dumps({**body, "stream": True, "ignore_eos": True, "temperature": 0}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += response.read1(4096)
        conn.sock.close()  # gone mid-stream, with hundreds of tokens to go
        conn.close()
        assert_idle(cluster, timeout_s=20)  # every block on P and D freed, nothing admitted at the router
    stats = cluster.router_stats()[0]
    assert stats["num_admitted"] == 0


def test_http_and_grpc_requests_count_in_the_same_prometheus_series(client: openai.OpenAI, stub,
                                                                    cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    address = cluster.router_stats()[0]["metrics_address"]
    before = scrape(address)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    grpc_generate(stub, "Hello", max_tokens=3, ignore_eos=True)
    after = scrape(address)
    name = "splitserve:request_success_total"
    assert total(after, name, finished_reason="length") - total(before, name, finished_reason="length") == 2
    assert total(after, "splitserve:generation_tokens_total") - total(before, "splitserve:generation_tokens_total") == 6


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
