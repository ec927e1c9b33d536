"""Tracing off (no endpoint configured): spans record nothing and calls carry no trace metadata."""
from __future__ import annotations

import pytest
from opentelemetry import trace

from control import tracing


@pytest.fixture(autouse=True)
def no_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)


def test_without_an_endpoint_nothing_is_recorded_or_sent() -> None:
    assert not tracing.setup("splitserve-router", "router-0", None)
    span = tracing.child("router.generate", tracing.extract([("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")]),
                         tracing.SpanKind.SERVER, splitserve__request_id="r1")
    assert not span.is_recording() and tracing.headers(span) == ()
    tracing.end(span, gen_ai__usage__output_tokens=3)  # a no-op, not an error


def test_the_callers_context_is_read_from_grpc_metadata() -> None:
    ctx = tracing.extract([("x-splitserve-token", "t"), ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")])
    parent = trace.get_current_span(ctx).get_span_context()
    assert (format(parent.trace_id, "032x"), format(parent.span_id, "016x")) == ("a" * 32, "b" * 16)
    assert tracing.extract([("x-splitserve-token", "t")]) is None
