"""OpenTelemetry traces at hop boundaries, never per token (torch-free).

One request is one trace across three processes:

  router.generate (router; root, or the client's `traceparent` as parent)
    router.admit, router.route              (router)
    prefill.forward -> kvfabric.transfer    (prefill worker; the transfer has the push's own times)
    decode.stream                           (decode worker)

The W3C trace context crosses each process boundary in gRPC metadata (`traceparent`); the
spans are made with explicit parents (`Context` values passed along, never the ambient
"current span"), so nothing depends on which asyncio task or thread runs a piece.

Off unless an OTLP endpoint is configured (`--otlp-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT`): then `tracer()` is OpenTelemetry's no-op tracer, spans are
non-recording, and no metadata is added to calls. On, each process exports its spans over
OTLP/gRPC in batches from a background thread (`BatchSpanProcessor`).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
EXPORT_DELAY_MS = 500
"""How long finished spans wait to be exported in a batch."""

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer = trace.NoOpTracer()
_provider: Any = None
NO_SPAN: Span = trace.INVALID_SPAN
"""A span that records nothing (the default where no request span exists)."""

__all__ = ["Context", "Span", "SpanKind", "child", "end", "extract", "headers", "setup", "shutdown", "tracer"]


def setup(service: str, instance: str, endpoint: str | None = None) -> bool:
    """Exports this process's spans to `endpoint` (else `$OTEL_EXPORTER_OTLP_ENDPOINT`) as
    `service` / `instance`; True when tracing is on. A process sets it up once."""
    global _tracer, _provider
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    insecure = not endpoint.startswith("https://")
    _provider = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
                                                    schedule_delay_millis=EXPORT_DELAY_MS))
    _tracer = _provider.get_tracer("splitserve")
    logger.info("%s %s: exporting traces to %s", service, instance, endpoint)
    return True


def shutdown() -> None:
    """Exports what is left (bounded by the exporter's timeout)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> Tracer:
    return _tracer


def enabled() -> bool:
    return _provider is not None


def extract(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata (None when it sent none)."""
    carrier = {k: v for k, v in metadata or () if k == "traceparent" or k == "tracestate"}
    return _propagator.extract(carrier) if carrier else None


def headers(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes the callee's spans children of `span` (empty when not recording)."""
    if not span.is_recording():
        return ()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def child(name: str, parent: Span | Context | None, kind: SpanKind = SpanKind.INTERNAL,
          start_ns: int | None = None, **attributes: Any) -> Span:
    """A started span under `parent` (a span, a context from `extract`, or None for a root)."""
    if _provider is None:
        return trace.INVALID_SPAN
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return _tracer.start_span(name, context=context, kind=kind, start_time=start_ns,
                              attributes={k.replace("__", "."): v for k, v in attributes.items() if v is not None}
                              if attributes else None)


def end(span: Span, end_ns: int | None = None, **attributes: Any) -> None:
    """Sets the attributes (`gen_ai__usage__input_tokens` names `gen_ai.usage.input_tokens`) and ends."""
    if span.is_recording():
        for k, v in attributes.items():
            if v is not None:
                span.set_attribute(k.replace("__", "."), v)
    span.end(end_time=end_ns)
