"""Property-based fuzzing of the public Generate endpoint on a real cluster (router -> P -> D).

Hypothesis generates every field of `GenerateRequest`: empty, huge, negative, NaN/inf,
out-of-range ids, hundreds of thousands of tokens, control characters, thousands of stop
strings, extreme priorities and deadlines; and raw bytes that are no valid request at all
(invalid UTF-8 included). Each call must end OK or with a status that is the caller's
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED with a hint, ALREADY_EXISTS, or DEADLINE_EXCEEDED
for a deadline it set) and a message; afterwards the cluster serves a greedy request
exactly and holds nothing (no block, reservation, admission or queue entry).
The long run is the same test with more examples:
`SPLITSERVE_FUZZ_EXAMPLES=5000 ./dev test tests/integration/test_generate_fuzz.py`.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.reference import make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(900)

CALLER_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}


def fuzz(examples: int) -> settings:
    """The same examples in every run (derandomized), more with $SPLITSERVE_FUZZ_EXAMPLES."""
    examples = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", examples))
    return settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])


int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
any_float = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=300) | st.text(st.characters(max_codepoint=31), max_size=50) | \
    st.integers(1000, 300_000).map(lambda n: "a b " * (n // 4))
token_lists = st.lists(st.integers(0, 600), max_size=300) | st.lists(uint32, max_size=50) | \
    st.integers(1, 300_000).map(lambda n: [5] * n)


@st.composite
def requests(draw: st.DrawFn) -> tuple[pb.GenerateRequest, float | None]:
    """Each field is sane seven times in eight, so enough requests run for real."""
    def pick(sane: st.SearchStrategy, wild: st.SearchStrategy):  # type: ignore[no-untyped-def]
        return draw(sane if draw(st.integers(0, 7)) else wild)

    r = pb.GenerateRequest(request_id=pick(st.just(""), st.text(max_size=200)), priority=pick(st.integers(-8, 8), int32),
                           tenant=pick(st.sampled_from(["", "a", "b"]), st.text(max_size=200)))
    prompt = pick(st.sampled_from(["text", "token_ids"]), st.just("none"))
    if prompt == "text":
        r.text = pick(st.text(st.characters(codec="ascii"), min_size=1, max_size=200), texts)
    elif prompt == "token_ids":
        r.token_ids.ids.extend(pick(st.lists(st.integers(0, 500), min_size=1, max_size=200), token_lists))
    s = r.sampling
    for name, sane, wild in (("max_tokens", st.integers(0, 24), int32), ("temperature", st.floats(0, 2), any_float),
                             ("top_k", st.integers(0, 50), int32), ("top_p", st.floats(0.05, 1.0), any_float),
                             ("seed", st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(s, name, pick(sane, wild))
    s.stop_token_ids.extend(pick(st.lists(st.integers(0, 500), max_size=4), st.lists(uint32, max_size=80)))
    s.stop.extend(pick(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                       st.lists(st.text(max_size=300), max_size=20) | st.integers(0, 3000).map(lambda n: ["x"] * n)))
    s.ignore_eos, s.logprobs = draw(st.booleans()), draw(st.booleans())
    deadline = pick(st.none(), st.floats(0.001, 8.0))
    return r, deadline


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str) -> Iterator[LocalCluster]:
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=5.0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8)))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def channel(cluster: LocalCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


def call_raw(channel: grpc.Channel, raw: bytes, timeout_s: float | None) -> tuple[grpc.StatusCode, str, list]:
    """Sends bytes as the Generate request; returns (status, details, responses)."""
    rpc = channel.unary_stream("/splitserve.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    responses: list[pb.GenerateResponse] = []
    try:
        for r in rpc(raw, timeout=timeout_s if timeout_s is not None else 60.0):
            responses.append(r)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", responses
    return grpc.StatusCode.OK, "", responses


def check_outcome(code: grpc.StatusCode, details: str, responses: list, deadline: float | None) -> None:
    if code == grpc.StatusCode.OK:
        assert responses and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        return
    allowed = CALLER_FAULTS | ({grpc.StatusCode.DEADLINE_EXCEEDED} if deadline is not None else set())
    assert code in allowed, (code, details)
    assert len(details) > 10, (code, details)  # a message a person can act on


def test_any_generate_request_ends_ok_or_with_the_callers_status(channel: grpc.Channel) -> None:
    """Each request ends as check_outcome allows; over the run, some ran for real and some
    were refused (counted here, so the test checks it alone and in any order)."""
    outcomes: dict[str, int] = {}

    @fuzz(200)
    @given(requests())
    def one(case: tuple[pb.GenerateRequest, float | None]) -> None:
        request, deadline = case
        code, details, responses = call_raw(channel, request.SerializeToString(), deadline)
        check_outcome(code, details, responses, deadline)
        outcomes[code.name] = outcomes.get(code.name, 0) + 1
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert not responses  # refused before any work

    one()
    assert outcomes.get("OK", 0) >= 20 and outcomes.get("INVALID_ARGUMENT", 0) >= 20, outcomes
    print(f"\nGenerate fuzz outcomes: {outcomes}")


@fuzz(100)
@given(st.binary(max_size=400) | st.builds(lambda b, i, x: b[:i] + bytes([x]) + b[i + 1:],
                                           st.just(pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(
                                               max_tokens=3)).SerializeToString()),
                                           st.integers(0, 20), st.integers(0, 255)))
def test_any_bytes_end_ok_or_invalid_argument(channel: grpc.Channel, raw: bytes) -> None:
    code, details, responses = call_raw(channel, raw, 20.0)
    check_outcome(code, details, responses, None)


def test_invalid_utf8_and_oversized_requests_get_clear_errors(channel: grpc.Channel) -> None:
    bad_text = b"\x12\x02\xff\xfe"  # field 2 (text), 2 bytes that are not UTF-8
    code, details, _ = call_raw(channel, bad_text, 10.0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid splitserve.v1.Generation.Generate request" in details and "UTF-8" in details
    huge = pb.GenerateRequest(text="x" * (17 << 20)).SerializeToString()
    code, details, _ = call_raw(channel, huge, 30.0)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details.lower()


def test_after_the_fuzz_the_cluster_is_exact_and_holds_nothing(cluster: LocalCluster, channel: grpc.Channel,
                                                               tiny_llama_dir: str) -> None:
    prompt = list(range(3, 40))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=6,
                                                                                                 ignore_eos=True))
    code, _, responses = call_raw(channel, request.SerializeToString(), 60.0)
    assert code == grpc.StatusCode.OK
    want = make_engine(tiny_llama_dir, block_size=16).generate([prompt], SamplingParams(max_tokens=6,
                                                                                        ignore_eos=True))[0]
    assert [t for r in responses for t in r.token_ids] == want.token_ids
    assert_idle(cluster, timeout_s=30)
