"""The sampling controls on logits against references: transformers' own processors for the
repetition penalty and min-p, OpenAI's stated formula for the presence and frequency
penalties, written out token by token; logit_bias and min_tokens by hand."""
from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from engine.model.logits_controls import apply_min_p, controlled
from engine.core.request import InvalidRequestError, Request, SamplingParams
from engine.model.sampler import Sampler
from engine.types import RequestId

VOCAB = 50


def _request(prompt: list[int], output: list[int], **params) -> Request:  # type: ignore[no-untyped-def]
    r = Request(RequestId("r"), prompt, SamplingParams(max_tokens=64, **params), arrival_time=0.0,
                eos_token_ids=frozenset({2}))
    r.output_token_ids = list(output)
    return r


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_the_repetition_penalty_is_transformers_over_prompt_and_output(penalty: float) -> None:
    prompt, output = [5, 9, 9, 13], [13, 40, 5]
    logits = _logits(1)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    got = controlled(logits, [_request(prompt, output, repetition_penalty=penalty)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.8), (-0.6, 1.1)])
def test_presence_and_frequency_penalties_follow_openais_formula_over_the_output_only(presence: float,
                                                                                     frequency: float) -> None:
    prompt, output = [7, 7, 8], [3, 3, 3, 8, 11]
    logits = _logits(2)
    want = logits.clone()
    for t in set(output):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence
        want[0, t] -= output.count(t) * frequency + presence
    got = controlled(logits, [_request(prompt, output, presence_penalty=presence, frequency_penalty=frequency)])
    torch.testing.assert_close(got, want)
    retried = _request(prompt + output[:2], output[2:], presence_penalty=presence, frequency_penalty=frequency,
                       output_prefix=2)  # a retry re-prefilled 2 sent tokens: counted as output still
    torch.testing.assert_close(controlled(logits, [retried]), want)


def test_logit_bias_and_min_tokens() -> None:
    logits = _logits(3)
    got = controlled(logits, [_request([4], [6], logit_bias=((10, 5.0), (11, -100.0)), min_tokens=3,
                                       stop_token_ids=(20,))])
    want = logits.clone()
    want[0, 10] += 5.0
    want[0, 11] -= 100.0
    want[0, [2, 20]] = float("-inf")  # EOS and the stop token, until 3 tokens are out
    torch.testing.assert_close(got, want)
    done = controlled(logits, [_request([4], [6, 6, 6], min_tokens=3)])
    assert torch.equal(done, logits)  # 3 tokens out: nothing left to apply


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_what_transformers_keeps_and_renormalizes(min_p: float) -> None:
    logits = _logits(4)
    kept = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits.clone()) > float("-inf")
    got = apply_min_p(torch.softmax(logits, -1), [min_p])
    assert torch.equal(got > 0, kept)
    torch.testing.assert_close(got.sum(-1), torch.ones(1))
    probs = Sampler.probs(logits, [_request([1], [], temperature=1.0, min_p=min_p)])
    torch.testing.assert_close(probs, got)


def test_greedy_with_a_bias_picks_the_biased_token_and_reports_the_raw_logprob() -> None:
    logits = _logits(5)
    low = int(logits.argmin())
    r = _request([1], [], logit_bias=((low, 100.0),), logprobs=True)
    [(token, logprob)] = Sampler(0, "cpu").sample(logits, [r])
    assert token == low
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, low]))


@pytest.mark.parametrize("bad,message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p must be in"), ({"logit_bias": ((1, 101.0),)}, "logit_bias maps"),
    ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "at most 1024"), ({"min_tokens": 65}, "min_tokens must be"),
])
def test_out_of_range_controls_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(max_tokens=64, **bad)
