"""OpenTelemetry traces of a disaggregated request across its three processes.

A real OTLP receiver (a gRPC server in this test implementing the collector's TraceService
from opentelemetry-proto) gets the spans the router, the prefill worker and the decode
worker (Ray actors) export. One request is one trace: the client's `traceparent` is its
parent, and every span links to the right one with its attributes set; the context reaches
the decode worker's `kvfabric.receive` through the kvfabric `open` message.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from cluster.local import LocalCluster
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import one_and_one

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

HOPS = ("router.generate", "router.admit", "router.route", "prefill.forward", "kvfabric.transfer", "kvfabric.receive",
        "decode.stream")


@dataclasses.dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return [_value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        for rs in request.resource_spans:
            service = next(_value(a.value) for a in rs.resource.attributes if a.key == "service.name")
            for scope in rs.scope_spans:
                with self.lock:
                    self.spans += [Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes}) for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, timeout_s: float = 30.0) -> dict[str, Span]:
        """The trace's spans by name, once every hop has arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                found = {s.name: s for s in self.spans if s.trace_id == trace_id}
            if set(HOPS) <= set(found):
                return found
            time.sleep(0.2)
        raise AssertionError(f"trace {trace_id}: only {sorted(found)} arrived")


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    r = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield r, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str, receiver: tuple[Receiver, str]) -> Iterator[LocalCluster]:
    config = one_and_one(tiny_llama_dir)
    config = dataclasses.replace(config, worker=dataclasses.replace(config.worker, otlp_endpoint=receiver[1]),
                                 router=dataclasses.replace(config.router, otlp_endpoint=receiver[1], http_port=0))
    with LocalCluster(config) as c:
        yield c


def generate(cluster: LocalCluster, prompt: list[int], metadata: tuple[tuple[str, str], ...] = ()) -> pb.GenerateResponse:
    with grpc.insecure_channel(cluster.address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True)),
            metadata=metadata or None, timeout=60))
    return responses[-1]


def test_one_request_is_one_trace_across_three_processes(cluster: LocalCluster, receiver: tuple[Receiver, str]) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    prompt = list(range(10, 50))  # 40 uncached tokens: prefilled on the prefill worker, pushed over kvfabric
    final = generate(cluster, prompt, (("traceparent", f"00-{trace_id}-{client_span}-01"),))
    assert final.route.prefill_worker == "prefill-0"
    spans = receiver[0].trace(trace_id)
    gen = spans["router.generate"]
    assert gen.parent_id == client_span  # the client's traceparent is honoured
    assert {n: spans[n].parent_id for n in HOPS[1:]} == {
        "router.admit": gen.span_id, "router.route": gen.span_id, "prefill.forward": gen.span_id,
        "kvfabric.transfer": spans["prefill.forward"].span_id, "kvfabric.receive": spans["prefill.forward"].span_id,
        "decode.stream": gen.span_id}  # kvfabric.receive: its context came in the kvfabric open, not over gRPC
    assert {n: spans[n].service for n in HOPS} == {
        "router.generate": "splitserve-router", "router.admit": "splitserve-router", "router.route": "splitserve-router",
        "prefill.forward": "splitserve-prefill", "kvfabric.transfer": "splitserve-prefill",
        "kvfabric.receive": "splitserve-decode", "decode.stream": "splitserve-decode"}
    a = gen.attributes
    assert (a["splitserve.request_id"], a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        final.request_id, 40, 5)
    assert (a["gen_ai.response.finish_reasons"], a["rpc.grpc.status_code"]) == (["length"], 0)
    assert (a["splitserve.prefill_worker"], a["splitserve.decode_worker"]) == ("prefill-0", "decode-0")
    assert spans["router.route"].attributes["splitserve.prefill_worker"] == "prefill-0"
    assert spans["prefill.forward"].attributes["splitserve.prefill_chunks"] == 1  # 40 tokens: one step
    t = spans["kvfabric.transfer"].attributes
    assert t["splitserve.transport"] == "shm" and t["splitserve.blocks"] == 40 // 16 + 1
    assert t["splitserve.bytes"] % t["splitserve.blocks"] == 0 and t["splitserve.seconds"] > 0
    assert spans["decode.stream"].attributes["gen_ai.usage.output_tokens"] == 5  # the first (from prefill) included
    assert spans["decode.stream"].attributes["splitserve.preemptions"] == 0


def test_a_request_without_a_traceparent_starts_its_own_trace(cluster: LocalCluster,
                                                              receiver: tuple[Receiver, str]) -> None:
    final = generate(cluster, list(range(60, 100)))
    r = receiver[0]
    deadline = time.monotonic() + 30
    while not (roots := [s for s in r.spans if s.name == "router.generate"
                         and s.attributes.get("splitserve.request_id") == final.request_id]):
        assert time.monotonic() < deadline, "the request's root span never arrived"
        time.sleep(0.2)
    assert roots[0].parent_id == ""
    assert set(HOPS) <= set(r.trace(roots[0].trace_id))


def test_an_http_request_honours_its_traceparent_header(cluster: LocalCluster, receiver: tuple[Receiver, str]) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    request = urllib.request.Request(
        f"http://{cluster.info['http_address']}/v1/completions", method="POST",
        data=json.dumps({"prompt": list(range(110, 150)), "max_tokens": 5, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Traceparent": f"00-{trace_id}-{client_span}-01"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 5
    spans = receiver[0].trace(trace_id)  # every hop, in the client's trace
    gen = spans["router.generate"]
    assert gen.parent_id == client_span and gen.attributes["gen_ai.usage.output_tokens"] == 5
    assert spans["decode.stream"].parent_id == gen.span_id
