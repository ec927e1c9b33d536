"""The router's input limits and admission cost: every bad field is INVALID_ARGUMENT with a
message that says what to change; a huge max_tokens costs no more than the context allows."""
from __future__ import annotations

import dataclasses

import math

import grpc
import pytest

from control.heartbeat import ModelFacts
from proto import generate_pb2 as pb
from router.attempt import RequestFailed
from router.admission import admission_cost
from router.frontend import Frontend, ask_from_pb, output_tokens, runs_to_the_end
from router.policy import blocks_for

FACTS = ModelFacts("m", 16, 1000, 512, 64)


def prepare(**fields: object) -> object:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=fields.pop("ids", [5, 6, 7])), **fields)  # type: ignore[arg-type]
    return Frontend(None).prepare(ask_from_pb(request), FACTS, 64)


@pytest.mark.parametrize(("fields", "message"), [
    ({"sampling": pb.SamplingParams(temperature=math.nan)}, "temperature must be a finite number >= 0"),
    ({"sampling": pb.SamplingParams(temperature=math.inf)}, "temperature must be a finite number >= 0"),
    ({"sampling": pb.SamplingParams(top_p=math.nan)}, "top_p must be in (0, 1]"),
    ({"sampling": pb.SamplingParams(max_tokens=0)}, "max_tokens must be at least 1"),
    ({"sampling": pb.SamplingParams(stop_token_ids=list(range(65)))}, "at most 64 stop_token_ids, got 65"),
    ({"request_id": "x" * 129}, "request_id must be at most 128 printable characters (got 129"),
    ({"request_id": "a\nb"}, "request_id must be at most 128 printable characters"),
    ({"tenant": "t" * 10**6}, "tenant must be at most 128 printable characters (got 1000000"),
    ({"priority": 9}, "priority must be in [-8, 8]"),
    ({"priority": -2**31}, "priority must be in [-8, 8]"),
    ({"ids": [5, 1000]}, "token ids [1000] are outside the model's vocabulary [0, 1000)"),
    ({"ids": list(range(3, 515))}, "prompt has 512 tokens; the model's context is 512 tokens"),
    ({"ids": []}, "prompt is empty"),
])
def test_bad_fields_are_invalid_argument_with_a_message_that_says_what_to_change(fields: dict, message: str) -> None:
    with pytest.raises(RequestFailed) as e:
        prepare(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.message


def test_too_many_stop_strings_are_refused() -> None:
    with pytest.raises(RequestFailed, match="at most 16 stop strings"):
        prepare(ids=[5], sampling=pb.SamplingParams(stop=["x"] * 17))


def test_a_huge_max_tokens_costs_only_what_the_context_allows() -> None:
    prep = prepare(sampling=pb.SamplingParams(max_tokens=2**31 - 1))
    assert output_tokens(prep, FACTS.max_model_len) == 509  # what the context leaves after 3 prompt tokens
    assert admission_cost(len(prep.token_ids), output_tokens(prep, FACTS.max_model_len)) == 512
    short = prepare(sampling=pb.SamplingParams(max_tokens=10))
    assert admission_cost(len(short.token_ids), output_tokens(short, FACTS.max_model_len)) == 13
    assert admission_cost(len(short.token_ids), 4, cached_tokens=2) == 5  # 1 uncached prompt token + 4 expected


def test_only_a_request_that_nothing_can_stop_early_is_charged_its_max_tokens_as_known() -> None:
    assert runs_to_the_end(prepare(sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True)))
    assert not runs_to_the_end(prepare(sampling=pb.SamplingParams(max_tokens=10)))  # EOS may stop it
    known = prepare(sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True))
    assert not runs_to_the_end(dataclasses.replace(known, params=dataclasses.replace(known.params, stop=(".",))))
    assert not runs_to_the_end(prepare(sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9])))


def test_long_text_and_long_constraints_are_prepared_off_the_event_loop() -> None:
    from router.frontend import OFF_LOOP_CHARS, OFF_LOOP_CONSTRAINT_CHARS, slow_to_prepare

    assert not slow_to_prepare(ask_from_pb(pb.GenerateRequest(text="x" * OFF_LOOP_CHARS)))
    assert slow_to_prepare(ask_from_pb(pb.GenerateRequest(text="x" * (OFF_LOOP_CHARS + 1))))
    ids = pb.TokenIds(ids=list(range(OFF_LOOP_CHARS + 1)))
    assert not slow_to_prepare(ask_from_pb(pb.GenerateRequest(token_ids=ids)))
    schema = pb.SamplingParams(constraint=pb.Constraint(kind="json_schema", value="{" + " " * OFF_LOOP_CONSTRAINT_CHARS + "}"))
    assert slow_to_prepare(ask_from_pb(pb.GenerateRequest(text="hi", sampling=schema)))


def test_a_prompt_under_a_sliding_window_needs_only_its_window_s_blocks_on_a_decode_worker() -> None:
    """A 200-token prompt in 16-token blocks needs 13 blocks once its first token is in; where
    every layer slides a 32-key window, its first decode query (200) reads keys 169..: blocks
    10 to 12, so a decode worker of 8 blocks takes it; the router books the same 3."""
    windowed = ModelFacts("m", 16, 1000, 4096, 64, kv_window=32)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 200))
    with pytest.raises(RequestFailed, match="prompt needs 13 KV blocks; the largest decode worker holds 8"):
        Frontend(None).prepare(ask_from_pb(request), ModelFacts("m", 16, 1000, 4096, 64), 8)
    assert len(Frontend(None).prepare(ask_from_pb(request), windowed, 8).token_ids) == 200
    assert blocks_for(200, 16) == 13 and blocks_for(200, 16, 32) == 3


def test_logit_bias_outside_the_vocabulary_is_refused_by_name() -> None:
    with pytest.raises(RequestFailed, match=r"logit_bias token ids \[1000\] are outside the model's vocabulary"):
        prepare(sampling=pb.SamplingParams(logit_bias={1000: 1.0, 5: 2.0}))


def test_a_constraint_is_compiled_once_by_the_router_and_a_refusal_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router compiles a constraint once (syntax, schema, limits) whatever the requests
    that send it; the refusal of a bad one is kept too: sending it again costs nothing."""
    front = Frontend(None)
    calls = []
    real = front.grammars._compile
    monkeypatch.setattr(front.grammars, "_compile", lambda c: calls.append(c.kind) or real(c))

    def ask(sampling: pb.SamplingParams, i: int = 0) -> object:
        return ask_from_pb(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, i + 3]), sampling=sampling))

    good = pb.SamplingParams(constraint=pb.Constraint(kind="json_schema", value='{"type": "object"}'))
    preps = [front.prepare(ask(good, i), FACTS, 64) for i in range(4)]  # type: ignore[arg-type]
    assert len({p.request_id for p in preps}) == 4 and calls == ["json_schema"]
    bad = pb.SamplingParams(constraint=pb.Constraint(kind="json_schema", value="{not json"))
    for _ in range(3):
        with pytest.raises(RequestFailed, match="the JSON schema is not JSON"):
            front.prepare(ask(bad), FACTS, 64)  # type: ignore[arg-type]
    assert calls == ["json_schema"] * 2


def test_lists_past_the_engines_limits_are_refused_before_they_are_converted() -> None:
    import time

    sampling = pb.SamplingParams(logit_bias={i: 1.0 for i in range(300_000)})
    t0 = time.perf_counter()
    with pytest.raises(RequestFailed, match="at most 1024 logit_bias tokens, got 300000"):
        prepare(sampling=sampling)
    with pytest.raises(RequestFailed, match="prompt has 100000 tokens; the model's context is 512"):
        prepare(ids=[5] * 100_000)
    assert time.perf_counter() - t0 < 1.0  # counted, not converted (converting took seconds)
