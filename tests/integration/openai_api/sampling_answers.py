"""The OpenAI API's sampling answers, with the official `openai` client: prompt and output
log-probabilities against transformers, completions equal to the gRPC path, several prompts,
n choices, best_of, the sampling controls, seeded sampling. Collected in test_api.py, on its
module's cluster (a cluster of the embedded model and the transformers reference cost tens of
seconds each to start: one of each serves both files)."""
from __future__ import annotations

import openai
import pytest
import torch

from proto import generate_pb2 as pb
from tests.integration.openai_api.calls import MODEL, QUESTION, grpc_generate, post


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
    _, want, _ = grpc_generate(stub, prompt, **grpc_kw)
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
