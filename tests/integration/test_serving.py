"""The cluster end to end: real Ray actors, a real redis-server, gRPC on loopback.

One cluster for the module (2 prefill + 2 decode workers, mode auto with
local_prefill_tokens=8: prompts with fewer than 8 uncached tokens are prefilled on the
decode worker, longer ones go through a prefill worker and kvfabric). After every
test, every worker's pool must be back to idle: nothing in use, held or handed off.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import signal
import time

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle, wait_for
from tests.integration.reference import hf_greedy, make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS_BUDGET = 1000


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=5.0),
        num_prefill=2, num_decode=2,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="auto", local_prefill_tokens=8),
                            # the worst case charged: the overload test counts requests by their max_tokens
                            # a queue wait limit no loaded machine's forecast reaches: the overload test counts
                            # refusals by the queue's size alone (a queued request was refused after 0.7 s by
                            # its forecast wait, twice in about ten runs, one a CI run)
                            admission=AdmissionConfig(max_inflight_tokens=MAX_TOKENS_BUDGET, max_queued_per_priority=3,
                                                      charge_output="max", max_queue_wait_s=600.0)),
        worker_num_cpus=0.5)
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def stub(cluster: LocalCluster):  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(cluster.address)
    yield pb_grpc.GenerationStub(channel)
    channel.close()
    assert_idle(cluster)


def generate(stub, prompt: list[int] | str, timeout: float = 60, **sampling) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    sampling.setdefault("max_tokens", 8)
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return list(stub.Generate(req, timeout=timeout))


def tokens_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length + i)] for i in range(n)]


def test_greedy_disaggregated_equals_monolithic_and_transformers(stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    batch = prompts(1, 6, 37)
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda p: generate(stub, p, max_tokens=12, ignore_eos=True), batch))
    engine = make_engine(tiny_llama_dir, block_size=16)
    expected = engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, got, want in zip(batch, results, expected, strict=True):
        final = got[-1]
        assert final.route.prefill_worker.startswith("prefill-") and not final.route.local_prefill
        assert tokens_of(got) == want.token_ids == hf_greedy(tiny_llama_dir, tuple(p), 12)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(p), 12)
        t = final.timing
        # transfer_ms: first token sent to the KV landing on D; the window: D's open to ready
        assert t.transfer_window_ms > 0 and t.transfer_ms > 0 and t.ttft_ms >= t.prefill_ms > 0
    assert {r[-1].route.prefill_worker for r in results} == {"prefill-0", "prefill-1"}  # queued tokens spread them


def test_local_prefill_path_equals_monolithic(stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    batch = prompts(2, 3, 3)  # 3..5 tokens < local_prefill_tokens
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda p: generate(stub, p, max_tokens=10, ignore_eos=True), batch))
    expected = make_engine(tiny_llama_dir, block_size=16).generate(batch, SamplingParams(max_tokens=10, ignore_eos=True))
    for got, want in zip(results, expected, strict=True):
        assert got[-1].route.local_prefill and got[-1].route.prefill_worker == ""
        assert got[-1].timing.transfer_ms == got[-1].timing.transfer_window_ms == 0
        assert tokens_of(got) == want.token_ids


def test_seeded_sampling_is_the_same_on_every_path(stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    """A seed fixes the tokens whoever samples them: P's first token and D's rest, or D alone."""
    remote, local = prompts(31, 1, 40)[0], prompts(32, 1, 4)[0]
    sampling = dict(max_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.95, seed=1234)
    got_remote, got_local = generate(stub, remote, **sampling), generate(stub, local, **sampling)
    assert got_remote[-1].route.prefill_worker and got_local[-1].route.local_prefill
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.95, seed=1234)
    want = make_engine(tiny_llama_dir, block_size=16).generate([remote, local], params)
    assert tokens_of(got_remote) == want[0].token_ids and tokens_of(got_local) == want[1].token_ids
    other = make_engine(tiny_llama_dir, block_size=16).generate([remote], dataclasses.replace(params, seed=1235))
    assert other[0].token_ids != want[0].token_ids  # the seed matters (the model is not near-greedy)


def test_text_prompt_stop_string_and_first_token_finish(stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_dir, block_size=16)
    prompt = "Once upon a time, in a land far away, there lived"
    want = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    got = generate(stub, prompt, max_tokens=20, ignore_eos=True)
    assert tokens_of(got) == want.token_ids and "".join(r.text for r in got) == want.text
    stop = want.text[len(want.text) // 2:][:3]
    want_stop = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    got_stop = generate(stub, prompt, max_tokens=20, ignore_eos=True, stop=[stop])
    assert "".join(r.text for r in got_stop) == want_stop.text
    assert got_stop[-1].finish_reason == pb.FINISH_REASON_STOP
    one = generate(stub, prompt, max_tokens=1)  # ends on the prefill worker: no hand-off
    assert tokens_of(one) == want.token_ids[:1] and one[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_repeated_prompt_is_cached_where_its_prefix_is(stub, cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    prompt = prompts(3, 1, 100)[0]
    first = generate(stub, prompt)[-1]
    assert first.usage.cached_tokens == 0
    # the workers' KV events reach the router's index through Redis, and the decode worker's
    # heartbeat says the first request is gone (a stale active count outweighs 96 cached tokens)
    deadline = time.monotonic() + 10
    while (min((stats := cluster.router_stats()[0])["index_blocks"].get(w, 0)
               for w in (first.route.decode_worker, first.route.prefill_worker)) < 6
           or stats["active"].get(first.route.decode_worker, 0)):
        assert time.monotonic() < deadline, cluster.router_stats()
        time.sleep(0.1)
    assert not first.route.local_prefill
    again = generate(stub, prompt)[-1]
    assert again.usage.cached_tokens == 96  # 6 full blocks of 16 on the decode worker...
    assert again.route.decode_worker == first.route.decode_worker
    assert again.route.local_prefill  # ...so only 4 tokens are left: it prefills them itself
    sibling = generate(stub, prompt[:96] + prompts(7, 1, 30)[0])[-1]  # same prefix, 30 new tokens
    assert not sibling.route.local_prefill
    assert sibling.usage.cached_tokens == 96  # the prefill worker's own cache
    assert sibling.route.prefill_worker == first.route.prefill_worker
    assert sibling.route.decode_worker == first.route.decode_worker
    other_tenant = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), tenant="other",
                                                         sampling=pb.SamplingParams(max_tokens=4)), timeout=60))
    assert other_tenant[-1].usage.cached_tokens == 0


def test_client_cancellation_frees_blocks(stub, cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    for prompt in (prompts(4, 1, 60)[0], [5, 6, 7]):  # remote and local prefill
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                sampling=pb.SamplingParams(max_tokens=900, ignore_eos=True)), timeout=60)
        got = [next(call) for _ in range(3)]
        assert all(r.token_ids for r in got)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert_idle(cluster)


def test_deadline_expiry_frees_blocks(stub, cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompts(5, 1, 40)[0], timeout=0.5, max_tokens=900, ignore_eos=True)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(cluster)


@pytest.mark.parametrize(("prompt", "sampling", "message"), [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    ([1] * 2048, {}, "prompt has 2048 tokens; the model's context is 2048"),
    ([1, 2], {"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ([1, 2], {"max_tokens": -3}, "max_tokens must be at least 1, got -3"),
    ([1, 2], {"temperature": -0.5}, "temperature must be a finite number >= 0 (0 is greedy), got -0.5"),
    ([1, 2], {"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ([1, 2], {"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ([1, 9999, 512], {}, "token ids [9999, 512] are outside the model's vocabulary [0, 512)"),
])
def test_bad_requests_are_invalid_argument(stub, prompt, sampling, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def _named(prompt: list[int], request_id: str, tenant: str = "", **sampling) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(request_id=request_id, tenant=tenant, sampling=pb.SamplingParams(**sampling))
    req.token_ids.ids.extend(prompt)
    return req


def test_client_request_ids_never_meet_a_workers_ids(stub, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    """`a#1` beside `a` with n=2 once overwrote a choice on the worker and killed its engine loop.
    Client ids are now only shown back: each caller gets its own tokens under its own id; a name
    is refused (ALREADY_EXISTS) only beside a running request of the same tenant."""
    [prompt] = prompts(8, 1, 20)
    # 20 + 2 x 400 tokens of the 1,000-token budget: "a" runs for a while, and the others fit beside it
    first = stub.Generate(_named(prompt, "a", n=2, max_tokens=400, ignore_eos=True), timeout=120)
    head = next(first)  # "a" runs (its choices forked) while the others come
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_named(prompt, "a", max_tokens=2), timeout=60))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'a' is already running" in e.value.details()
    mine = list(stub.Generate(_named(prompt, "a#1", max_tokens=5, ignore_eos=True), timeout=60))
    assert {r.request_id for r in mine} == {"a#1"} and {r.choice for r in mine} == {0}
    other = list(stub.Generate(_named(prompt, "a", tenant="t2", max_tokens=3, ignore_eos=True), timeout=60))
    assert {r.request_id for r in other} == {"a"} and len(tokens_of(other)) == 3
    assert tokens_of(mine) == make_engine(tiny_llama_dir, block_size=16).generate(
        [prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    rest = [head, *first]
    assert {r.request_id for r in rest} == {"a"}
    per_choice = {c: [t for r in rest if r.choice == c for t in r.token_ids] for c in (0, 1)}
    assert {c: len(t) for c, t in per_choice.items()} == {0: 400, 1: 400}
    again = list(stub.Generate(_named(prompt, "a", max_tokens=2, ignore_eos=True), timeout=60))  # the name is free again
    assert len(tokens_of(again)) == 2


def test_overload_is_refused_early_with_retry_hint(stub) -> None:  # type: ignore[no-untyped-def]
    # Each request costs 10 + 400 tokens of the router's 1000-token budget: 2 run, 3 queue, the rest are refused.
    def one(i: int):  # type: ignore[no-untyped-def]
        try:
            return generate(stub, [3 + i] * 10, max_tokens=400, ignore_eos=True, timeout=600)  # nor its deadline
        except grpc.RpcError as e:
            return e
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(one, range(10)))
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    done = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert len(done) == 5 and all(tokens_of(d).__len__() == 400 for d in done), [e.details() for e in refused]
    assert len(refused) == 5
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue for priority 0 is full" in e.details()
        retry = dict(e.trailing_metadata())["retry-after-ms"]
        assert int(retry) >= 200
    assert any(d[-1].timing.queue_ms > 100 for d in done)  # the queued ones waited


def test_generic_reflection_client_can_call_generate(cluster: LocalCluster) -> None:
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(cluster.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "splitserve.v1.Generation" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("splitserve.v1.Generation").FindMethodByName("Generate")
        Request = message_factory.GetMessageClass(method.input_type)
        Response = message_factory.GetMessageClass(method.output_type)
        request = Request()
        request.text = "Hello"
        request.sampling.max_tokens = 4
        rpc = channel.unary_stream("/splitserve.v1.Generation/Generate",
                                   request_serializer=Request.SerializeToString,
                                   response_deserializer=Response.FromString)
        responses = list(rpc(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4
    assert responses[-1].usage.completion_tokens == 4


def test_health_service_reports_serving(cluster: LocalCluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_redis_away_means_load_only_routing(stub, cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
    """Stops the cluster's Redis server for a while, then starts it again (on the same port:
    the tests after this one find the cluster as it was)."""
    assert cluster.redis is not None
    cluster.supervise_redis = False
    os.kill(cluster.redis.pid, signal.SIGTERM)  # the server goes; its config stays, to start it again
    try:
        wait_for("the router to see Redis away", lambda: not cluster.router_stats()[0]["redis_healthy"], 30)
        for p in prompts(6, 2, 40) + [[7, 8]]:
            got = generate(stub, p, max_tokens=6, ignore_eos=True)
            assert len(tokens_of(got)) == 6
        (stats,) = cluster.router_stats()
        assert stats["redis_healthy"] is False
    finally:
        cluster.redis.restart()
        cluster.supervise_redis = True
    wait_for("the router to see Redis back", lambda: cluster.router_stats()[0]["redis_healthy"], 30)
    wait_for("every worker back in the registry", lambda: len(cluster.router_stats()[0]["members"]) == 4, 30)
